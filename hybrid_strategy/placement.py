"""Decides where each variable lives: mirrored on every worker device, or on a PS task.

Pure Python: no TensorFlow, so the rules can be read and tested on their own. The
strategy's variable creator describes each new variable as a `VariableInfo` and asks
a `PlacementPolicy` for a `Placement`; the policy keeps every decision in a
`PlacementPlan` that users can print.

```python
policy = PlacementPolicy("hybrid", num_ps=2)
info = VariableInfo("embedding/embeddings", (50_000, 64), 4, ("Embedding", "Layer"))
print(policy.decide(info))   # Placement(kind='ps', ps_task=0)
```
"""

import dataclasses
import fnmatch
import math

ARCHITECTURES = ("hybrid", "allreduce", "ps")
MIRRORED = "mirrored"
PS = "ps"
PLACEMENT_KINDS = (MIRRORED, PS)

# Layer classes whose weights are read by row (their gradients are IndexedSlices).
SPARSE_LAYER_CLASSES = ("Embedding",)


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """What the policy knows about a variable at creation time.

    Attributes:
        path: Keras-style path, e.g. "dense_1/kernel".
        shape: Full shape of the variable.
        itemsize: Bytes per element.
        layer_classes: Names of the building layer's class and its bases, most
            derived first; empty when the variable is not a layer weight (optimizer
            iterations, metrics).
        trainable: Whether gradients will flow into it.
    """

    path: str
    shape: tuple
    itemsize: int
    layer_classes: tuple = ()
    trainable: bool = True

    @property
    def nbytes(self):
        return math.prod(int(d) for d in self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one variable lives: `kind` is "mirrored" or "ps"; `ps_task` for "ps"."""

    kind: str
    ps_task: int | None = None

    def __str__(self):
        if self.kind == MIRRORED:
            return MIRRORED
        return "ps (local CPU)" if self.ps_task is None else f"/job:ps/task:{self.ps_task}"


@dataclasses.dataclass(frozen=True)
class PlacementRecord:
    """One decided variable, as reported by `PlacementPlan`."""

    path: str
    shape: tuple
    nbytes: int
    placement: Placement
    reason: str


class PlacementPlan:
    """The decisions made so far, in creation order; `str(plan)` is a table."""

    def __init__(self):
        self._records = {}

    def add(self, record):
        self._records[record.path] = record

    def __getitem__(self, path):
        return self._records[path]

    def __contains__(self, path):
        return path in self._records

    def __iter__(self):
        return iter(self._records.values())

    def __len__(self):
        return len(self._records)

    def bytes_per_ps_task(self, num_ps):
        totals = [0] * num_ps
        for record in self:
            if record.placement.ps_task is not None:
                totals[record.placement.ps_task] += record.nbytes
        return totals

    def __str__(self):
        rows = [("variable", "shape", "bytes", "placement", "why")]
        rows += [
            (r.path, "x".join(str(d) for d in r.shape) or "scalar",
             f"{r.nbytes:,}", str(r.placement), r.reason)
            for r in self
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in rows
        )


def validate_overrides(overrides):
    """Checks a `{pattern: "ps" | "mirrored"}` mapping; returns it as a dict."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise TypeError(
            "placement_overrides must be a dict mapping a variable path pattern "
            'to "ps" or "mirrored", e.g. {"decoder/kernel": "ps"}; '
            f"got {type(overrides).__name__}."
        )
    for pattern, kind in overrides.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"placement_overrides key {pattern!r} must be a non-empty string "
                'pattern over variable paths such as "embedding/*" or "dense/kernel".'
            )
        if kind not in PLACEMENT_KINDS:
            raise ValueError(
                f"placement_overrides[{pattern!r}] is {kind!r}; use one of "
                f"{PLACEMENT_KINDS}."
            )
    return dict(overrides)


class PlacementPolicy:
    """Places variables by architecture, layer type and user overrides.

    Rules, first match wins:
      1. a user override whose pattern matches the path, or the path's first
         component (the layer name), places it;
      2. `architecture="allreduce"`: mirrored; `"ps"`: every layer weight on a PS;
      3. `"hybrid"`: weights of Embedding layers (and subclasses) on a PS,
         everything else mirrored.
    PS variables go whole to the task holding the fewest bytes so far (greedy
    by size, as Parallax balances its servers). Non-layer variables (optimizer
    counters, metrics) are always mirrored and left out of the plan. Without PS
    tasks (single machine), "ps" variables live on the local CPU (`ps_task=None`).

    Args:
        architecture: "hybrid", "allreduce" or "ps".
        num_ps: Number of PS tasks (0 or more).
        overrides: `{fnmatch pattern: "ps" | "mirrored"}` over variable paths.
    """

    def __init__(self, architecture="hybrid", num_ps=1, overrides=None):
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture={architecture!r} is not supported; use one of "
                f"{ARCHITECTURES}."
            )
        if not isinstance(num_ps, int) or num_ps < 0:
            raise ValueError(f"num_ps must be an int >= 0, got {num_ps!r}.")
        self.architecture = architecture
        self.num_ps = num_ps
        self.overrides = validate_overrides(overrides)
        self.plan = PlacementPlan()
        self._ps_bytes = [0] * num_ps

    def decide(self, info):
        """Returns the `Placement` of `info` and records it in `self.plan`."""
        kind, reason = self._kind(info)
        if kind == PS and self.num_ps:
            task = min(range(self.num_ps), key=self._ps_bytes.__getitem__)
            self._ps_bytes[task] += info.nbytes
            placement = Placement(PS, task)
        else:
            placement = Placement(kind)
        if not info.layer_classes:
            return placement
        self.plan.add(PlacementRecord(info.path, tuple(info.shape), info.nbytes,
                                      placement, reason))
        return placement

    def _kind(self, info):
        layer_name = info.path.split("/", 1)[0]
        for pattern, kind in self.overrides.items():
            if fnmatch.fnmatchcase(info.path, pattern) or fnmatch.fnmatchcase(
                    layer_name, pattern):
                return kind, f"override {pattern!r}"
        if not info.layer_classes:
            return MIRRORED, "not a layer weight"
        if self.architecture == "allreduce":
            return MIRRORED, "architecture 'allreduce'"
        if self.architecture == "ps":
            return PS, "architecture 'ps'"
        sparse = [c for c in info.layer_classes if c in SPARSE_LAYER_CLASSES]
        if sparse:
            layer = info.layer_classes[0]
            return PS, (f"{layer} layer" if layer == sparse[0]
                        else f"{layer} subclasses {sparse[0]}")
        return MIRRORED, "dense layer weight"


def gradient_misfit(placement_kind, gradient_is_sparse):
    """Returns advice when a variable's gradient type does not fit its placement."""
    if placement_kind == PS and not gradient_is_sparse:
        return ("is on a PS but gets a dense gradient: the whole variable crosses "
                "the network every step; placing it 'mirrored' would be cheaper")
    if placement_kind == MIRRORED and gradient_is_sparse:
        return ("is mirrored but gets a sparse (IndexedSlices) gradient: every "
                "worker gathers every other worker's rows; placing it on 'ps' "
                "would be cheaper")
    return None
