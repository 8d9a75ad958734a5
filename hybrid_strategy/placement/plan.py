"""Decides where each variable lives: mirrored on every worker device, or on a PS task.

Its rules read names, shapes and sizes, no tensors, so they can be read and tested on
their own. The strategy's variable creator describes each new variable as a
`VariableInfo` and asks a `PlacementPolicy` for a `Placement`; the policy keeps every
decision in a `PlacementPlan` that users can print.

```python
policy = PlacementPolicy("hybrid", num_ps=2)
info = VariableInfo("embedding/embeddings", (50_000, 64), 4, ("Embedding", "Layer"))
print(policy.decide(info))   # 2 shards on ps: 12.8 MB is split over both tasks
print(policy.plan)
```
"""

import dataclasses
import fnmatch
import json
import math

from hybrid_strategy.sharding.rows import shard_rows

ARCHITECTURES = ("hybrid", "allreduce", "ps")
MIRRORED = "mirrored"
PS = "ps"
PLACEMENT_KINDS = (MIRRORED, PS)
# Asynchronous training: one whole variable on one PS task, read and written by every
# worker's steps (what synchronous training mirrors: scalars, counters, metrics).
SHARED = "shared"

# Tables smaller than two of these stay whole on one PS task.
DEFAULT_MIN_SHARD_BYTES = 1 << 20
# A PS table that gets a dense gradient moves to mirrored if, with its optimizer slots,
# it takes at most this many bytes on each worker (every replica holds a copy).
DEFAULT_MAX_MIRRORED_BYTES = 1 << 31

# Layer classes whose weights are read by row (their gradients are IndexedSlices).
SPARSE_LAYER_CLASSES = ("Embedding", "DynamicEmbedding")


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    """What the policy knows about a variable at creation time.

    Attributes:
        path: The path Keras shows in `model.weights`, e.g. "encoder/dense_1/kernel"
            (Keras 3 `variable.path`; tf_keras: the variable name without ":0").
        shape: Full shape of the variable; None when not known at creation (a
            variable made outside a layer's `add_weight` under tf_keras).
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
        if self.shape is None:
            return 0
        return math.prod(int(d) for d in self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` of a `table_rows`-row PS table, on PS task `task` (None:
    the local CPU). It holds rows index, index + count, index + 2 * count, ... (the
    slice `index::count`), so the table's frequent rows, often its first ones, are
    spread over every shard."""

    task: int | None
    index: int
    count: int
    table_rows: int

    @property
    def rows(self):
        return shard_rows(self.table_rows, self.count)[self.index]

    @property
    def device_name(self):
        return "ps (local CPU)" if self.task is None else f"/job:ps/task:{self.task}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one variable lives: "mirrored", or "ps" split into `shards` by rows."""

    kind: str
    shards: tuple = ()

    @property
    def ps_tasks(self):
        return tuple(shard.task for shard in self.shards)

    def __str__(self):
        if self.kind == MIRRORED:
            return MIRRORED
        if self.kind == SHARED:
            return f"{self.shards[0].device_name} (whole)"
        if len(self.shards) == 1:
            return self.shards[0].device_name
        return f"{len(self.shards)} shards on ps"


@dataclasses.dataclass(frozen=True)
class PlacementRecord:
    """One decided variable, as reported by `PlacementPlan`."""

    path: str
    shape: tuple
    nbytes: int
    placement: Placement
    reason: str


