"""The subset CI runs on the oldest supported Keras takes a test for every entry naming one.

An entry of conftest.OLDEST_KERAS that no test id contains (a test or a shape renamed)
would drop its part of the subset without a word.
"""

import os

import conftest
from runs import environ, python

HERE = os.path.dirname(os.path.abspath(__file__))


def test_every_entry_takes_at_least_one_test():
    collected = python(
        ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
         "oldest_keras", *sorted(conftest.OLDEST_KERAS)], env=environ(), cwd=HERE, timeout=300)
    assert collected.returncode == 0, (collected.stdout + collected.stderr)[-3000:]
    ids = {}
    for line in collected.stdout.splitlines():
        if "::" in line:
            ids.setdefault(os.path.basename(line.split("::", 1)[0]), []).append(line)
    unmatched = [(name, part) for name, parts in conftest.OLDEST_KERAS.items()
                 for part in parts if not any(part in test for test in ids.get(name, ()))]
    assert not unmatched, f"entries of OLDEST_KERAS that take no test: {unmatched}"
