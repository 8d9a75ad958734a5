"""Tests of the launcher and the server entry point, with real processes.

Each cluster start costs a few seconds (the launcher imports TensorFlow), so one launcher
run is shared by the tests that only inspect its result. The chief scripts report the
server pids from HYBRID_STRATEGY_SERVER_PIDS, which the launcher sets for the chief.
"""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hybrid_strategy.cluster import config as cluster

from hybrid_strategy.cluster import launch

from hybrid_strategy.cluster import server
from hybrid_strategy.cluster.launch import LocalCluster

pytestmark = pytest.mark.cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
# A chief that prints what it was given as one JSON line.
REPORT = (
    "import json, os, sys\n"
    f"servers = [int(p) for p in os.environ[{launch.SERVER_PIDS_ENV!r}].split(',')]\n"
    "def command(pid):\n"
    "    with open(f'/proc/{pid}/cmdline', 'rb') as f:\n"
    "        return f.read().decode().split(chr(0))[:-1]\n"
    "print(json.dumps({'tf_config': json.loads(os.environ['TF_CONFIG']), 'pid': os.getpid(),\n"
    "  'servers': servers, 'launcher': command(os.getppid()),\n"
    "  'server_commands': [command(pid) for pid in servers]}), flush=True)\n"
)


def launcher_command(chief_code, workers=1, ps=1):
    return [sys.executable, "-m", "hybrid_strategy.launch", "--workers", str(workers),
            "--ps", str(ps), "--", sys.executable, "-c", chief_code]


