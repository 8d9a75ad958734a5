"""Starts a local cluster on loopback and runs a chief program in it: `python -m hybrid_strategy.launch --help`.

The code lives in hybrid_strategy/cluster/launch.py; this module is the command.
"""

import sys

from hybrid_strategy.cluster.launch import main

if __name__ == "__main__":
    sys.exit(main())