@dataclasses.dataclass(frozen=True)
class Revision:
    """A move of one variable after its creation, as the `Placer` applied it."""

    path: str
    before: Placement
    after: Placement
    reason: str


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """The decisions made so far, in creation order, and the moves since: a value.

    `str(plan)` is a table; `plan.save(path)` writes it as JSON, and
    `HybridStrategy(placement_plan=path)` (or the plan itself) places the variables of
    the next run as it says, with none of the moves (`revisions`) made again.

    ```python
    from hybrid_strategy.placement.plan import PlacementPlan, PlacementPolicy, VariableInfo
    policy = PlacementPolicy("hybrid", num_ps=2)
    policy.decide(VariableInfo("emb/embeddings", (50_000, 64), 4, ("Embedding",)))
    policy.plan.save("/tmp/plan.json")
    print(PlacementPlan.load("/tmp/plan.json")["emb/embeddings"].placement)
    ```
    """

    records: tuple = ()
    revisions: tuple = ()
    # (rows' path, stats()) of the DynamicEmbedding tables listed: shown, not saved.
    dynamic: tuple = dataclasses.field(default=(), compare=False)

    def with_record(self, record):
        """This plan with `record` decided (replacing its path's earlier record)."""
        return dataclasses.replace(self, records=tuple(
            r for r in self.records if r.path != record.path) + (record,))

    def revised(self, path, placement, reason):
        """This plan with `path` moved to `placement`, the move kept in `revisions`."""
        record = self[path]
        return dataclasses.replace(
            self.with_record(dataclasses.replace(record, placement=placement, reason=reason)),
            revisions=self.revisions + (Revision(path, record.placement, placement, reason),))

    def with_dynamic(self, path, stats):
        """This plan listing the DynamicEmbedding whose rows are `path`; `stats()` gives
        its figures (`DynamicEmbedding.table_stats`), or None once the layer is gone."""
        return dataclasses.replace(self, dynamic=tuple(
            (p, f) for p, f in self.dynamic if p != path) + ((path, stats),))

    def dynamic_tables(self):
        """{rows' path: figures} of the DynamicEmbedding tables alive."""
        return {path: figures for path, stats in self.dynamic
                if (figures := stats()) is not None}

    def __getitem__(self, path):
        for record in self.records:
            if record.path == path:
                return record
        raise KeyError(path)

    def __contains__(self, path):
        return any(record.path == path for record in self.records)

    def __iter__(self):
        return iter(self.records)

    def __len__(self):
        return len(self.records)

    def bytes_per_ps_task(self, num_ps):
        totals = [0] * num_ps
        for record in self:
            row_bytes = record.nbytes // max(record.shape[0], 1) if record.shape else 0
            for shard in record.placement.shards:
                if shard.task is not None:
                    totals[shard.task] += shard.rows * row_bytes
        return totals

    def to_json(self):
        """The plan's records and revisions as JSON-ready dicts (`from_json` reads them)."""
        return {"records": [dataclasses.asdict(r) for r in self.records],
                "revisions": [dataclasses.asdict(r) for r in self.revisions]}

    @classmethod
    def from_json(cls, data):
        def placement(d):
            return Placement(d["kind"], tuple(Shard(**shard) for shard in d["shards"]))
        try:
            records = tuple(PlacementRecord(r["path"], tuple(r["shape"]), r["nbytes"],
                                            placement(r["placement"]), r["reason"])
                            for r in data["records"])
            revisions = tuple(Revision(r["path"], placement(r["before"]),
                                       placement(r["after"]), r["reason"])
                              for r in data.get("revisions", ()))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a saved placement plan ({type(error).__name__}: "
                             f"{error}): save one with strategy.placement.save(path).") from None
        return cls(records, revisions)

    def save(self, path):
        """Writes the plan to `path` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path):
        """The plan `save` wrote to `path`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))

    def __str__(self):
        rows = [("variable", "shape", "bytes", "placement", "why")]
        for r in self:
            rows.append((r.path, _shape_text(r.shape), f"{r.nbytes:,}",
                         str(r.placement), r.reason))
            if len(r.placement.shards) > 1:
                row_bytes = r.nbytes // max(r.shape[0], 1)
                rows += [(f"  shard {k}", _shape_text((s.rows,) + tuple(r.shape[1:])),
                          f"{s.rows * row_bytes:,}", s.device_name,
                          f"rows {s.index}::{s.count}")
                         for k, s in enumerate(r.placement.shards)]
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                 for row in rows]
        for path, t in self.dynamic_tables().items():
            lines.append(f"dynamic {path}: capacity {t['capacity']:,}, rows in use "
                         f"{sum(t['rows_in_use']):,} (by id map shard: "
                         f"{', '.join(f'{n:,}' for n in t['rows_in_use'])}), "
                         f"{t['admissions']:,} admitted, {t['evictions']:,} evicted "
                         f"in {t['steps']:,} steps")
        return "\n".join(lines)


def _matches(path, pattern):
    """A pattern matches a variable's path, its "layer/variable" tail, or the name of
    a layer on its path ("encoder" and "token_emb" in "encoder/token_emb/embeddings")."""
    parts = path.split("/")
    candidates = [path, "/".join(parts[-2:])] + parts[:-1]
    return any(fnmatch.fnmatchcase(c, pattern) for c in candidates)


