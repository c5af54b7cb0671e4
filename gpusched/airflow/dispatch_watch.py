"""What was dispatched is watched: GPU tasks sent to a host's Celery queue that never start.

A Redis broker restarted without persistence forgets the messages it held, and a Celery worker
that loses its broker connection drops the messages it had reserved but not started: the tasks
stay ``queued`` in Airflow with their devices allocated until ``task_queued_timeout``.
:class:`DispatchWatch` (run by :class:`gpusched.airflow.celery_executor.GPUCeleryExecutor` on
every heartbeat) looks at each GPU task sent more than ``[gpusched]
dispatch_start_timeout_seconds`` ago that has not started and, when its message is gone from the
broker, or still waits in the queue of a GPU host that is lost, revokes it, releases its devices
and queues the same try again in the executor (no retry spent), so the next cycle places it anew.

A try is taken as started — and left alone for good — as soon as any of these says so: its Celery
state is not ``PENDING`` (``[celery] task_track_started`` writes ``STARTED`` to the result backend
before the task runs), Airflow's state of the try is not ``queued``, or its allocation is released
or has a task process recorded (:mod:`gpusched.airflow.listener`). A message is "gone" when it is
neither in its queue nor among the broker's unacknowledged (reserved) messages; only Redis can be
looked into without consuming, so with another broker nothing is re-placed. Each check reads the
broker once for all the overdue tries; only those whose message is not where it should be are
looked up in the result backend, Airflow and the ledger. A try is re-placed only when two checks
in a row, ``check_s`` apart, found it lost, and it is re-sent under a new Celery task id (the old
one is revoked), so a late copy of the old message can never run it twice. A restarted executor
watches the GPU tries it adopts that were sent and not yet started (:meth:`DispatchWatch.adopt`),
timed from their original send.

A gang member is re-placed only together with every other member of its gang (all lost); when
some member started, the lost one fails instead and the gang is retried as a whole
(:func:`gpusched.airflow.gpu_faults.stop_broken_gangs`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpusched.airflow.executor_compat import celery_forget, save_task_event
from gpusched.airflow.orphans import task_state
from gpusched.errors import LedgerUnavailableError
from gpusched.ledger.hosts import LAUNCH_EVENT, HostState, host_queue
from gpusched.scheduler.keys import ti_key_of

__all__ = ["ABSENT", "DISPATCH_LOST_EVENT", "QUEUED", "RESERVED", "UNKNOWN", "DispatchWatch", "Sent",
           "broker_messages", "find_message", "remove_message"]

DISPATCH_LOST_EVENT = "dispatch_lost"
"""Ledger event of a dispatched try that never started and was placed again."""

QUEUED, RESERVED, ABSENT, UNKNOWN = "queued", "reserved", "absent", "unknown"
"""Where a message is: in its queue, reserved by a worker (unacknowledged), in neither, or the
broker could not be looked into."""


@dataclass
class Sent:
    """One GPU try sent to a host's queue and not yet seen to start."""

    workload: Any  # as it waited in the executor (its own queue, the token minted at queue time)
    ledger_key: str
    task_id: str  # the Celery task id it was sent under
    queue: str
    host: str
    gang: str | None
    sent_at: float
    lost_since: float | None = None  # the first check that found it lost


