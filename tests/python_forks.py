"""A Python that has imported TensorFlow and runs each command it is sent in a fork of itself.

tests/runs.py starts one per set of import-time settings (Keras 3 or tf_keras) and sends
it the scenarios' `python ARGS` commands, so that none of them pays TensorFlow's import
(4-5 s of CPU) again. One JSON request per line on stdin:

    {"id": 7, "arguments": ["-m", "hybrid_strategy.launch", ...], "env": {...},
     "cwd": "/repo", "stdout": "/tmp/7.out", "stderr": "/tmp/7.err"}

answered on stdout by {"id": 7, "pid": PID} once forked and {"id": 7, "exit": CODE,
"cpu": SECONDS} once the fork has ended: its exit code as subprocess reports it (negative
for a signal), and the CPU time it and the processes it waited for took. The forks die with
this process, which ends when its stdin closes.
"""

import json
import os
import select
import signal
import sys

import tensorflow  # pylint: disable=unused-import

from hybrid_strategy.cluster import forks

_STDIN = 0


def _run(request):
    """In the fork: the request's output files, directory and command; never returns."""
    try:
        with open(request["stdout"], "wb") as out, open(request["stderr"], "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # not this process's pipes
        os.chdir(request["cwd"])
    except BaseException:  # pylint: disable=broad-except
        os._exit(126)
    forks.run_python(request["arguments"], request["env"])


def _answer(message):
    os.write(1, (json.dumps(message) + "\n").encode())


def main():
    running = {}  # pid -> request id
    pending = b""
    while True:
        readable, _, _ = select.select([_STDIN], [], [], 0.05)
        if readable:
            chunk = os.read(_STDIN, 1 << 16)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                deathsig = forks.die_with_parent(signal.SIGKILL)
                pid = forks.fork()
                if not pid:
                    if deathsig:
                        deathsig()
                    _run(request)
                running[pid] = request["id"]
                _answer({"id": request["id"], "pid": pid})
        while running:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if not pid:
                break
            _answer({"id": running.pop(pid), "exit": os.waitstatus_to_exitcode(status),
                     "cpu": usage.ru_utime + usage.ru_stime})
    for pid in running:
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
