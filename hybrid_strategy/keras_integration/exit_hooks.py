"""At the exit of a chief connected to a cluster, traced functions are not released one by one.

TensorFlow 2.21 cannot release a function whose parts run on remote tasks: each
removal at exit logs "Ignoring error status when releasing multi-device function
handle UNIMPLEMENTED" and frees nothing; the process is ending, so skip them.

```python
from hybrid_strategy.keras_integration import exit_hooks
exit_hooks.install()   # HybridStrategy() does, once connected to a cluster
```
"""

import atexit
import functools

from hybrid_strategy.keras_integration import registry


@functools.cache
def install():
    """Drops TensorFlow's registry of functions to release, at exit (once per process)."""
    atexit.register(registry.install, "exit_hooks.keep_functions_at_exit", lambda refs: None)
