"""Warnings raised from more than one of the package's parts.

```python
import warnings
import hybrid_strategy
warnings.simplefilter("error", hybrid_strategy.PlacementWarning)  # make misfits fail
```
"""


class PlacementWarning(UserWarning):
    """A variable's placement does not fit the type of gradient it receives."""