class DispatchWatch:
    """Watch the GPU tries one Celery executor sent until they start (see the module docstring).

    Args:
        executor: the ``GPUCeleryExecutor`` (its Celery app, ``queued_tasks``, ``fail``, ``log``).
        core: its :class:`~gpusched.airflow.gpu_scheduling.GPUScheduling` (ledger, ``gpu_running``,
            ``gangs``, ``release``, ``requeue``, ``clock``).
        timeout_s: how long a sent try may take to start before it is checked (0: never).
    """

    def __init__(self, executor: Any, core: Any, timeout_s: float) -> None:
        self.executor, self.core, self.timeout_s = executor, core, timeout_s
        self.check_s = max(1.0, min(5.0, timeout_s / 3))  # between checks, and to confirm a loss
        self.sent_tries: dict[Any, Sent] = {}
        self._last_check = float("-inf")
        # Where each fact is read (a test replaces them; they never raise).
        self.celery_state: Callable[[str], str | None] = self._celery_state
        self.airflow_state: Callable[[Any], str | None] = task_state
        self.messages: Callable[[set[str]], dict[str, str] | None] = lambda queues: broker_messages(
            self.executor.celery_app, queues)

    @property
    def log(self) -> Any:
        return self.executor.log

    def sent(self, workload: Any, *, ledger_key: str, task_id: str, queue: str, host: str,
             gang: str | None, sent_at: float | None = None) -> None:
        """Watch ``workload`` (as it waited in the executor), sent as Celery task ``task_id``
        (now, or at ``sent_at``: a try adopted from an earlier executor)."""
        if self.timeout_s > 0:
            self.sent_tries[workload.key] = Sent(workload, ledger_key, task_id, queue, host, gang,
                                                 self.core.clock() if sent_at is None else sent_at)

    def adopt(self, ti: Any, make_workload: Callable[[Any], Any]) -> bool:
        """Watch try ``ti`` that an earlier executor sent and this one adopted (True), when it is
        still ``queued`` with an active allocation and a ``launch`` event (its host and when it
        was sent) and no task process: a dispatch lost while no executor ran is then found as
        any other. ``make_workload(ti)`` builds the workload it is queued again as. Never raises."""
        try:
            if str(getattr(ti, "state", "")) not in ("queued", "TaskInstanceState.QUEUED") \
                    or not getattr(ti, "external_executor_id", None):
                return False
            ledger_key = ti_key_of(ti)
            alloc = self.core.ledger.get(ledger_key)
            started = alloc is not None and any(p.role == "task" for p in alloc.processes)
            if alloc is None or alloc.released_at is not None or started:
                return False
            launched = self.core.ledger.events(1, kinds=[LAUNCH_EVENT], subject=ledger_key)
            if not launched or not launched[0].detail.get("host"):
                return False
            host = str(launched[0].detail["host"])
            gang = (launched[0].detail.get("env") or {}).get("GPUSCHED_GANG")
            self.sent(make_workload(ti), ledger_key=ledger_key, task_id=str(ti.external_executor_id),
                      queue=host_queue(host), host=host, gang=gang, sent_at=launched[0].at)
            return True
        except Exception:
            self.log.exception("gpusched: could not watch the adopted try %s", getattr(ti, "key", ti))
            return False

    def check(self, now: float | None = None) -> list[Any]:
        """Re-place the tries found lost twice in a row; return their Airflow keys. Never raises.

        Runs at most every :attr:`check_s` seconds; tries sent less than ``timeout_s`` ago are
        not looked at.
        """
        now = self.core.clock() if now is None else now
        if not self.sent_tries or now - self._last_check < self.check_s:
            return []
        self._last_check = now
        for key, entry in list(self.sent_tries.items()):
            if self.core.gpu_running.get(key) != entry.ledger_key:  # ended, failed or released
                del self.sent_tries[key]
        overdue = {k: e for k, e in self.sent_tries.items() if now - e.sent_at >= self.timeout_s}
        if not overdue:
            return []
        # One look into the broker for all of them (most wait in a busy host's queue); only a
        # try whose message is not where it should be is looked up further.
        messages = self.messages({e.queue for e in overdue.values()})
        if messages is None:
            return []  # not a Redis broker, or it does not answer: nothing to conclude
        lost: dict[Any, str] = {}
        live: set[str] | None = None
        for key, entry in overdue.items():
            where = messages.get(entry.task_id, ABSENT)
            if where == QUEUED and live is None:
                live = {h.name for h in self.core.ledger.hosts() if h.state == HostState.LIVE}
            try:
                verdict = self._verdict(key, entry, where, live or set())
            except LedgerUnavailableError:
                return []  # the ledger guard pauses GPU work; look again later
            except Exception:
                self.log.exception("gpusched: could not check whether %s started", entry.ledger_key)
                continue
            if verdict is None:
                del self.sent_tries[key]
            elif not verdict:
                entry.lost_since = None
            elif entry.lost_since is None:
                entry.lost_since = now
            else:
                lost[key] = verdict
        done = []
        for key, reason in lost.items():
            found = self.sent_tries.get(key)
            if found is None:
                continue  # handled with its gang
            try:
                done.extend(self._lost(key, found, reason, lost))
            except Exception:
                self.log.exception("gpusched: could not place %s again", found.ledger_key)
        return done

    def host_lost(self, key: Any, reason: str) -> bool:
        """GPU host lost: place try ``key`` again (True) when it was sent there and never started,
        its message still waiting in the host's queue (called by the lost-host handling, which
        has released the devices; a gang member is left to it). Never raises."""
        entry = self.sent_tries.get(key)
        if entry is None or entry.gang or self.core.gpu_running.get(key) != entry.ledger_key:
            return False
        try:
            if not self._unstarted(key, entry, released_ok=True):
                return False
            messages = self.messages({entry.queue}) or {}
            if messages.get(entry.task_id) != QUEUED:
                return False  # reserved by the lost host's worker (it may be running there), or unknown
            self._requeue(key, entry, f"{reason}; it had not started")
        except Exception:
            self.log.exception("gpusched: could not place %s again", entry.ledger_key)
            return False
        return True

    def _unstarted(self, key: Any, entry: Sent, *, released_ok: bool = False) -> bool | None:
        """True: no sign the try started; False: it started (or left this executor); None: its
        Celery state cannot be read now."""
        state = self.celery_state(entry.task_id)
        if state is None:
            return None
        if state != "PENDING" or self.airflow_state(key) != "queued":
            return False
        alloc = self.core.ledger.get(entry.ledger_key)
        if alloc is None or (alloc.released_at is not None and not released_ok):
            return False
        return not any(p.role == "task" for p in alloc.processes)

    def _verdict(self, key: Any, entry: Sent, where: str, live: set[str]) -> str | None:
        """None: started (or gone from this executor); "": not started, still on its way; else
        why it will never start from this dispatch (``where``: its message; ``live``: the live
        hosts, read when a message was found queued)."""
        if where == RESERVED or (where == QUEUED and entry.host in live):
            return ""  # a worker has it, or it waits for its host's worker
        unstarted = self._unstarted(key, entry)
        if unstarted is None:
            return ""
        if not unstarted:
            return None
        if where == QUEUED:
            return f"GPU host {entry.host} is lost; its queue {entry.queue} is not served"
        return "its message is gone from the Celery broker (restarted without persistence?)"

    def _lost(self, key: Any, entry: Sent, reason: str, lost: dict[Any, str]) -> list[Any]:
        members = [key]
        if entry.gang:
            members = sorted(self.core.gangs.get(entry.gang, {key}), key=str)
            if not all(m in lost and m in self.sent_tries for m in members):
                self._fail(key, entry, f"{reason}; another member of gang {entry.gang} started, so "
                                       "the gang is retried as a whole")
                return []
            self.core.gangs.pop(entry.gang, None)
        for member in members:
            self._requeue(member, self.sent_tries[member], lost[member])
        return members

    def _forget(self, key: Any, entry: Sent) -> None:
        """Make sure the sent message can never run: out of the broker, revoked, not polled."""
        del self.sent_tries[key]
        remove_message(self.executor.celery_app, entry.queue, entry.task_id)
        try:
            self.executor.celery_app.control.revoke(entry.task_id)
        except Exception as exc:  # the message is gone anyway; a revoke is the second lock
            self.log.warning("gpusched: could not revoke Celery task %s: %s", entry.task_id, exc)
        celery_forget(self.executor, key)

    def _requeue(self, key: Any, entry: Sent, reason: str) -> None:
        self._forget(key, entry)
        waited = self.core.clock() - entry.sent_at
        self.core.ledger.record_event(DISPATCH_LOST_EVENT, entry.ledger_key, host=entry.host,
                                      task_id=entry.task_id, reason=reason)
        # A new Celery task id: the old one is revoked, and Airflow records the new one when the
        # executor reports the try queued again.
        ti = entry.workload.ti.model_copy(update={"external_executor_id": str(uuid.uuid4())})
        self.core.requeue(entry.workload.model_copy(update={"ti": ti}),
                          f"dispatch lost: {reason}; placed again (same try)")
        self.log.warning("gpusched: %s was sent to %s %.0f s ago and never started: %s; revoked, devices "
                         "released, placed again without spending a retry", entry.ledger_key, entry.queue,
                         waited, reason)
        save_task_event(self.executor, event="gpusched.dispatch_lost", extra=reason, ti_key=key)

    def _fail(self, key: Any, entry: Sent, reason: str) -> None:
        self._forget(key, entry)
        self.core.ledger.record_event(DISPATCH_LOST_EVENT, entry.ledger_key, host=entry.host,
                                      task_id=entry.task_id, reason=reason)
        self.core.release(key, f"dispatch lost: {reason}")
        self.log.error("gpusched: %s never started: %s", entry.ledger_key, reason)
        save_task_event(self.executor, event="gpusched.dispatch_lost", extra=reason, ti_key=key)
        self.executor.fail(key, info=f"gpusched: dispatch lost: {reason}")

    def _celery_state(self, task_id: str) -> str | None:
        """The task's state in the Celery result backend (None when it cannot be read)."""
        from celery.result import AsyncResult

        try:
            return str(AsyncResult(task_id, app=self.executor.celery_app).state)
        except Exception as exc:
            self.log.warning("gpusched: cannot read the Celery state of %s: %s", task_id, exc)
            return None


