"""The one list of every run-time patch HybridStrategy makes to Keras, tf_keras and TensorFlow.

Each `Patch` names its target (a module, and a class attribute or module attribute
in it), whether it wraps the original, replaces it, adds an attribute the target
lacks or registers a handler with a TensorFlow API, when it acts (its gate), what
the target validates and how the patch keeps it (its checks), and the versions it
was checked against. `verify()` resolves every target of the installed frameworks
before anything is changed, so that a Keras release that moved or changed one fails
at `HybridStrategy()` with one error naming the versions, not deep inside a training
step; `install(name, make)` then applies one entry, once.

```python
from hybrid_strategy.keras_integration import registry
for patch in registry.PATCHES:
    print(patch.target, patch.kind, patch.gate, patch.checks)
```

`python -m hybrid_strategy.keras_integration` prints the list;
`--markdown` writes the page docs/patches.md is made of.
"""

import functools
import importlib
import inspect
import sys

from hybrid_strategy import versions
from hybrid_strategy.versions import UnsupportedVersionError
from hybrid_strategy.keras_integration.patch import (
    ADD, KINDS, NO_CHECKS, REGISTER, REPEATED, REPLACE, RUN, WRAP)
from hybrid_strategy.keras_integration.patches import PATCHES


_BY_NAME = {patch.name: patch for patch in PATCHES}
_CHECKS_LEGEND = (f"{NO_CHECKS}, the target validates nothing; {RUN}, the patch calls it on "
                  f"every path, so its checks run unchanged; {REPEATED}, where the patch "
                  "skips it, the patch makes the same checks first")
_installed = set()


def applicable(patch):
    """Whether `patch`'s framework is in use in this process."""
    return patch.framework in versions.in_use()


def _owner_and_original(patch):
    """(the object holding the attribute, its current value or None if absent)."""
    owner = importlib.import_module(patch.module)
    *owners, attribute = patch.path
    for name in owners:
        owner = getattr(owner, name)
    return owner, inspect.getattr_static(owner, attribute, None)


