"""`StrategyOptions`: HybridStrategy's keyword arguments, declared and checked in one place.

```python
from hybrid_strategy.options import StrategyOptions
options = StrategyOptions(architecture="hybrid", wire_dtype="bfloat16")
print(options.sparse_update)        # "lazy"
```
"""

import dataclasses
import inspect
import numbers

from hybrid_strategy.sharding import wire
from hybrid_strategy.placement import plan as placement_lib
from hybrid_strategy.placement import topology
from hybrid_strategy.tables import sparse_optimizers


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """The keyword arguments of `HybridStrategy` (its docstring says what each means).

    Everything but the placement arguments is checked here, before the strategy
    connects to anything; the placement arguments are checked by the
    `PlacementPolicy` that `placement_policy()` makes.
    """

    architecture: str = "hybrid"
    placement_overrides: dict = None
    min_shard_bytes: int = placement_lib.DEFAULT_MIN_SHARD_BYTES
    table_shards: dict = None
    max_mirrored_bytes: int = placement_lib.DEFAULT_MAX_MIRRORED_BYTES
    sparse_update: str = "lazy"
    wire_dtype: object = None
    devices: tuple = None
    communication_options: object = None
    connect_timeout: float = 60.0
    task_timeout: float = 60.0
    asynchronous: bool = False
    dense_sum: str = "auto"
    placement_plan: object = None

    @classmethod
    def from_kwargs(cls, kwargs):
        """The options named in `kwargs`, refusing any name HybridStrategy does not take."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"HybridStrategy() got unexpected keyword argument(s) {unknown}; "
                            f"it takes cluster_resolver and {sorted(known)}.")
        return cls(**kwargs)

    def __post_init__(self):
        if self.dense_sum not in topology.DENSE_SUMS:
            raise ValueError(f"dense_sum={self.dense_sum!r}; use one of "
                             f"{topology.DENSE_SUMS}.")
        if self.sparse_update not in sparse_optimizers.MODES:
            raise ValueError(f"sparse_update={self.sparse_update!r}; use one of "
                             f"{sparse_optimizers.MODES}.")
        object.__setattr__(self, "wire_dtype", wire.check_wire_dtype(self.wire_dtype))
        if not _positive(self.connect_timeout):
            raise ValueError(f"connect_timeout={self.connect_timeout!r}; give a number of "
                             "seconds above 0.")
        if self.task_timeout is not None and not _positive(self.task_timeout):
            raise ValueError(f"task_timeout={self.task_timeout!r}; give a number of seconds "
                             "above 0, or None to not watch the tasks.")
        if isinstance(self.devices, str):
            raise ValueError(f"devices={self.devices!r}; give a list of device names, "
                             "e.g. ['/gpu:0', '/gpu:1'].")
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))

    def placement_policy(self, num_ps):
        """The `PlacementPolicy` these options ask for, on `num_ps` PS tasks."""
        return placement_lib.PlacementPolicy(
            self.architecture, num_ps=num_ps, overrides=self.placement_overrides,
            min_shard_bytes=self.min_shard_bytes, table_shards=self.table_shards,
            max_mirrored_bytes=self.max_mirrored_bytes, asynchronous=self.asynchronous,
            saved=self.placement_plan)


def signature():
    """`HybridStrategy.__init__`'s signature, with every option named, for help() and IDEs."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
                  inspect.Parameter("cluster_resolver", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=None)]
    parameters += [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY,
                                     default=field.default)
                   for field in dataclasses.fields(StrategyOptions)]
    return inspect.Signature(parameters)


def _positive(value):
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and value > 0)
