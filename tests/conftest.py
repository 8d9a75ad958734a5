"""Makes the repository and tests/ importable, keeps TensorFlow's logs short, declares the
markers (`cluster`, `oldest_keras`), runs first the modules with no chief program in the
background (tests/runs.py), gives tests this machine's CPU cgroups (`cpu_groups_here`),
drops the background chief programs no test is left to read, and, with --durations,
lists the runs that took the most CPU."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: starts other processes (a local cluster, or a fresh Python for a "
        "scenario); deselect with -m 'not cluster' for the in-process tests alone")
    config.addinivalue_line(
        "markers", "oldest_keras: the quick subset CI also runs on the oldest supported Keras")


# The quick subset CI also runs on the oldest supported Keras (-m oldest_keras): the
# cluster equivalence tests under Keras 3 (tf_keras keeps its version there; the Keras 3
# patches it installs beside it are checked by test_patches and test_plain_keras),
# exports, a checkpoint restored on another number of PS tasks, plain Keras unchanged,
# the patches' own checks, and a dynamic table's slots restarting with an evicted id's
# row (recorded by a patch; the cluster's arithmetic around it does not change with
# Keras). Each entry is a part of the ids of the file's tests to take.
OLDEST_KERAS = {
    "test_equivalence.py": ("[2workers_1ps",),
    "test_serving.py": ("keras3",),
    "test_checkpoint.py": ("test_round_trip_on_the_cluster",
                           "test_restore_on_three_ps_reshards"),
    "test_saving_user_models.py": ("subclassed",),
    "test_plain_keras.py": ("",),
    "test_patches.py": ("",),
    "test_dynamic_embedding.py": ("test_an_evicted_id_comes_back",),
}


def pytest_collection_modifyitems(items):
    import runs  # pylint: disable=import-outside-toplevel
    for item in items:
        if any(part in item.nodeid for part in OLDEST_KERAS.get(item.path.name, ())):
            item.add_marker(pytest.mark.oldest_keras)
    # The modules with no chief program in the background (tests/runs.py) first: their
    # work in this process runs beside the others' programs, not after the last of them
    # with a core idle.
    items.sort(key=lambda item: runs.in_background(getattr(item, "module", None)))


@pytest.fixture
def cpu_groups_here():
    """benchmarks.cpu_groups' CpuGroups of one core, checked: where no CPU cgroup can be
    written (a developer's machine, not root) the test is skipped; CI, which runs as root,
    must have them: there it fails."""
    from benchmarks import cpu_groups  # pylint: disable=import-outside-toplevel
    try:
        return cpu_groups.CpuGroups(1.0).check()
    except cpu_groups.CpuGroupError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no writable CPU cgroups here: {e}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    if not (session.config.option.collectonly or session.config.option.setuponly):
        import runs  # pylint: disable=import-outside-toplevel
        runs.start_in_order(session.items)


def pytest_terminal_summary(terminalreporter, config):
    """With --durations N: the N scenario runs (tests/runs.py) that took the most CPU, their
    servers' included."""
    import runs  # pylint: disable=import-outside-toplevel
    count = config.option.durations
    if not count or not runs.CPU_SECONDS:
        return
    terminalreporter.write_sep("=", f"the {count} runs that took the most CPU "
                                    f"({sum(cpu for cpu, _ in runs.CPU_SECONDS):.0f} s in "
                                    f"{len(runs.CPU_SECONDS)} runs)")
    for cpu, command in sorted(runs.CPU_SECONDS, reverse=True)[:count]:
        terminalreporter.write_line(f"{cpu:7.1f}s  {command}")


def pytest_sessionfinish():
    import runs  # pylint: disable=import-outside-toplevel
    runs.end_session()