def _problem(patch):
    """What makes `patch`'s target other than it was written against, or None."""
    try:
        owner, original = _owner_and_original(patch)
    except (ImportError, AttributeError) as error:
        return f"{patch.target}: {type(error).__name__}: {error}"
    if patch.kind in (WRAP, REPLACE, REGISTER) and original is None:
        return f"{patch.target}: no such attribute on {getattr(owner, '__name__', owner)}"
    if patch.kind == ADD and original is not None and not _is_ours(original):
        return f"{patch.target}: already exists, so adding it would hide the framework's own"
    if patch.params is not None and patch.name not in _installed:
        function = original.fget if isinstance(original, property) else original
        function = getattr(function, "__func__", function)
        try:
            found = tuple(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            return f"{patch.target}: its signature cannot be read"
        if found != tuple(patch.params):
            return (f"{patch.target}: parameters ({', '.join(found)}), written against "
                    f"({', '.join(patch.params)})")
    return None


def verify(patches=None):
    """Checks every applicable patch's target; raises UnsupportedVersionError naming all.

    Called by `HybridStrategy()` before any patch is installed.
    """
    problems = [f"  {patch.name}: {problem}" for patch in (patches or PATCHES)
                if applicable(patch) and (problem := _problem(patch)) is not None]
    if problems:
        raise UnsupportedVersionError(
            f"HybridStrategy cannot patch this Keras/TensorFlow: {len(problems)} target(s) "
            f"differ from the versions it supports.\n" + "\n".join(problems) +
            f"\nInstalled: {versions.describe_installed()}.\nSupported: "
            f"{versions.describe_supported()}. Install a supported version "
            "(pip install -e . resolves one).")


def install(name, make):
    """Applies the patch `name` once: `make(original)` gives the new attribute.

    For ADD, `original` is None; for REGISTER, `make(target)` registers its handler
    and returns nothing. Returns whether it was installed now (False: already).
    """
    patch = _declared(name)
    if name in _installed:
        return False
    missing = [before for before in patch.after if before not in _installed]
    if missing:
        raise RuntimeError(f"Patch {name} wraps {missing}, which must be installed first.")
    verify([patch])
    owner, _ = _owner_and_original(patch)
    if patch.kind == REGISTER:
        make(getattr(owner, patch.path[-1]))
    else:
        original = None if patch.kind == ADD else getattr(owner, patch.path[-1])
        value = make(original)
        if inspect.isfunction(value) and inspect.isfunction(original):
            # The framework's name, docstring and signature (Keras reads `call`'s).
            functools.update_wrapper(value, original)
        if callable(value) or isinstance(value, property):
            _mark(value, name)
        setattr(owner, patch.path[-1], value)
    _installed.add(name)
    return True


def install_on(name, instance, make):
    """Applies the patch `name` to one object the strategy made, not to its class:
    `instance.attribute = make(its current bound attribute)`, checked like `install`.

    For a TensorFlow behaviour with no switch, where only the strategy's own objects
    may change.
    """
    patch = _declared(name)
    verify([patch])
    owner, _ = _owner_and_original(patch)
    if not isinstance(instance, owner):
        raise TypeError(f"Patch {name} applies to {owner.__name__} objects, "
                        f"not {type(instance).__name__}.")
    setattr(instance, patch.path[-1], make(getattr(instance, patch.path[-1])))
    _installed.add(name)


def _declared(name):
    if name not in _BY_NAME:
        raise KeyError(f"Patch {name} is not declared in keras_integration/patches.py: "
                       "every run-time patch must be.")
    return _BY_NAME[name]


def _mark(value, name):
    function = value.fget if isinstance(value, property) else value
    try:
        function._hybrid_strategy_patch = name
    except AttributeError:  # a builtin or a bound method: nothing to mark
        pass


def _is_ours(value):
    function = value.fget if isinstance(value, property) else value
    return getattr(function, "_hybrid_strategy_patch", None) is not None


def installed():
    """Names of the patches installed in this process."""
    return set(_installed)


def markdown():
    """The patch list as a Markdown page (docs/patches.md)."""
    counts = {kind: sum(patch.kind == kind for patch in PATCHES) for kind in KINDS}
    lines = [
        "# Run-time patches",
        "",
        "Generated by `python -m hybrid_strategy.keras_integration --markdown`: do not edit.",
        "",
        f"HybridStrategy patches {len(PATCHES)} attributes of Keras, tf_keras and TensorFlow: "
        + ", ".join(f"{counts[kind]} {kind}" for kind in KINDS) + ". Each acts only under "
        "its gate; outside it the target behaves as the framework's own. "
        "`HybridStrategy()` checks every target before installing any "
        "(hybrid_strategy/keras_integration/registry.py).",
        "",
        f"Supported: {versions.describe_supported()}.",
        "",
        "The checks column says what the target validates of what it is given (paths, "
        "sizes, types, `safe_mode`, what it deserializes) and how the patch keeps it: "
        f"{_CHECKS_LEGEND}.",
        "",
        "| patch | target | kind | gate | checked against | what and why | checks |",
        "|---|---|---|---|---|---|---|",
    ]
    for patch in PATCHES:
        why = patch.purpose
        if patch.why_replaced:
            why += f" Replaced, not wrapped: {patch.why_replaced}"
        if patch.after:
            why += f" Wraps {', '.join(patch.after)}."
        lines.append(f"| {patch.name} | `{patch.target}` | {patch.kind} | {patch.gate} | "
                     f"{patch.framework} {', '.join(patch.checked)} | {why} | "
                     f"{patch.checks[0]}: {patch.checks[1]} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    """Prints the patch list (`--markdown`: as docs/patches.md)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if argv:
        sys.stderr.write("usage: python -m hybrid_strategy.keras_integration [--markdown]\n")
        return 2
    width = max(len(patch.name) for patch in PATCHES)
    for patch in PATCHES:
        print(f"{patch.name:<{width}}  {patch.kind:<8}  {patch.target}\n"
              f"{'':<{width}}  {'':<8}  {patch.gate}; {patch.purpose}\n"
              f"{'':<{width}}  {'':<8}  checks {patch.checks[0]}: {patch.checks[1]}")
    print(f"{len(PATCHES)} patches; supported: {versions.describe_supported()}")
    return 0
