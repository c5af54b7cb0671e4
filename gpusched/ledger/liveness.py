"""Is the process that holds an allocation still there? (host, pid and start time).

The ledger records which processes hold an allocation (:class:`HolderProcess`); after a crash,
a restart, or a worker's death the executor asks this module whether any of them still runs. A
pid is judged only on the host that recorded it, and only alive when its start time matches, so
a later process that reused the pid does not keep dead work's devices.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

from gpusched.records import HolderProcess

__all__ = ["current_process", "holders_alive", "process_alive"]

_START_TOLERANCE_S = 1.0


def _started_at(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def current_process(role: str) -> HolderProcess:
    """This process, as a holder in ``role``."""
    pid = os.getpid()
    return HolderProcess(role, socket.gethostname(), pid, _started_at(pid) or 0.0)


def process_alive(process: HolderProcess, host: str | None = None) -> bool | None:
    """True/False for a process of ``host`` (default: this host); None for another host's."""
    if process.host != (host or socket.gethostname()):
        return None
    import psutil

    try:
        proc = psutil.Process(process.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        started = float(proc.create_time())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # someone else's live process: never judge it dead
    return abs(started - process.started_at) <= _START_TOLERANCE_S


def holders_alive(processes: Iterable[HolderProcess], host: str | None = None) -> bool | None:
    """False when every recorded process is on this host and gone; True when one runs.

    None when nothing can be judged: no process recorded, or only other hosts' ones.
    """
    verdicts = [process_alive(p, host) for p in processes]
    if any(v is True for v in verdicts):
        return True
    if not verdicts or any(v is None for v in verdicts):
        return None
    return False
