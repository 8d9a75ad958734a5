"""tf.data service servers, for preprocessing that outgrows the workers: a dispatcher and its workers.

    python -m hybrid_strategy.data_service dispatcher --port 5050
    python -m hybrid_strategy.data_service worker --dispatcher 10.0.0.9:5050 --port 5051 \\
        --address 10.0.0.10:5051

TensorFlow's own engine (`tf.data.experimental.service.DispatchServer` and `WorkerServer`):
a dataset sent to it with `tf.data.experimental.service.distribute` is preprocessed on the
tf.data service workers, and the training workers only receive its elements. The launcher
(`python -m hybrid_strategy.launch --data-service-workers N`) starts a dispatcher and N
workers beside the cluster and gives the chief the dispatcher's address in
HYBRID_STRATEGY_DATA_SERVICE, which `data_service_address()` reads:

```python
import tensorflow as tf
import hybrid_strategy

dataset = tf.data.Dataset.range(1000).map(lambda i: (i, i)).batch(64)
dataset = dataset.apply(tf.data.experimental.service.distribute(
    processing_mode="distributed_epoch", service=hybrid_strategy.data_service_address(),
    job_name="train"))
```

A server runs until SIGTERM or SIGINT, then exits with code 0; exit code 2 means a bad
argument, 75 that it could not start (its port is taken).
"""
import argparse
import os
import select
import sys

from hybrid_strategy.cluster import config as cluster_lib
from hybrid_strategy.cluster import server as server_lib

# The chief's environment variable naming the dispatcher, as "grpc://host:port".
DATA_SERVICE_ENV = "HYBRID_STRATEGY_DATA_SERVICE"
_PREFIX = "hybrid_strategy.data_service:"
ROLES = ("dispatcher", "worker")


def data_service_address(environ=os.environ):
    """The tf.data service dispatcher this program trains with, as "grpc://host:port".

    ```python
    service = hybrid_strategy.data_service_address()
    dataset = dataset.apply(tf.data.experimental.service.distribute(
        processing_mode="distributed_epoch", service=service, job_name="train"))
    ```

    Read from HYBRID_STRATEGY_DATA_SERVICE, which the launcher sets when started with
    `--data-service-workers N`; elsewhere set it to the address of the dispatcher that
    `python -m hybrid_strategy.data_service dispatcher` runs.
    """
    address = environ.get(DATA_SERVICE_ENV, "").strip()
    if not address:
        raise ValueError(
            f"{DATA_SERVICE_ENV} is not set, so there is no tf.data service to use: start "
            "the launcher with --data-service-workers N, or run `python -m "
            "hybrid_strategy.data_service dispatcher` (and workers) and set "
            f"{DATA_SERVICE_ENV}=grpc://HOST:PORT for the chief.")
    host_port = address.split("://", 1)[-1]
    if cluster_lib.split_address(host_port) is None:
        raise ValueError(f"{DATA_SERVICE_ENV}={address!r} is not grpc://HOST:PORT; set it "
                         "to the dispatcher's address, e.g. grpc://10.0.0.9:5050.")
    return address if "://" in address else f"grpc://{address}"


def watched(environ=os.environ):
    """`[(name, "host:port")]` of the dispatcher this program trains with, if any: the
    chief's health monitor probes it, as training waits on it as on a task."""
    if not environ.get(DATA_SERVICE_ENV, "").strip():
        return []
    address = data_service_address(environ)
    return [("tf.data service dispatcher", address.split("://", 1)[-1])]


def server_argv(role, port, dispatcher=None):
    """The command line that runs a `role` server on `port` (a worker of `dispatcher`)."""
    argv = [sys.executable, "-m", "hybrid_strategy.data_service", role, "--port", str(port)]
    return argv + (["--dispatcher", dispatcher] if dispatcher else [])


def main(argv=None) -> int:
    """Serves as a tf.data service dispatcher or worker until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m hybrid_strategy.data_service",
        description=__doc__.split("\n", 1)[0])
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--port", type=int, default=5050,
                        help="port to serve on (default 5050)")
    parser.add_argument("--dispatcher", metavar="HOST:PORT",
                        help="worker: the dispatcher's address (required)")
    parser.add_argument("--address", metavar="HOST:PORT",
                        help="worker: the address consumers reach it at (default "
                             "localhost:PORT; on other machines, this machine's address)")
    options = parser.parse_args(argv)
    if not 1 <= options.port <= 65535:
        parser.error(f"--port must be from 1 to 65535, got {options.port}")
    if options.role == "worker":
        if options.dispatcher is None:
            parser.error("a worker needs --dispatcher HOST:PORT, the dispatcher's address")
        options.dispatcher = options.dispatcher.split("://", 1)[-1]
        for flag, value in (("--dispatcher", options.dispatcher),
                            ("--address", options.address)):
            if value is not None and cluster_lib.split_address(value) is None:
                parser.error(f"{flag} {value!r} is not HOST:PORT, e.g. 10.0.0.9:5050")
    elif options.dispatcher or options.address:
        parser.error("--dispatcher and --address are for workers; a dispatcher takes --port")
    stopped = server_lib.stop_on_signals()
    try:
        return _serve(options, stopped)
    except server_lib.Stop:
        return 0


def _serve(options, stopped) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    service = tf.data.experimental.service
    try:
        if options.role == "dispatcher":
            server = service.DispatchServer(service.DispatcherConfig(port=options.port))
        else:
            server = service.WorkerServer(service.WorkerConfig(
                dispatcher_address=options.dispatcher, port=options.port,
                worker_address=options.address or f"localhost:{options.port}"))
    except (tf.errors.OpError, RuntimeError) as e:
        print(f"{_PREFIX} tf.data service {options.role} could not start on port "
              f"{options.port}: {getattr(e, 'message', e)}", file=sys.stderr, flush=True)
        return server_lib.EXIT_CANNOT_SERVE
    print(f"{_PREFIX} tf.data service {options.role} serving on port {options.port}",
          file=sys.stderr, flush=True)
    select.select([stopped], [], [])
    del server
    return 0

