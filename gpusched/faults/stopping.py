"""Which process runs a task try, and how to stop it (standard library only).

:class:`PidStopper` sends SIGTERM to the task process that registered itself in the
:class:`PidRegistry` (the fault listener does, from ``on_task_instance_running``). Airflow's task
supervisor sees its task process die and fails the try, so Airflow's own retry logic and the fault
chain take over. The registry is per host, as the agent that stops tasks runs on each host. The
fault chain's ``stop_task`` actions (:func:`gpusched.faults.remediation.apply_actions`) go through a
:class:`TaskStopper`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Protocol

from gpusched.paths import state_dir

__all__ = ["PidRegistry", "PidStopper", "TaskStopper"]


class TaskStopper(Protocol):
    """Stops the running task that holds allocation ``key``; True when a task was stopped."""

    def __call__(self, key: str, reason: str) -> bool: ...


def _start_ticks(pid: int) -> int | None:
    # Field 22 of /proc/<pid>/stat (after the parenthesised command name): start time in ticks.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


class PidRegistry:
    """Task key → process id of the running try, as files under ``<state_dir>/task_pids``.

    The process start time is stored too, so a recycled pid is never signalled.
    """

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or state_dir() / "task_pids"

    def _path(self, key: str) -> Path:
        return self.folder / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")

    def register(self, key: str, pid: int | None = None) -> None:
        """Record that ``pid`` (default: this process) runs the try ``key``."""
        pid = os.getpid() if pid is None else pid
        self.folder.mkdir(parents=True, exist_ok=True)
        data = {"key": key, "pid": pid, "start": _start_ticks(pid), "host": socket.gethostname()}
        tmp = self._path(key).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._path(key))

    def unregister(self, key: str) -> None:
        """Forget ``key`` (no error if unknown)."""
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def pid_of(self, key: str) -> int | None:
        """The live process registered for ``key`` on this host, or None."""
        try:
            data = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return None
        pid = int(data.get("pid", 0))
        if pid <= 0 or data.get("key") != key or _start_ticks(pid) != data.get("start"):
            return None
        return pid


class PidStopper:
    """A :class:`TaskStopper` that ends the process registered for the key.

    SIGTERM first: Airflow's task runner answers it with the operator's ``on_kill`` (a Bash or
    Docker task stops its child and fails normally). A Python task ignores it, so if the same
    process is still alive after ``grace_s`` it gets SIGKILL (from a background thread; the
    caller does not wait) and Airflow's supervisor fails the try.
    """

    def __init__(self, registry: PidRegistry | None = None, grace_s: float = 10.0) -> None:
        self.registry = registry or PidRegistry()
        self.grace_s = grace_s

    def __call__(self, key: str, reason: str) -> bool:
        pid = self.registry.pid_of(key)
        if pid is None:
            return False
        start = _start_ticks(pid)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return False
        self.registry.unregister(key)
        threading.Thread(target=self._escalate, args=(pid, start), daemon=True,
                         name=f"gpusched-stop-{pid}").start()
        return True

    def _escalate(self, pid: int, start: int | None) -> None:
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            if _start_ticks(pid) != start:
                return  # it ended (or the pid now belongs to someone else)
            time.sleep(0.2)
        if _start_ticks(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