def run_launcher(chief_code):
    run = subprocess.run(launcher_command(chief_code), env=ENV, cwd=REPO, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    if not run.stdout:
        pytest.fail(f"the chief printed nothing; launcher exited {run.returncode}:\n{run.stderr}")
    return run, json.loads(run.stdout.splitlines()[0])


def gone(pid):
    """True once `pid` is no process, or only a zombie (exited, its parent not yet reaping)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.split()[:2] == ["State:", "Z"] for line in status)
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def exit_3():
    """One launcher run whose chief reports and exits with code 3."""
    return run_launcher(REPORT + "sys.exit(3)")


def test_cli_passes_the_chief_exit_code_through(exit_3):
    run, _ = exit_3
    assert run.returncode == 3, run.stderr


def test_cli_gives_the_chief_its_tf_config(exit_3):
    _, report = exit_3
    config = report["tf_config"]
    assert config["task"] == {"type": "chief", "index": 0}
    assert {job: len(tasks) for job, tasks in config["cluster"].items()} == {
        "chief": 1, "worker": 1, "ps": 1}


def test_cli_reports_ready_and_leaves_no_server(exit_3):
    run, report = exit_3
    assert "hybrid_strategy.launch: 1 worker + 1 ps on 127.0.0.1 ready in" in run.stderr
    assert len(report["servers"]) == 2
    assert all(gone(pid) for pid in report["servers"])


def test_cli_forks_its_servers_from_itself(exit_3):
    _, report = exit_3
    assert report["server_commands"] == [report["launcher"]] * 2
    assert "hybrid_strategy.launch" in report["launcher"]


def test_cli_passes_a_chief_crash_through_and_leaves_no_server():
    run, report = run_launcher(REPORT + "raise RuntimeError('chief failed on purpose')")
    assert run.returncode == 1
    assert "RuntimeError: chief failed on purpose" in run.stderr
    assert all(gone(pid) for pid in report["servers"] + [report["pid"]])


def test_cli_sigint_stops_chief_and_servers():
    launcher = subprocess.Popen(
        launcher_command(REPORT + "import time\ntime.sleep(120)"), env=ENV, cwd=REPO,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # so the signal reaches the launcher only
    try:
        report = json.loads(read_line(launcher.stdout, timeout=60))
        signalled = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=15)
        assert launcher.returncode == 130, stderr
        assert time.monotonic() - signalled < 8
        assert all(gone(pid) for pid in report["servers"] + [report["pid"]])
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_cli_restarts_after_exit_75_but_not_after_another_failure():
    # First run: "a task was lost" (75); second run: a failure of the program itself (3).
    chief = (REPORT + f"restart = int(os.environ[{launch.RESTART_COUNT_ENV!r}])\n"
             "print('restart', restart, flush=True)\nsys.exit(75 if restart == 0 else 3)")
    command = launcher_command(chief)
    command[command.index("--"):command.index("--")] = ["--max-restarts", "2"]
    run = subprocess.run(command, env=ENV, cwd=REPO, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 3, run.stderr
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [line for line in run.stdout.splitlines() if line.startswith("restart")] == [
        "restart 0", "restart 1"]
    assert ("hybrid_strategy.launch: the chief exited with code 75 (a task was lost); "
            "restarting the cluster and the chief (restart 1 of 2).") in run.stderr
    assert "restart 2 of 2" not in run.stderr
    # A fresh cluster for the second run, and no server left of either.
    assert reports[0]["tf_config"] != reports[1]["tf_config"]
    assert all(gone(pid) for report in reports for pid in report["servers"])


# A chief script for --fork-chief: REPORT, its own command line, what Python gave it, and
# an exit handler; it exits with the code its first argument names.
FORKED_REPORT = REPORT + (
    "import atexit\n"
    "atexit.register(print, 'the exit handler ran', flush=True)\n"
    "print(json.dumps({'command': command(os.getpid()), 'argv': sys.argv, 'name': __name__,\n"
    "                  'path0': sys.path[0]}), flush=True)\n"
    "sys.exit(int(sys.argv[1]))\n"
)


def forking_launcher_command(*chief):
    return [sys.executable, "-m", "hybrid_strategy.launch", "--workers", "1", "--ps", "1",
            "--fork-chief", "--", sys.executable, *chief]


def test_cli_forks_the_chief_from_itself_as_python_would_run_it(tmp_path):
    script = tmp_path / "chief.py"
    script.write_text(FORKED_REPORT)
    run = subprocess.run(forking_launcher_command(str(script), "3"), env=ENV, cwd=REPO,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    lines = run.stdout.splitlines()
    report, python = json.loads(lines[0]), json.loads(lines[1])
    assert report["tf_config"]["task"] == {"type": "chief", "index": 0}
    assert python["command"] == report["launcher"]
    assert python["argv"] == [str(script), "3"]
    assert (python["name"], python["path0"]) == ("__main__", str(tmp_path))
    assert lines[2:] == ["the exit handler ran"]
    assert all(gone(pid) for pid in report["servers"] + [report["pid"]])


def test_cli_sigint_stops_a_forked_chief_run_as_a_module_and_the_servers(tmp_path):
    (tmp_path / "sleeper.py").write_text(REPORT + "import time\ntime.sleep(120)")
    launcher = subprocess.Popen(
        forking_launcher_command("-m", "sleeper"), env=ENV, cwd=tmp_path,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # so the signal reaches the launcher only
    try:
        report = json.loads(read_line(launcher.stdout, timeout=60))
        launcher.send_signal(signal.SIGINT)
        _, stderr = launcher.communicate(timeout=15)
        assert launcher.returncode == 130, stderr
        assert "KeyboardInterrupt" in stderr
        assert all(gone(pid) for pid in report["servers"] + [report["pid"]])
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


# Prints, from inside the chief's network, its interfaces and listening TCP ports, then
# waits for a line on stdin so that the test can look from outside meanwhile.
LISTENERS = REPORT + (
    "import socket\n"
    "from tests.test_launch import listening_ports\n"
    "print(json.dumps({'interfaces': [name for _, name in socket.if_nameindex()],\n"
    "                  'listening': sorted(listening_ports())}), flush=True)\n"
    "sys.stdin.readline()\n"
)


def listening_ports():
    """{(address, port)} of the TCP sockets listening in this process's network namespace,
    as `ss -ltn` lists them ("0.0.0.0"/"::" for every interface)."""
    found = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path) as table:
            for line in list(table)[1:]:
                local, state = line.split()[1], line.split()[3]
                if state != "0A":  # LISTEN
                    continue
                address, port = local.split(":")
                raw = bytes.fromhex(address)
                # The kernel prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def test_cli_cluster_is_reachable_on_loopback_only():
    launcher = subprocess.Popen(
        launcher_command(LISTENERS), env=ENV, cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        report = json.loads(read_line(launcher.stdout, timeout=120))
        inside = json.loads(read_line(launcher.stdout, timeout=60))
        outside = listening_ports()
        launcher.stdin.write("done\n")
        launcher.stdin.flush()
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, stderr
    ports = {int(address.rsplit(":", 1)[1])
             for addresses in report["tf_config"]["cluster"].values() for address in addresses}
    # TensorFlow's servers listen on every interface ("*:port" in ss -ltn), but the only
    # interface where they run is loopback, and nothing outside sees their ports.
    assert inside["interfaces"] == ["lo"]
    assert {port for _, port in inside["listening"]} >= ports - {
        int(report["tf_config"]["cluster"]["chief"][0].rsplit(":", 1)[1])}
    assert not {port for _, port in outside} & ports


def read_line(stream, timeout):
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no output within {timeout} s"
    return stream.readline()


def test_local_cluster_serves_inside_and_stops_after():
    with LocalCluster(workers=1, ps=1) as local:
        assert (local.config.num_workers, local.config.num_ps) == (1, 1)
        cluster.wait_for_tasks(local.config, timeout=1)
        assert not any(gone(pid) for pid in local.pids)
        chief = cluster.parse_tf_config(local.chief_environ({})["TF_CONFIG"])
        assert (chief.task_type, chief.task_index) == ("chief", 0)
        assert local.chief_environ({})[launch.SERVER_PIDS_ENV] == ",".join(map(str, local.pids))
    assert [p.returncode for p in local.processes] == [0, 0]  # SIGTERM is a clean exit
    assert all(gone(pid) for pid in local.pids)


def test_local_cluster_reports_a_server_that_dies_at_start():
    # A Python that cannot find its standard library exits at once with code 1.
    local = LocalCluster(workers=1, ps=0, env={"PYTHONHOME": "/nonexistent"}, startup_timeout=30)
    started = time.monotonic()
    with pytest.raises(launch.ServerStartError,
                       match=r"server /job:worker/task:0 \(pid \d+\) exited with code 1 while "
                             r"the cluster was starting; run with quiet=False"):
        local.start()
    assert time.monotonic() - started < 10
    assert all(gone(pid) for pid in local.pids)


def test_local_cluster_retries_when_a_port_is_taken(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound, not listening: probes fail, the server cannot bind
    first_ports = iter([cluster.free_port(), taken.getsockname()[1]])  # chief, worker/0
    real_free_port = cluster.free_port
    monkeypatch.setattr(cluster, "free_port",
                        lambda host: next(first_ports, None) or real_free_port(host))
    with taken, LocalCluster(workers=1, ps=0) as local:
        assert local.config.address("worker", 0) != f"127.0.0.1:{taken.getsockname()[1]}"
        cluster.wait_for_tasks(local.config, timeout=1)


# A program that starts a LocalCluster of forked servers, runs a chief that connects and
# goes, waits for the servers to start afresh without it (as `python -m
# hybrid_strategy.server`), runs a second chief, and then, with TensorFlow's runtime started
# in itself, asks for forked servers again. Prints what it saw as one JSON line.
FORKING_PROGRAM = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from hybrid_strategy.cluster import config as cluster
    from hybrid_strategy.cluster.launch import LocalCluster

    CHIEF = (
        "import tensorflow as tf\\n"
        "from hybrid_strategy.cluster import config, connection\\n"
        "connection.devices(config.from_environment(), 'hybrid', None, timeout=60)\\n"
        "with tf.device('/job:ps/task:0'):\\n"
        "    print(float(tf.Variable(2.0) * 3.0))\\n")

    def command(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode().split(chr(0))[:-1]

    def chief(local):
        return subprocess.run([sys.executable, "-c", CHIEF], env=local.chief_environ(),
                              capture_output=True, text=True, check=True).stdout.split()[-1]

    report = {}
    with LocalCluster(workers=1, ps=1, fork_servers=True) as local:
        report["forked"] = [command(pid) == command(os.getpid()) for pid in local.pids]
        report["first"] = chief(local)
        deadline = time.monotonic() + 60
        # An empty command line: the process is between the fork's image and the new one.
        while any(command(pid) in (command(os.getpid()), []) for pid in local.pids):
            assert time.monotonic() < deadline, "the servers did not start afresh"
            time.sleep(0.2)
        report["afresh"] = [command(pid)[1:] for pid in local.pids]
        cluster.wait_for_tasks(local.config, 60)
        report["second"] = chief(local)
    report["exit codes"] = [process.returncode for process in local.processes]
    import tensorflow as tf
    tf.constant(1.0)
    try:
        LocalCluster(workers=1, ps=0, fork_servers=True).start()
    except RuntimeError as e:
        report["refused"] = str(e)
    print(json.dumps(report))
""")


