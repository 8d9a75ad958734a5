"""Starts a local cluster on loopback and runs a chief program in it: `python -m hybrid_strategy.launch --help`.

The code lives in hybrid_strategy/cluster/launch.py; this module is the command.
"""

from hybrid_strategy.cluster.launch import main
from hybrid_strategy.cluster.server import exit_at_once

if __name__ == "__main__":
    # Once the servers are gone, the interpreter's teardown has nothing to release but
    # TensorFlow's modules, which would take it a second.
    exit_at_once(main())
