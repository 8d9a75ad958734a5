"""Runs one worker or ps task of a cluster: `python -m hybrid_strategy.server --help`.

The code lives in hybrid_strategy/cluster/server.py; this module is the command.
"""

from hybrid_strategy.cluster.server import exit_at_once, main

if __name__ == "__main__":
    exit_at_once(main())
