"""Runs a tf.data service dispatcher or worker: `python -m hybrid_strategy.data_service --help`.

The code lives in hybrid_strategy/cluster/data_service.py; this module is the command.
"""

from hybrid_strategy.cluster.data_service import main
from hybrid_strategy.cluster.server import exit_at_once

if __name__ == "__main__":
    exit_at_once(main())
