"""The versions of TensorFlow, Keras and tf_keras HybridStrategy supports, and those installed.

setup.py declares the same ranges, so that pip refuses the others at install time;
`check_installed()` refuses them at `HybridStrategy()` when they were installed
afterwards (`pip install keras==...`), since the run-time patches were checked only
against these.

```python
from hybrid_strategy import versions
print(versions.describe_supported())
versions.check_installed()
```
"""

import os
import re
from importlib import metadata

FRAMEWORKS = ("tensorflow", "keras", "tf_keras")

# (lowest supported, first unsupported): setup.py's install_requires say the same.
SUPPORTED = {
    "tensorflow": ("2.21", "2.22"),
    "keras": ("3.14", "3.16"),
    "tf_keras": ("2.21", "2.22"),
}

# The releases every run-time patch was checked against (CI runs both ends).
CHECKED = {
    "tensorflow": ("2.21.0",),
    "keras": ("3.14.0", "3.15.1"),
    "tf_keras": ("2.21.0",),
}

# Set to 1 to run on versions outside SUPPORTED (every patch's target is still checked).
ALLOW_UNTESTED = "HYBRID_STRATEGY_ALLOW_UNTESTED_VERSIONS"

_DISTRIBUTIONS = {"tensorflow": "tensorflow", "keras": "keras", "tf_keras": "tf-keras"}


class UnsupportedVersionError(ImportError):
    """An installed TensorFlow, Keras or tf_keras is outside what HybridStrategy supports."""


def legacy_keras():
    """The tf_keras module when `tf.keras` is tf_keras (TF_USE_LEGACY_KERAS), else None."""
    # The test by which TensorFlow's lazy loader routes `tf.keras` to tf_keras.
    if os.environ.get("TF_USE_LEGACY_KERAS", None) in ("true", "True", "1"):
        import tf_keras  # pylint: disable=import-outside-toplevel
        return tf_keras
    return None


def installed(framework):
    """The installed version of `framework`, or None."""
    try:
        return metadata.version(_DISTRIBUTIONS[framework])
    except metadata.PackageNotFoundError:
        return None


def in_use():
    """The frameworks this process trains with: TensorFlow, Keras 3, and tf_keras if
    `tf.keras` is it."""
    return FRAMEWORKS if legacy_keras() is not None else FRAMEWORKS[:2]


def _release(version):
    """(major, minor, patch) of a version string ("3.15.1", "2.22", "3.16.0rc1")."""
    numbers = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version).groups()
    return tuple(int(number or 0) for number in numbers)


def supports(framework, version):
    """Whether `version` of `framework` is in its SUPPORTED range."""
    low, high = SUPPORTED[framework]
    return _release(low) <= _release(version) < _release(high)


def describe_supported():
    return ", ".join(f"{name} >={low},<{high}" for name, (low, high) in SUPPORTED.items())


def describe_installed():
    return ", ".join(f"{name} {installed(name) or 'not installed'}" for name in in_use())


def check_installed():
    """Raises UnsupportedVersionError if a framework in use is outside SUPPORTED."""
    if os.environ.get(ALLOW_UNTESTED) == "1":
        return
    outside = [name for name in in_use()
               if installed(name) is not None and not supports(name, installed(name))]
    if outside:
        raise UnsupportedVersionError(
            f"HybridStrategy does not support {', '.join(f'{n} {installed(n)}' for n in outside)}"
            f" (installed: {describe_installed()}; supported: {describe_supported()}). "
            f"Install a supported version (pip install -e . picks one), or set "
            f"{ALLOW_UNTESTED}=1 to try this one: every patched target is still checked.")
