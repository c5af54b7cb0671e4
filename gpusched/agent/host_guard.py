"""What a GPU host's agent guards besides its devices: its Celery worker and its quarantined tries.

* :func:`watch_worker` looks at the processes of this machine for the Celery worker that serves
  the host's queue (``gpusched@<host>``): running, stopped (every process of it SIGSTOPped:
  frozen) or missing, and its slots (``--concurrency``). The agent reports it with each heartbeat;
  the scheduler counts a host live only while both answer (:mod:`gpusched.scheduler.hosts`).
* :func:`confirm_quarantined` ends the quarantine of this host's allocations whose holder's fate
  was unknown (host lost): a recorded task process of the try still alive here is killed (with
  its process group) first, and the quarantine ends only once none is left, so the devices go
  to a new try only after the old one is gone. Run before each heartbeat, so a host that comes
  back has confirmed its old tries before the heartbeat re-admits it.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any

from gpusched.ledger.hosts import WorkerState, WorkerStatus, host_queue
from gpusched.ledger.liveness import process_alive
from gpusched.records import Allocation, HolderProcess
from gpusched.scheduler.keys import parse_ti_key

__all__ = ["DEFAULT_WORKER_SLOTS", "confirm_quarantined", "watch_worker", "worker_slots"]

DEFAULT_WORKER_SLOTS = 16
"""Airflow's ``[celery] worker_concurrency`` default, when neither the command line nor
``AIRFLOW__CELERY__WORKER_CONCURRENCY`` names one."""


def _tokens(cmdline: Sequence[str]) -> list[str]:
    # A worker that set its process title (Celery does, through setproctitle) shows as
    # "[celeryd: NAME:MainProcess] -active- (worker -O fair --queues Q ...)": one string, or
    # split on spaces, with the arguments in parentheses.
    return [t.strip("()") for arg in cmdline for t in arg.split(" ") if t.strip("()")]


def worker_slots(cmdline: Sequence[str], environ: Any = None) -> int:
    """The slots of a Celery worker started with ``cmdline``: ``--concurrency N`` / ``-c N``,
    else ``AIRFLOW__CELERY__WORKER_CONCURRENCY`` of ``environ`` (default this process's), else
    :data:`DEFAULT_WORKER_SLOTS`."""
    env = os.environ if environ is None else environ
    tokens = _tokens(cmdline)
    for i, arg in enumerate(tokens):
        value = None
        if arg in ("--concurrency", "-c") and i + 1 < len(tokens):
            value = tokens[i + 1]
        elif arg.startswith("--concurrency="):
            value = arg.split("=", 1)[1]
        if value is not None and value.strip().isdigit() and int(value) > 0:
            return int(value)
    configured = str(env.get("AIRFLOW__CELERY__WORKER_CONCURRENCY", "")).strip()
    return int(configured) if configured.isdigit() and int(configured) > 0 else DEFAULT_WORKER_SLOTS


def _serves(cmdline: Sequence[str], queue: str) -> bool:
    """Is ``cmdline`` the main process of a Celery worker consuming ``queue``?"""
    tokens = _tokens(cmdline)
    if not any("celery" in t for t in tokens[:6]) or "worker" not in tokens:
        return False
    for i, arg in enumerate(tokens):
        queues = tokens[i + 1] if arg in ("--queues", "-Q") and i + 1 < len(tokens) else (
            arg.split("=", 1)[1] if arg.startswith("--queues=") else None)
        if queues is not None and queue in queues.split(","):
            return True
    return False


def watch_worker(host: str) -> WorkerStatus:
    """What this machine's processes show of the Celery worker serving ``gpusched@<host>``."""
    import psutil

    queue = host_queue(host)
    states: list[str] = []
    slots = None
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info.get("cmdline") or []
        if not cmdline or not _serves(cmdline, queue):
            continue
        states.append(proc.info.get("status") or "")
        if slots is None:
            slots = worker_slots(cmdline)
    if not states or all(s == psutil.STATUS_ZOMBIE for s in states):
        return WorkerStatus(WorkerState.MISSING)
    if all(s in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE) for s in states):
        return WorkerStatus(WorkerState.STOPPED, slots)
    return WorkerStatus(WorkerState.RUNNING, slots)


def _alive_here(processes: Iterable[HolderProcess], names: set[str]) -> list[HolderProcess]:
    """The task processes among ``processes`` recorded on this machine (``names``) that still run."""
    alive = []
    for process in processes:
        if process.role == "task" and process.host in names and process_alive(process, process.host):
            alive.append(process)
    return alive


def _kill(process: HolderProcess) -> None:
    try:
        if os.getpgid(process.pid) == process.pid:
            os.killpg(process.pid, signal.SIGKILL)  # the try's own group: what it started goes too
        else:
            os.kill(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def confirm_quarantined(
    ledger: Any, host: str, *, kill: bool = True, wait_s: float = 2.0, now: float | None = None,
) -> list[str]:
    """End the quarantine of ``host``'s allocations whose tries have no process left on this
    machine, killing those that still run (unless ``kill`` is False: then they stay quarantined).
    Returns one line per quarantine ended or process killed."""
    names = {socket.gethostname(), host}
    lines: list[str] = []
    quarantined: list[Allocation] = ledger.quarantined(host)
    for alloc in quarantined:
        alive = _alive_here(alloc.processes, names)
        killed = []
        if alive and kill:
            for process in alive:
                _kill(process)
                killed.append(process.pid)
            deadline = time.monotonic() + wait_s
            while alive and time.monotonic() < deadline:
                time.sleep(0.05)
                alive = _alive_here(alive, names)
        if alive:
            lines.append(f"{alloc.key}: quarantined, task process(es) {', '.join(str(p.pid) for p in alive)} "
                         "still running here")
            continue
        parts = parse_ti_key(alloc.key)
        which = f"try {parts.try_number}" if parts else "its try"
        how = (f"killed task process {', '.join(map(str, killed))}" if killed
               else "no task process of it runs here")
        reason = f"host {host}'s agent confirmed {which} stopped ({how})"
        if ledger.end_quarantine(alloc.key, host=host, reason=reason, now=now):
            lines.append(f"{alloc.key}: {reason}; its devices are free")
    return lines