def _redis_queue_keys(channel: Any, queue: str) -> list[str]:
    """The Redis lists a kombu queue is kept in (one per priority step)."""
    steps = getattr(channel, "priority_steps", None) or [0]
    names = [channel._q_for_pri(queue, step) for step in steps] if hasattr(channel, "_q_for_pri") else [queue]
    return list(dict.fromkeys(names))


def _message_task_id(raw: Any) -> str | None:
    try:
        message = json.loads(raw)
    except (TypeError, ValueError):
        return None
    if isinstance(message, list) and message:  # an unacked entry: [message, exchange, routing key]
        message = message[0]
    headers = message.get("headers") if isinstance(message, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return None if task_id is None else str(task_id)


def broker_messages(app: Any, queues: set[str]) -> dict[str, str] | None:
    """Celery task id → :data:`QUEUED` (in one of ``queues``) or :data:`RESERVED` (delivered to a
    worker, not acknowledged) for every message a Redis broker holds there; None when the broker
    is not Redis or does not answer. Never raises."""
    try:
        with app.connection_for_write() as connection:
            if connection.transport.driver_type != "redis":
                return None
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=3)
            channel = connection.default_channel
            client = channel.client
            found: dict[str, str] = {}
            for raw in client.hvals(getattr(channel, "unacked_key", "unacked")):
                task_id = _message_task_id(raw)
                if task_id is not None:
                    found[task_id] = RESERVED
            for queue in sorted(queues):
                for name in _redis_queue_keys(channel, queue):
                    for raw in client.lrange(name, 0, -1):
                        task_id = _message_task_id(raw)
                        if task_id is not None:
                            found[task_id] = QUEUED
            return found
    except Exception:
        return None


def find_message(app: Any, queue: str, task_id: str) -> str:
    """Where Celery task ``task_id``'s message is in ``app``'s broker: :data:`QUEUED` in
    ``queue``, :data:`RESERVED` (delivered to a worker, not acknowledged), :data:`ABSENT`, or
    :data:`UNKNOWN` (not a Redis broker, or it does not answer). Never raises."""
    messages = broker_messages(app, {queue})
    return UNKNOWN if messages is None else messages.get(task_id, ABSENT)


def remove_message(app: Any, queue: str, task_id: str) -> None:
    """Delete Celery task ``task_id``'s message from ``queue`` of a Redis broker, if it is there
    (a no-op for another broker, or one that does not answer). Never raises."""
    try:
        with app.connection_for_write() as connection:
            if connection.transport.driver_type != "redis":
                return
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=3)
            channel = connection.default_channel
            for name in _redis_queue_keys(channel, queue):
                for raw in channel.client.lrange(name, 0, -1):
                    if _message_task_id(raw) == task_id:
                        channel.client.lrem(name, 0, raw)
    except Exception:
        return

