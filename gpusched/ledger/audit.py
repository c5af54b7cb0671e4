"""Replay the ledger's allocation history in commit order and report any over-commitment.

The ledger's promise — no device ever holds more than 1000 milli-GPU or more memory than it has,
and no key holds two allocations at once — is checked here after the fact, for tests and
benchmarks. Timestamps cannot decide it (a writer takes its ``now`` before it waits for the write
lock), so the replay follows the event log's ids: ``allocate``/``release``/``expire`` events are
written in the same transaction as the change they record. A quarantined allocation
(``quarantine`` event) keeps holding its devices until its ``unquarantine`` event, while the same
key may hold a new allocation beside it: both count.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence

from gpusched.ledger.allocations import QUARANTINE_EVENT, UNQUARANTINE_EVENT
from gpusched.ledger.store import Ledger
from gpusched.model import MILLI
from gpusched.records import Allocation

__all__ = ["audit", "replay_violations"]


def replay_violations(
    events: Sequence[tuple[str, str]], allocations: Sequence[Allocation], memory: Mapping[str, int]
) -> list[str]:
    """Violations found replaying ``events`` (kind, key; oldest first) over ``allocations``.

    ``allocations`` are every allocation row, oldest first; the n-th ``allocate`` event of a key
    is its n-th row. ``memory`` maps device uuid to its memory (devices not listed: memory not
    checked). Returns one line per violation (empty: none).
    """
    rows: dict[str, deque[Allocation]] = defaultdict(deque)
    for alloc in allocations:
        rows[alloc.key].append(alloc)
    held: dict[str, Allocation] = {}
    fenced: dict[str, deque[Allocation]] = defaultdict(deque)
    milli: dict[str, int] = defaultdict(int)
    used: dict[str, int] = defaultdict(int)
    found: list[str] = []
    for kind, key in events:
        if kind == "allocate":
            if not rows[key]:
                found.append(f"{key}: an allocate event without an allocation row")
                continue
            if key in held:
                found.append(f"{key}: allocated while it already held an allocation")
            alloc = held[key] = rows[key].popleft()
            for s in alloc.shares:
                milli[s.uuid] += s.milli
                used[s.uuid] += s.memory_bytes
                if milli[s.uuid] > MILLI or used[s.uuid] > memory.get(s.uuid, used[s.uuid]):
                    found.append(f"{s.uuid}: over-committed by {key} ({milli[s.uuid]} milli, "
                                 f"{used[s.uuid]} bytes)")
        elif kind == QUARANTINE_EVENT:
            moved = held.pop(key, None)
            if moved is None:
                found.append(f"{key}: quarantined without an active allocation")
            else:
                fenced[key].append(moved)
        elif kind in ("release", "expire", UNQUARANTINE_EVENT):
            pool = fenced[key] if kind == UNQUARANTINE_EVENT else None
            gone = (pool.popleft() if pool else None) if pool is not None else held.pop(key, None)
            if gone is None:
                found.append(f"{key}: {kind} without an active allocation")
                continue
            for s in gone.shares:
                milli[s.uuid] -= s.milli
                used[s.uuid] -= s.memory_bytes
    return found


def audit(ledger: Ledger) -> list[str]:
    """:func:`replay_violations` over ``ledger``'s whole history."""
    events = ledger.events(2**62, kinds=["allocate", "release", "expire", QUARANTINE_EVENT,
                                         UNQUARANTINE_EVENT])
    allocations = ledger.history(0.0)
    memory = {d.uuid: d.memory_bytes for n in ledger.snapshot().nodes for d in n.devices}
    return replay_violations([(e.kind, e.subject) for e in reversed(events)], allocations, memory)
