"""`Patch`: the declaration of one run-time change of Keras, tf_keras or TensorFlow.

```python
from hybrid_strategy.keras_integration.patch import Patch, RUN, STRATEGY, WRAP
Patch("example.fit_logged", "keras", "keras.src.trainers.trainer:Trainer.fit", WRAP,
      STRATEGY, "Logs each fit.", params=("self",),
      checks=(RUN, "fit checks its arguments; the patch calls it with them."))
```
"""

import dataclasses

from hybrid_strategy import versions

WRAP = "wrap"  # calls the original, with changes before or after it
REPLACE = "replace"  # the original is not called (says why in `why_replaced`)
ADD = "add"  # an attribute the target does not have
REGISTER = "register"  # a handler given to a TensorFlow API (dispatch, graph transforms)
KINDS = (WRAP, REPLACE, ADD, REGISTER)

# Gates: when a patch changes what the target does. Outside them the target behaves
# as the unpatched one (tests/test_plain_keras.py checks plain Keras bit for bit).
STRATEGY = "under a HybridStrategy"
TABLES = "on PS tables of a HybridStrategy"
SPANS = "under a HybridStrategy that spans several devices or tasks"
ASYNCHRONOUS = "under a HybridStrategy(asynchronous=True)"
CLUSTER = "in a chief connected to a cluster"
AT_EXIT = "at the exit of a chief connected to a cluster"
DYNAMIC = "on the rows of a DynamicEmbedding, with or without a strategy"
GATES = (STRATEGY, TABLES, SPANS, ASYNCHRONOUS, CLUSTER, AT_EXIT, DYNAMIC)

# What the target validates of what it is given (paths, sizes, types, `safe_mode`, what
# it deserializes), and how the patch keeps that: a patch's `checks` is (one of these,
# one line saying what the target checks and how).
NO_CHECKS = "none"  # the target validates nothing: it computes, builds or registers
RUN = "run"  # the patch calls the target on every path, so its checks run unchanged
REPEATED = "repeated"  # where the patch skips the target, it makes the same checks first
CHECKS = (NO_CHECKS, RUN, REPEATED)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One run-time change of a Keras, tf_keras or TensorFlow attribute.

    Args:
        name: Unique, `<integration module>.<what it does>`.
        framework: "keras", "tf_keras" or "tensorflow": the package the target is in;
            tf_keras patches apply only when `tf.keras` is tf_keras.
        target: "module:attribute" or "module:Class.attribute".
        kind: WRAP, REPLACE, ADD or REGISTER.
        gate: When it acts, one of GATES.
        purpose: One line: what it changes and why.
        params: The parameter names the original must have (None: not checked).
        why_replaced: For REPLACE: why the original cannot be wrapped.
        after: Names of patches of the same target that must be installed first
            (this one wraps them).
        checks: (NO_CHECKS, RUN or REPEATED, a line): what the target validates and
            how the patch keeps it. Required: a patch must not skip a framework's checks
            (a weights file's links, a `.keras` file's `safe_mode`) unnoticed.
    """

    name: str
    framework: str
    target: str
    kind: str
    gate: str
    purpose: str
    params: tuple = None
    why_replaced: str = ""
    after: tuple = ()
    checks: tuple = None

    def __post_init__(self):
        if self.framework not in versions.FRAMEWORKS:
            raise ValueError(f"{self.name}: framework {self.framework!r} is not one of "
                             f"{versions.FRAMEWORKS}")
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.gate not in GATES:
            raise ValueError(f"{self.name}: gate {self.gate!r} is not one of {GATES}")
        if (self.kind == REPLACE) != bool(self.why_replaced):
            raise ValueError(f"{self.name}: a replacement, and only a replacement, says "
                             "why_replaced")
        if (not isinstance(self.checks, tuple) or len(self.checks) != 2
                or self.checks[0] not in CHECKS or not self.checks[1]):
            raise ValueError(f"{self.name}: checks must say what the target validates and "
                             f"how the patch keeps it: (one of {CHECKS}, a line)")
        if self.checks[0] == RUN and self.kind in (REPLACE, ADD):
            raise ValueError(f"{self.name}: a {self.kind} does not call the target on every "
                             "path: its checks are none or repeated")

    @property
    def module(self):
        return self.target.split(":")[0]

    @property
    def path(self):
        """(owner names within the module..., attribute)."""
        return tuple(self.target.split(":")[1].split("."))

    @property
    def checked(self):
        """The versions of its framework this patch was checked against."""
        return versions.CHECKED[self.framework]