def validate_table_shards(table_shards):
    """Checks a `{pattern: number of shards}` mapping; returns it as a dict."""
    if table_shards is None:
        return {}
    if not isinstance(table_shards, dict):
        raise TypeError(
            "table_shards must be a dict mapping a table path pattern to a number of "
            f'shards, e.g. {{"words/embeddings": 4}}; got {type(table_shards).__name__}.')
    for pattern, count in table_shards.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"table_shards key {pattern!r} must be a non-empty string.")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(
                f"table_shards[{pattern!r}] is {count!r}; use a whole number >= 1.")
    return dict(table_shards)


def _shape_text(shape):
    return "x".join(str(d) for d in shape) or "scalar"


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
      1. a user override whose pattern matches the path, its "layer/variable"
         tail, or the name of a layer on the path, places it (a PS placement
         needs a variable with rows: an override placing one without, such as a
         scalar or a variable of unknown shape, is an error);
      2. `architecture="allreduce"`: mirrored; `"ps"`: every layer weight on a PS;
      3. `"hybrid"`: weights of Embedding layers (and subclasses) on a PS,
         everything else mirrored.
    Later, a mirrored variable found to be read by row moves to a PS
    (`move_to_ps`), and a PS variable found to get a dense gradient moves to
    mirrored unless `stays_on_ps` says why not (`move_to_mirrored`); a variable
    moved to mirrored stays there. The plan describes each path's latest variable:
    a new variable of a path (another model's) is decided afresh.
    A PS variable's rows are dealt into
    `min(num_ps, bytes // min_shard_bytes)` shards (at least one; shard k of S
    holds rows k::S), or the number
    `table_shards` gives for it; each shard goes to the PS task holding the
    fewest bytes so far, a table's shards to distinct tasks while there are
    enough (greedy by size, as Parallax balances its servers). Non-layer
    variables (optimizer counters, metrics) are always mirrored and left out of
    the plan. Without PS tasks (single machine), "ps" variables live on the local
    CPU (shard task None), whole unless `table_shards` names them.

    `asynchronous=True` (architecture "ps" only, no "mirrored" override): what
    would be mirrored lives instead whole on one PS task ("shared"), since the
    workers' steps run independently and no worker holds state of its own.

    Args:
        architecture: "hybrid", "allreduce" or "ps".
        num_ps: Number of PS tasks (0 or more).
        overrides: `{fnmatch pattern: "ps" | "mirrored"}` over variable paths.
        min_shard_bytes: Smallest shard the default split makes (bytes).
        table_shards: `{fnmatch pattern: number of shards}` for chosen tables.
        asynchronous: Whether the workers train asynchronously.
        max_mirrored_bytes: The most bytes a PS variable with a dense gradient,
            with its optimizer slots, may take on each worker once mirrored.
        saved: A `PlacementPlan` (or the path of one saved): each variable it records
            is placed as it says, before any rule above, and never moves.
    """

    def __init__(self, architecture="hybrid", num_ps=1, overrides=None,
                 min_shard_bytes=DEFAULT_MIN_SHARD_BYTES, table_shards=None,
                 asynchronous=False, max_mirrored_bytes=DEFAULT_MAX_MIRRORED_BYTES,
                 saved=None):
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture={architecture!r} is not supported; use one of "
                f"{ARCHITECTURES}."
            )
        if not isinstance(num_ps, int) or num_ps < 0:
            raise ValueError(f"num_ps must be an int >= 0, got {num_ps!r}.")
        if not isinstance(min_shard_bytes, int) or min_shard_bytes < 1:
            raise ValueError(
                f"min_shard_bytes must be a positive int (bytes), got {min_shard_bytes!r}.")
        if (not isinstance(max_mirrored_bytes, int) or isinstance(max_mirrored_bytes, bool)
                or max_mirrored_bytes < 0):
            raise ValueError(
                "max_mirrored_bytes must be an int >= 0 (bytes per worker; 0 keeps every "
                f"PS table on its PS), got {max_mirrored_bytes!r}.")
        self.architecture = architecture
        self.num_ps = num_ps
        self.overrides = validate_overrides(overrides)
        self.min_shard_bytes = min_shard_bytes
        self.table_shards = validate_table_shards(table_shards)
        self.asynchronous = validate_asynchronous(asynchronous, architecture, self.overrides)
        self.max_mirrored_bytes = max_mirrored_bytes
        self.saved = validate_saved(saved, num_ps)
        self.plan = PlacementPlan()
        self._ps_bytes = [0] * num_ps
        self._matched_overrides = set()
        self._moved_to_mirrored = set()

    def decide(self, info):
        """Returns the `Placement` of `info` and records it in `self.plan`."""
        self._moved_to_mirrored.discard(info.path)
        if self.saved is not None and info.path in self.saved:
            return self._as_saved(info)
        kind, reason = self._kind(info)
        if kind == PS and not info.shape:
            pattern = self._override_of(info.path)
            if pattern is not None:
                shape = "unknown" if info.shape is None else "() (a scalar)"
                raise ValueError(
                    f"placement_overrides[{pattern!r}] = 'ps' matches variable "
                    f"{info.path!r}, whose shape is {shape}: a PS variable is split "
                    "by rows, so it needs at least one dimension known when it is "
                    "created. Narrow the pattern to layer weights with rows (the "
                    "paths of model.weights), or place this variable 'mirrored'.")
            kind, reason = MIRRORED, f"{reason}, but no rows to split"
        if kind == MIRRORED and self.asynchronous:
            return self._record(info, Placement(SHARED, self._shards(info, count=1)),
                                f"{reason}: whole, asynchronous training", always=False)
        return self._record(info, Placement(kind, self._shards(info) if kind == PS else ()),
                            reason, always=False)

    def move_to_ps(self, info, reason):
        """Places on a PS a variable first placed mirrored, unless an override pins it.

        For a variable found to be read by row after it was created. Returns the
        new `Placement` (recorded in the plan), or None when the variable stays
        mirrored: an override names it, `architecture="allreduce"`, it has no
        rows, or it was moved to mirrored (`move_to_mirrored`).
        """
        if (self.architecture == "allreduce" or not info.shape
                or self._override_of(info.path) is not None
                or info.path in self._moved_to_mirrored or self._pinned_by_saved(info.path)):
            return None
        placement = Placement(PS, self._shards(info))
        if info.path not in self.plan:
            self._record(info, Placement(MIRRORED), "", always=True)
        self.plan = self.plan.revised(info.path, placement, reason)
        return placement

    def stays_on_ps(self, path, worker_bytes):
        """Why the PS variable `path` stays there although its gradient is dense, or None.

        `worker_bytes` is what it would take on each worker mirrored, its optimizer
        slots included. It stays when an override pins it, under
        `architecture="ps"`, or above `max_mirrored_bytes`.
        """
        pattern = self._override_of(path)
        if pattern is not None:
            return f"placement_overrides[{pattern!r}] pins it there"
        if self._pinned_by_saved(path):
            return "the placement_plan given to the strategy places it there"
        if self.architecture != "hybrid":
            return f"architecture {self.architecture!r} keeps every layer weight on a PS"
        if worker_bytes > self.max_mirrored_bytes:
            return (f"mirrored, it and its optimizer slots would take {worker_bytes:,} bytes "
                    f"on each worker, more than max_mirrored_bytes={self.max_mirrored_bytes:,}")
        return None

    def move_to_mirrored(self, path, reason, placement=None, row_bytes=None):
        """Records the PS variable `path` (in the plan) as mirrored from now on, with `reason`.

        For a variable found to get a dense gradient that `stays_on_ps` lets go.
        `placement` is the one `decide` or `move_to_ps` gave that variable, of
        `row_bytes` bytes a row (default: the plan's for `path`): its PS bytes are
        freed, and the plan changes only if it still describes that variable, not a
        newer one of the same path.
        """
        record = self.plan[path]
        placement = placement or record.placement
        if row_bytes is None:
            row_bytes = record.nbytes // max(record.shape[0], 1) if record.shape else 0
        for shard in placement.shards:
            if shard.task is not None:
                self._ps_bytes[shard.task] -= shard.rows * row_bytes
        if record.placement is placement:
            self.plan = self.plan.revised(path, Placement(MIRRORED), reason)
            self._moved_to_mirrored.add(path)

    def unmatched_overrides(self):
        """The `placement_overrides` patterns that matched no variable so far."""
        return [p for p in self.overrides if p not in self._matched_overrides]

    def _record(self, info, placement, reason, always):
        if always or info.layer_classes:
            self.plan = self.plan.with_record(PlacementRecord(
                info.path, tuple(info.shape or ()), info.nbytes, placement, reason))
        return placement

    def _pinned_by_saved(self, path):
        return self.saved is not None and path in self.saved

    def _as_saved(self, info):
        """`info`'s placement as the saved plan records it (the shards' tasks included)."""
        saved = self.saved[info.path]
        if tuple(info.shape or ()) != saved.shape:
            raise ValueError(
                f"placement_plan places {info.path!r} as a variable of shape "
                f"{_shape_text(saved.shape)}, but the model's has shape "
                f"{_shape_text(info.shape)}: save the plan of this model again "
                "(strategy.placement.save(path)), or leave placement_plan out.")
        row_bytes = info.nbytes // max(int(info.shape[0]), 1) if info.shape else 0
        for shard in saved.placement.shards:
            if shard.task is not None:
                self._ps_bytes[shard.task] += shard.rows * row_bytes
        return self._record(info, saved.placement, f"saved plan: {saved.reason}",
                            always=True)

    def _override_of(self, path):
        for pattern in self.overrides:
            if _matches(path, pattern):
                return pattern
        return None

    def _shards(self, info, count=None):
        rows = int(info.shape[0]) if info.shape else 1
        count = count or self._shard_count(info, rows)
        row_bytes = info.nbytes // max(rows, 1)
        shards, used = [], set()
        for k in range(count):
            shard = Shard(None, k, count, rows)
            if self.num_ps:
                free = [t for t in range(self.num_ps) if t not in used] or range(self.num_ps)
                task = min(free, key=self._ps_bytes.__getitem__)
                used.add(task)
                self._ps_bytes[task] += shard.rows * row_bytes
                shard = dataclasses.replace(shard, task=task)
            shards.append(shard)
        return tuple(shards)

    def _shard_count(self, info, rows):
        for pattern, count in self.table_shards.items():
            if _matches(info.path, pattern):
                return max(1, min(count, rows))
        by_size = info.nbytes // self.min_shard_bytes
        return max(1, min(self.num_ps, by_size, rows))

    def _kind(self, info):
        pattern = self._override_of(info.path)
        if pattern is not None:
            self._matched_overrides.add(pattern)
            return self.overrides[pattern], f"override {pattern!r}"
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


def validate_saved(saved, num_ps):
    """A `placement_plan` argument as a `PlacementPlan` (a path to one saved is read),
    checked against the `num_ps` PS tasks; None stays None."""
    if saved is None:
        return None
    if isinstance(saved, (str, bytes)) or hasattr(saved, "__fspath__"):
        saved = PlacementPlan.load(saved)
    if not isinstance(saved, PlacementPlan):
        raise TypeError(f"placement_plan must be a PlacementPlan (strategy.placement) or "
                        f"the path of one saved with .save(path), got {saved!r}.")
    for record in saved:
        tasks = [s.task for s in record.placement.shards if s.task is not None]
        if tasks and max(tasks) >= num_ps:
            raise ValueError(
                f"placement_plan places {record.path!r} on ps task {max(tasks)}, but the "
                f"strategy has {num_ps} PS task(s): give it the plan of a run on as many "
                "PS tasks, or leave placement_plan out.")
    return saved


def validate_asynchronous(asynchronous, architecture, overrides):
    """Checks the `asynchronous` option against the rest; returns it."""
    if not isinstance(asynchronous, bool):
        raise TypeError(f"asynchronous must be True or False, got {asynchronous!r}.")
    if not asynchronous:
        return False
    if architecture != "ps":
        raise ValueError(
            f"asynchronous=True needs architecture='ps', got {architecture!r}: each "
            "worker then applies its own steps to variables that live on the PS tasks, "
            "while mirrored variables are all-reduced by every worker in the same step. "
            "Use HybridStrategy(architecture='ps', asynchronous=True), or asynchronous="
            "False to train synchronously.")
    mirrored = [pattern for pattern, kind in overrides.items() if kind == MIRRORED]
    if mirrored:
        raise ValueError(
            f"placement_overrides {mirrored} place variables 'mirrored', but "
            "asynchronous training keeps every variable on the PS tasks (no worker holds "
            "a copy of its own). Remove those overrides, or use asynchronous=False.")
    return True


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
