"""The registry of run-time patches and the supported versions: declared, checked, installed.

Every patch HybridStrategy installs is declared in keras_integration/patches.py and
nothing else is installed; a target that moved or changed its parameters is refused
with one error naming the versions; setup.py, versions.py and docs/patches.md agree.
"""

import json
import os
import re
import sys
import types

import numpy as np
import pytest

import hybrid_strategy
from hybrid_strategy import versions
from hybrid_strategy.keras_integration import patch as patch_lib
from hybrid_strategy.keras_integration import registry
from hybrid_strategy.keras_integration.patches import PATCHES
from runs import environ, python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def strategy():
    return hybrid_strategy.HybridStrategy()


# In a fresh process: what a strategy installs, and what the registry expects of it.
INSTALLED = """
import json
import hybrid_strategy
from hybrid_strategy.keras_integration import patch, registry
hybrid_strategy.HybridStrategy()
print(json.dumps({"installed": sorted(registry.installed()),
                  "declared": sorted(p.name for p in registry.PATCHES
                                     if registry.applicable(p) and p.gate != patch.AT_EXIT)}))
"""


@pytest.mark.parametrize("legacy", ["0", "1"], ids=["keras3", "tf_keras"])
def test_every_declared_patch_is_installed_and_nothing_else(legacy):
    out = python(["-c", INSTALLED], env=environ("tf_keras" if legacy == "1" else "keras3"),
                 timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["installed"] == report["declared"]
    if legacy == "1":
        assert any(name.endswith("tf_keras") for name in report["installed"])


def test_entries_are_unique_and_replacements_say_why():
    names = [patch.name for patch in PATCHES]
    assert len(names) == len(set(names)), "two entries share a name"
    for patch in PATCHES:
        module = patch.name.split(".")[0]
        assert os.path.exists(os.path.join(
            REPO, "hybrid_strategy", "keras_integration", f"{module}.py")), (
            f"{patch.name}: its name must start with the keras_integration module that "
            "installs it")
        assert (patch.kind == patch_lib.REPLACE) == bool(patch.why_replaced), patch.name
        for before in patch.after:
            assert before in names, f"{patch.name} wraps {before}, which is not declared"


def test_every_installed_target_matches_its_declaration(strategy):
    del strategy
    registry.verify()


def test_tf_shape_of_a_keras_variable_refuses_what_tf_shape_refuses(strategy):
    # table_hooks.static_shape answers statically; an out_type other than int32 and
    # int64 still gets tf.shape's own error.
    import keras  # pylint: disable=import-outside-toplevel  (Keras 3)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    del strategy
    variable = keras.Variable(np.ones((3, 2), "float32"))
    assert tf.shape(variable, out_type=tf.int64).numpy().tolist() == [3, 2]
    for out_type in (tf.float32, "int16"):
        with pytest.raises(tf.errors.InvalidArgumentError, match="out_type"):
            tf.shape(variable, out_type=out_type)


def _fake_target_module(monkeypatch, method):
    module = types.ModuleType("fake_keras_target")
    module.Trainer = type("Trainer", (), {"fit": method})
    monkeypatch.setitem(sys.modules, "fake_keras_target", module)


def _declared(**changes):
    fields = dict(name="fake.fit_logged", framework="keras",
                  target="fake_keras_target:Trainer.fit", kind=patch_lib.WRAP,
                  gate=patch_lib.STRATEGY, purpose="Logs each fit.", params=("self", "x"),
                  checks=(patch_lib.RUN, "fit checks x; the patch calls it with x."))
    fields.update(changes)
    return patch_lib.Patch(**fields)


def test_a_target_with_other_parameters_is_refused_naming_versions(monkeypatch):
    _fake_target_module(monkeypatch, lambda self, x, y: None)
    with pytest.raises(versions.UnsupportedVersionError) as raised:
        registry.verify([_declared()])
    message = str(raised.value)
    assert "fake_keras_target:Trainer.fit: parameters (self, x, y), written against (self, x)" \
        in message
    assert f"keras {versions.installed('keras')}" in message
    assert versions.describe_supported() in message


def test_a_missing_target_is_refused(monkeypatch):
    _fake_target_module(monkeypatch, lambda self, x: None)
    with pytest.raises(versions.UnsupportedVersionError, match="no such attribute"):
        registry.verify([_declared(target="fake_keras_target:Trainer.evaluate")])
    with pytest.raises(versions.UnsupportedVersionError, match="ModuleNotFoundError"):
        registry.verify([_declared(target="keras.src.no_such_module:Trainer.fit")])


def test_a_matching_target_passes(monkeypatch):
    _fake_target_module(monkeypatch, lambda self, x: None)
    registry.verify([_declared()])


def test_declarations_are_checked_when_made():
    with pytest.raises(ValueError, match="why_replaced"):
        _declared(kind=patch_lib.REPLACE)
    with pytest.raises(ValueError, match="gate"):
        _declared(gate="sometimes")
    with pytest.raises(ValueError, match="framework"):
        _declared(framework="jax")


@pytest.mark.parametrize("checks", [None, (), ("checked", "fit checks x."), (patch_lib.RUN, ""),
                                    patch_lib.RUN])
def test_an_entry_that_does_not_say_what_its_target_checks_is_refused(checks):
    with pytest.raises(ValueError, match="checks must say what the target validates"):
        _declared(checks=checks)


def test_a_replacement_or_addition_cannot_claim_the_target_checks_run():
    with pytest.raises(ValueError, match="does not call the target on every path"):
        _declared(kind=patch_lib.REPLACE, why_replaced="why", checks=(patch_lib.RUN, "x"))
    with pytest.raises(ValueError, match="does not call the target on every path"):
        _declared(kind=patch_lib.ADD, params=None, checks=(patch_lib.RUN, "x"))


def test_every_entry_says_what_its_target_checks_and_how_it_is_kept():
    for patch in PATCHES:
        kept, line = patch.checks
        assert kept in patch_lib.CHECKS, patch.name
        assert line.strip() and "\n" not in line, patch.name


def test_versions_outside_the_range_are_refused_unless_allowed(monkeypatch):
    monkeypatch.setattr(versions, "installed",
                        lambda name: "3.13.2" if name == "keras" else "2.21.0")
    monkeypatch.delenv(versions.ALLOW_UNTESTED, raising=False)
    with pytest.raises(versions.UnsupportedVersionError, match=r"does not support keras 3\.13\.2"):
        versions.check_installed()
    monkeypatch.setenv(versions.ALLOW_UNTESTED, "1")
    versions.check_installed()


@pytest.mark.parametrize("version, supported", [
    ("3.13.2", False), ("3.14.0", True), ("3.15.1", True), ("3.16.0rc1", False),
    ("3.16.0", False), ("4.0", False)])
def test_keras_range(version, supported):
    assert versions.supports("keras", version) is supported


def test_setup_py_declares_the_same_ranges():
    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
        setup = f.read()
    for framework, (low, high) in versions.SUPPORTED.items():
        distribution = {"tf_keras": "tf-keras"}.get(framework, framework)
        found = re.search(rf'"{distribution}>=([\d.]+),<([\d.]+)"', setup)
        assert found, f"setup.py names no range for {distribution}"
        assert found.groups() == (low, high), (
            f"setup.py says {distribution}>={found.group(1)},<{found.group(2)}, versions.py "
            f"says >={low},<{high}")


def test_the_docs_page_is_generated_from_the_registry():
    with open(os.path.join(REPO, "docs", "patches.md"), encoding="utf-8") as f:
        assert f.read() == registry.markdown(), (
            "docs/patches.md is stale: python -m hybrid_strategy.keras_integration --markdown "
            "> docs/patches.md")


def test_the_command_prints_every_patch():
    run = python(["-m", "hybrid_strategy.keras_integration"], env=environ(), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = run.stdout
    for patch in PATCHES:
        assert patch.name in printed
        assert f"checks {patch.checks[0]}: {patch.checks[1]}" in printed
    assert f"{len(PATCHES)} patches" in printed
