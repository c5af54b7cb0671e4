"""Checkpoints and preemption, for task code (the API a GPU task uses to lose little work).

A GPU task under the gpusched executors may report when it saved a checkpoint; the executor
then prefers to preempt the tasks that lose least work, and a preempted task learns it in time
to save one::

    from gpusched.airflow import checkpoint

    start = (checkpoint.resume() or checkpoint.NO_CHECKPOINT).step or 0   # an earlier try's
    for step in range(start, steps):
        train_one_step()
        if step % 100 == 0 or checkpoint.preempted():
            save_model(path)                                 # your own checkpoint file
            checkpoint.report(step=step, path=path)          # tell gpusched
            if checkpoint.preempted():
                checkpoint.wait_for_stop()                   # never returns

- :func:`report` writes the time (and ``step``/``path``) into the ledger row of this try;
- :func:`preempted` says whether the executor preempted this try (its notice in the ledger,
  checked at most once a second, or a SIGTERM); once it is, ``GPUSCHED_PREEMPTED=1`` is set in
  this process's environment as well;
- :func:`on_preempt` registers a callback run (in the main thread) when SIGTERM arrives;
- :func:`wait_for_stop` parks a task that has saved its checkpoint until the executor stops it
  (returning normally would mark the try successful; raising would spend a retry);
- :func:`resume` returns the newest checkpoint of an earlier try of this task instance.

Outside a gpusched allocation (no ``GPUSCHED_ALLOCATION``) every call is a no-op. Light at
import: the standard library only; the ledger is opened on first use.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from gpusched.ledger import Ledger
from gpusched.ledger.engine import default_url
from gpusched.scheduler.keys import task_of

__all__ = [
    "NO_CHECKPOINT", "PREEMPTED_VAR", "allocation_key", "on_preempt", "preempted", "report", "resume",
    "wait_for_stop",
]

PREEMPTED_VAR = "GPUSCHED_PREEMPTED"
"""Set to ``1`` in the task's environment once it knows it is preempted."""

_state: dict[str, Any] = {"checked": 0.0, "notice": False, "sigterm": False, "installed": False}
_callbacks: list[Callable[[], None]] = []
_ledgers: dict[str, Any] = {}


class _Nothing:
    step: int | None = None
    path: str | None = None
    at: float | None = None


NO_CHECKPOINT: Any = _Nothing()
"""Stands for "no checkpoint yet" (``step``, ``path`` and ``at`` are None)."""


def allocation_key() -> str | None:
    """The ledger key of this try's allocation, from ``GPUSCHED_ALLOCATION`` (None outside one)."""
    try:
        key = json.loads(os.environ.get("GPUSCHED_ALLOCATION") or "{}").get("key")
    except (ValueError, AttributeError):
        return None
    return str(key) if key else None


def _ledger() -> Any:
    url = default_url()
    if url not in _ledgers:
        _ledgers[url] = Ledger(url, lock_wait_s=10.0)
    return _ledgers[url]


def report(step: int | None = None, *, path: str | None = None) -> bool:
    """Record that this try saved a checkpoint now (False outside a gpusched allocation)."""

    key = allocation_key()
    if key is None:
        return False
    _ledger().report_checkpoint(key, task_of(key), step=step, path=path)
    return True


def resume() -> Any:
    """The newest checkpoint an earlier try of this task instance reported (``.step``, ``.path``,
    ``.at``), or None."""

    key = allocation_key()
    if key is None:
        return None
    found = _ledger().last_checkpoint(task_of(key))
    return found if found is not None and found.key != key else None


def preempted(*, poll_s: float = 1.0) -> bool:
    """Whether the executor has preempted this try (see the module docstring)."""
    _install()
    if not (_state["notice"] or _state["sigterm"]):
        key = allocation_key()
        now = time.monotonic()
        if key is not None and now - _state["checked"] >= poll_s:
            _state["checked"] = now
            row = _ledger().checkpoint(key)
            _state["notice"] = row is not None and row.notice_at is not None
    if _state["notice"] or _state["sigterm"]:
        os.environ[PREEMPTED_VAR] = "1"
        return True
    return False


def on_preempt(callback: Callable[[], None]) -> None:
    """Run ``callback`` when this process receives SIGTERM (it is being stopped)."""
    _install()
    _callbacks.append(callback)


def wait_for_stop(timeout_s: float = 600.0) -> NoReturn:
    """Wait, after saving the checkpoint, until the executor stops this process; never returns.

    The executor clears the try; Airflow's supervisor then sends SIGTERM, on which this process
    ends at once (no state is reported: Airflow records the try as cleared, not failed) rather
    than running on until the SIGKILL 5 s later. Raises RuntimeError after ``timeout_s`` (the executor
    went away): the try then fails and is retried as any failure would be.
    """
    _install()
    _state["stopping"] = True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
    raise RuntimeError(f"gpusched: preempted but not stopped within {timeout_s:.0f} s")


def _install() -> None:
    """Chain a SIGTERM handler before Airflow's (main thread only; once)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    _state["installed"] = True
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        _state["sigterm"] = True
        os.environ[PREEMPTED_VAR] = "1"
        for callback in list(_callbacks):
            callback()
        if callable(previous):
            previous(signum, frame)
        if _state.get("stopping") or previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
