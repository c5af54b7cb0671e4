"""Which GPU hosts are live, lost or unconfirmed (pure).

A GPU host of a multi-host fleet is live while both its agent and its Celery worker answer: the
agent heartbeats and says with each heartbeat what it sees of the worker
(:class:`gpusched.ledger.hosts.WorkerStatus`). Three sources tell the faults apart:

* agent silent past the timeout, and the host's running tries silent too (Airflow's task
  supervisor heartbeats each running try): the machine is gone or cut off — **lost**;
* agent alive, its worker not running (missing or stopped) past the timeout — **lost** (the
  agent, still there, confirms that the tries' processes are gone);
* agent silent, but some running try of the host still heartbeats: only the agent hangs —
  **unconfirmed**: the running work goes on (it is healthy), nothing new is placed there, and
  the host is lost only once its tries fall silent too.

A lost host comes back when its agent heartbeats with its worker running
(:meth:`gpusched.ledger.hosts.LedgerHosts.heartbeat_host`); what ran there waits in quarantine
until the agent confirms it stopped.

A live host's Celery worker slots are capacity too (:func:`worker_slot_use`): a host whose slots
are all taken gets no new task while another host has a free slot and a device that fits. Like a
Celery worker's prefetch, such a host's worker may still be sent tasks that no host with a free
slot can take, to wait in its queue for a slot that a running try is expected to free soon
(:func:`prefetch_room`): the next one starts the moment a slot frees, not a scheduler cycle later.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpusched.ledger.hosts import HostRecord, HostState, WorkerState, host_queue
from gpusched.records import AllocationStatus
from gpusched.scheduler.keys import KEY_PREFIX

__all__ = ["HostVerdict", "judge_hosts", "prefetch_room", "quarantine_reason", "record_verdicts",
           "slot_full_reason", "worker_slot_use"]


@dataclass(frozen=True, slots=True)
class HostVerdict:
    """Host ``name`` moves from state ``previous`` to ``state`` because of ``reason``."""

    name: str
    previous: str
    state: str
    reason: str


def judge_hosts(
    hosts: Sequence[HostRecord], now: float, timeout_s: float, tries_heard: Mapping[str, float],
) -> list[HostVerdict]:
    """The hosts whose state changes now, in name order.

    ``tries_heard`` maps a host to the newest heartbeat of its running tries (absent: none runs
    there, or none is known). Lost hosts are left alone: their agent re-admits them.
    """
    verdicts = []
    for host in sorted(hosts, key=lambda h: h.name):
        if host.state not in (HostState.LIVE, HostState.UNCONFIRMED):
            continue
        verdict = _judge(host, now, timeout_s, tries_heard.get(host.name))
        if verdict is not None and verdict.state != host.state:
            verdicts.append(verdict)
    return verdicts


def record_verdicts(
    ledger: Any, hosts: Sequence[HostRecord], now: float, timeout_s: float, tries_heard: Mapping[str, float],
) -> list[HostVerdict]:
    """:func:`judge_hosts` over ``hosts``, each verdict recorded in ``ledger``
    (``set_host_state``); returns those that took effect (a host its agent re-admitted meanwhile,
    or another scheduler moved first, is left out)."""
    return [v for v in judge_hosts(hosts, now, timeout_s, tries_heard)
            if ledger.set_host_state(v.name, v.state, v.reason, expected=v.previous, now=now) is not None]


def _judge(host: HostRecord, now: float, timeout_s: float, heard: float | None) -> HostVerdict | None:
    silent_s = now - host.last_heartbeat
    if silent_s <= timeout_s:
        if host.worker_state in (None, WorkerState.RUNNING):
            return None
        gone_s = now - (host.worker_seen_at if host.worker_seen_at is not None else host.registered_at)
        if gone_s <= timeout_s:
            return None
        return HostVerdict(host.name, host.state, HostState.LOST, (
            f"node lost: no heartbeat from host {host.name}: its Celery worker (queue "
            f"{host_queue(host.name)}) is {host.worker_state} for {gone_s:.0f} s while its agent answers"))
    if heard is not None and now - heard <= timeout_s:
        return HostVerdict(host.name, host.state, HostState.UNCONFIRMED, (
            f"the agent of host {host.name} is silent for {silent_s:.0f} s but its running tries still "
            "heartbeat: they go on; nothing new is placed there until the agent answers"))
    tries = "; its running tries fell silent too" if host.state == HostState.UNCONFIRMED else ""
    return HostVerdict(host.name, host.state, HostState.LOST,
                       f"node lost: no heartbeat from host {host.name} for {silent_s:.0f} s{tries}")


def quarantine_reason(host: str, why: str, try_number: int | None) -> str:
    """What a quarantined allocation of ``host`` says while it waits: why its try's fate is
    unknown and what ends the wait."""
    which = f"try {try_number}" if try_number is not None else "the try"
    return (f"{why}; host {host}: waiting for its agent to confirm {which} stopped (or `gpusched ledger "
            f"unquarantine {host}` once you know it did)")


def worker_slot_use(
    hosts: Sequence[HostRecord], node_host: Mapping[str, str], active: Iterable[Any],
) -> dict[str, tuple[int, int]]:
    """Host -> (slots busy, slots) of each live host whose agent reports its worker's slots.

    A busy slot is one of the host's active Airflow tries (a gang member on it counts one, a
    quarantined or test-run allocation none): Celery gives each task one worker slot whatever
    GPUs it holds. Tasks without GPUs that the worker also takes are not seen.
    """
    slots = {h.name: h.worker_slots for h in hosts if h.state == HostState.LIVE and h.worker_slots}
    busy = dict.fromkeys(slots, 0)
    for alloc in active:
        if getattr(alloc, "status", None) != AllocationStatus.ACTIVE or not alloc.key.startswith(KEY_PREFIX):
            continue
        host = next((node_host[s.node] for s in alloc.shares if s.node in node_host), None)
        if host in busy:
            busy[host] += 1
    return {name: (busy[name], int(total)) for name, total in slots.items()}


def prefetch_room(
    use: Mapping[str, tuple[int, int]], node_host: Mapping[str, str], running: Iterable[Any],
    now: float, *, multiplier: int, within_s: float,
) -> dict[str, int]:
    """Host -> how many tasks beyond its slots its worker may hold now, for each host of ``use``
    (:func:`worker_slot_use`, host -> (busy, slots)) whose slots are all taken.

    A host gets ``multiplier`` × its slots at most (a Celery worker reserves
    ``worker_prefetch_multiplier`` × concurrency messages), and no more than the number of its
    running tries expected to end by ``now + within_s`` (``running``: the
    :class:`~gpusched.placement.types.RunningTask` of tries whose task process has started — one
    sent and still waiting in its queue frees no slot —; a try without an expected end never counts),
    so each task sent there waits for a slot about as long as a predicted end, never behind tries
    whose ends nobody knows. Hosts with a free slot, or without room, are left out.
    """
    if multiplier <= 0:
        return {}
    full = {host for host, (busy, slots) in use.items() if busy >= slots}
    ending: dict[str, int] = dict.fromkeys(full, 0)
    for task in running:
        if task.expected_end is None or task.expected_end > now + within_s or not task.shares:
            continue
        host = node_host.get(task.shares[0].node)
        if host in ending:
            ending[host] += 1
    return {host: min(multiplier * use[host][1], n) for host, n in ending.items() if n}


def slot_full_reason(host: str, busy: int, slots: int) -> str:
    """Why nothing more goes to ``host`` now: its Celery worker's slots are all taken."""
    return (f"GPU host {host}: every Celery worker slot is busy ({busy} of {slots}); a task sent there "
            "would wait in its queue")
