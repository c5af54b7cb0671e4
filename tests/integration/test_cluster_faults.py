"""The local multi-host cluster's faults reach every process of a host, task processes included.

A task process that Airflow's supervisor starts runs in a process group of its own, so killing the
worker's group leaves it alive; a machine dying or freezing takes it too. The cluster finds a
host's processes by the environment they inherit (:func:`processes_with`) and everything they
started (:meth:`LocalCluster.host_pids`); checked here on a worker-like process that starts a
grandchild in a new session with an environment of its own, as Airflow's supervisor does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from gpusched.deploy.multihost_cluster import LocalCluster, processes_with

# A "worker" that starts a "task" in a session of its own with an environment of its own (none of
# the host's marks), prints its pid and waits.
WORKER = """
import os, subprocess, sys, time
task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                        env={"PATH": os.environ.get("PATH", "")})
print(task.pid, flush=True)
time.sleep(120)
"""


def _until(check: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Whether ``check()`` came true within ``timeout`` (signals are delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _dead(pid: int) -> bool:
    try:
        return _state(pid) == "Z"  # killed, not yet reaped by its (dead) parent's heir
    except FileNotFoundError:
        return True


def test_a_hosts_processes_are_found_by_environment_and_tree_across_sessions(tmp_path: Path) -> None:
    mark = {"GPUSCHED_HOST": "host-x", "GPUSCHED_DB_URL": f"sqlite:///{uuid.uuid4()}"}
    cluster = LocalCluster(tmp_path, {}, hosts=("host-x",))
    cluster.db_url = mark["GPUSCHED_DB_URL"]
    worker = subprocess.Popen([sys.executable, "-c", WORKER], env={**os.environ, **mark},
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             env={**os.environ, **mark, "GPUSCHED_HOST": "host-y"})
    try:
        assert worker.stdout is not None
        task = int(worker.stdout.readline())
        assert task not in processes_with(mark)  # its environment is its own
        found = cluster.host_pids("host-x")
        assert worker.pid in found and task in found and other.pid not in found
        assert os.getpgid(task) != os.getpgid(worker.pid)  # killing the worker's group spares it
        for pid in found:  # a freeze stops them all, a thaw continues them
            os.kill(pid, signal.SIGSTOP)
        assert _until(lambda: _state(task) == "T")
        for pid in found:
            os.kill(pid, signal.SIGCONT)
        assert _until(lambda: _state(task) != "T")
        for pid in found:  # a machine dying takes the task too
            os.kill(pid, signal.SIGKILL)
        worker.wait(timeout=10)
        assert _until(lambda: processes_with(mark) == [] and _dead(task))
    finally:
        for proc in (worker, other):
            proc.kill()
            proc.wait(timeout=10)
