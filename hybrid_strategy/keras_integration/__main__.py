"""`python -m hybrid_strategy.keras_integration [--markdown]`: prints every run-time patch."""

import sys

from hybrid_strategy.keras_integration import registry

if __name__ == "__main__":
    sys.exit(registry.main())