def test_forked_servers_start_afresh_as_the_server_command_and_serve_the_next_chief():
    run = subprocess.run([sys.executable, "-c", FORKING_PROGRAM], env=ENV, cwd=REPO,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["forked"] == [True, True]
    assert report["afresh"] == [["-m", "hybrid_strategy.server"]] * 2
    assert report["first"] == report["second"] == "6.0"
    assert report["exit codes"] == [0, 0]  # SIGTERM is a clean exit
    assert report["refused"].startswith(
        "fork_servers=True, but TensorFlow's runtime has started in this process")


def test_forked_servers_refuse_a_process_with_other_threads():
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        with pytest.raises(RuntimeError, match=r"this process runs \d+ Python threads"):
            LocalCluster(workers=1, ps=0, fork_servers=True).start()
    finally:
        release.set()
        other.join()


@pytest.mark.parametrize("kwargs, message", [
    ({"workers": 0}, "workers must be an integer >= 1, got 0"),
    ({"ps": -1}, "ps must be an integer >= 0, got -1"),
    ({"startup_timeout": 0}, "startup_timeout must be a positive number"),
    ({"fork_servers": True, "env": {"A": "1"}}, "pass one or the other"),
])
def test_local_cluster_checks_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalCluster(**kwargs)


def test_local_cluster_must_be_started_before_use():
    with pytest.raises(RuntimeError, match="not started"):
        LocalCluster().chief_tf_config


@pytest.mark.parametrize("argv, message", [
    (["--workers", "1"], "give the chief's command after '--'"),
    (["--workers", "1", "--"], "give the chief's command after '--'"),
    (["--workers", "0", "--", "true"], "--workers must be at least 1, got 0"),
    (["--ps", "-1", "--", "true"], "--ps must be 0 or more, got -1"),
    (["--startup-timeout", "0", "--", "true"], "--startup-timeout must be a positive number"),
    (["--max-restarts", "-1", "--", "true"], "--max-restarts must be 0 or more, got -1"),
    (["--fork-chief", "--", "true"], "in a fork of the launcher, but the command runs 'true'"),
    (["--fork-chief", "--", sys.executable, "-u", "train.py"],
     "but the command gives Python no script, or options of its own"),
    (["--fork-chief", "--", sys.executable, "missing.py"], "there is no script 'missing.py'"),
])
def test_cli_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_server_exits_2_on_a_malformed_tf_config():
    run = subprocess.run([sys.executable, "-m", "hybrid_strategy.server"],
                         env=dict(ENV, TF_CONFIG="{not json"), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "hybrid_strategy.server: TF_CONFIG is not valid JSON" in run.stderr


@pytest.mark.parametrize("tf_config, message", [
    ("", "TF_CONFIG is not set; set it to the cluster and this process's task"),
    (json.dumps({"cluster": {"chief": ["127.0.0.1:2220"]}, "task": {"type": "chief", "index": 0}}),
     'TF_CONFIG names task "chief" 0, but only worker and ps tasks run this server'),
    (json.dumps({"cluster": {"worker": ["127.0.0.1:2221"]}, "task": {"type": "ps", "index": 0}}),
     "task type 'ps' is not a job of the cluster"),
])
def test_server_main_rejects_a_bad_task(tf_config, message, monkeypatch, capsys):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    assert server.main([]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("choice, worker_host, spins", [
    ("auto", "127.0.0.1", False), ("auto", "10.0.0.2", True),
    ("on", "127.0.0.1", True), ("off", "10.0.0.2", False)])
def test_idle_threads_sleep_where_tasks_share_a_host_unless_told(choice, worker_host, spins):
    config = cluster.ClusterConfig({"chief": ["127.0.0.1:2220"],
                                    "worker": [f"{worker_host}:2221"],
                                    "ps": ["127.0.0.1:2222"]}, "worker", 0)
    assert server.thread_spinning(choice, config) is spins
