"""The scheduler's store port: what one scheduling cycle reads of the state it decides over.

:class:`Store` is the port; two implementations serve it:

* :class:`~gpusched.scheduler.ledger_store.LedgerStore` — the SQL ledger (SQLite or PostgreSQL)
  the executors share with their tasks, agents and the UI: :class:`gpusched.ledger.Ledger` plus
  the one read the ledger cannot answer without knowing the quota rule (``tenant_use``).
* :class:`InMemoryStore` — the same reads over allocations kept in memory, for the simulator and
  tests. It keeps each tenant's use of the current budget period incrementally (a finished run
  adds a fixed amount once), so a replay of a week of jobs does not recount every run each pass.

Both answer :meth:`Store.tenant_use` by the one rule of :func:`gpusched.quota.usage.tenant_usage`
(tested equal), and :func:`gpusched.scheduler.quota.quota_at` turns it into the cycle's quota
state. This module imports no SQL: the simulator never loads it.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable
from typing import Protocol

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.quota.policy import normalised_rate
from gpusched.records import Allocation, AllocationStatus
from gpusched.request import GPURequest

__all__ = ["InMemoryStore", "Store"]


class Store(Protocol):
    """Every read of the scheduler's state one cycle makes (the port both drivers implement)."""

    def cycle_view(self, now: float | None = None) -> tuple[FleetSnapshot, list[Allocation]]:
        """The fleet with its usage and the active allocations, as of one instant."""
        ...

    def get(self, key: str) -> Allocation | None:
        """The active allocation of ``key``, else its most recent one, else None."""
        ...

    def history(self, since: float, until: float | None = None) -> list[Allocation]:
        """Allocations alive at some point in ``[since, until)``, released ones included."""
        ...

    def history_of(self, patterns: Collection[tuple[str, str]]) -> list[Allocation]:
        """Every allocation whose key starts with ``prefix`` and ends with ``suffix`` for one
        ``(prefix, suffix)`` of ``patterns``, oldest first."""
        ...

    def checkpoint_times(self, keys: Iterable[str]) -> dict[str, float]:
        """Key → time of its last checkpoint, for those of ``keys`` that reported one."""
        ...

    def node_addresses(self) -> dict[str, str]:
        """Node name → address of the GPU host that owns it."""
        ...

    def tenant_use(self, snapshot: FleetSnapshot, since: float, now: float) -> dict[str, int]:
        """Normalised units each tenant used in ``[since, now]``
        (:func:`~gpusched.quota.usage.tenant_usage`)."""
        ...


class InMemoryStore:
    """The scheduler's state in memory, driven by a replay's clock (see the module docstring).

    ``fleet`` is the idle fleet; :meth:`allocate` and :meth:`release` keep the allocations and
    their history, and :meth:`cycle_view` derives the fleet's usage from the active ones (only
    when asked: a replay keeps its own snapshot). Instants passed in never decrease between calls.
    """

    def __init__(self, fleet: FleetSnapshot, addresses: dict[str, str] | None = None) -> None:
        self.fleet = fleet
        self._snapshot: FleetSnapshot | None = fleet  # None: the active allocations changed since
        self.addresses = dict(addresses or {})
        self.active: dict[str, Allocation] = {}
        self.released: list[Allocation] = []  # in order of release
        self._release_times: list[float] = []
        self.checkpoints: dict[str, float] = {}
        self._period = float("nan")
        self._closed: dict[str, int] = {}  # use of runs that ended within the current period
        self._open: dict[int, tuple[str, int, float, float | None]] = {}  # id -> tenant, rate, start, end
        self._runs: dict[int, tuple[str, int, float, float | None]] = {}
        self._run_of: dict[str, int] = {}

    # ---- writes (the driver's) ------------------------------------------------------------------

    def allocate(self, key: str, request: GPURequest, shares: Iterable[DeviceShare], *, now: float,
                 holder: str = "sim") -> Allocation:
        """Give ``shares`` to ``key`` from ``now``; its devices are used until :meth:`release`."""
        held = tuple(sorted(shares, key=lambda s: s.uuid))
        alloc = Allocation(key, request, held, holder, now, float("inf"))
        self.active[key] = alloc
        self._snapshot = None
        run = len(self._runs)
        self._runs[run] = self._open[run] = (request.tenant, normalised_rate(held, self.fleet), now, None)
        self._run_of[key] = run
        return alloc

    def release(self, key: str, *, reason: str, now: float, succeeded: bool = False) -> Allocation:
        """End ``key``'s allocation at ``now`` with ``reason`` (``succeeded``: its task did); its
        devices are free again."""
        alloc = self.active.pop(key)
        done = Allocation(alloc.key, alloc.request, alloc.shares, alloc.holder, alloc.created_at,
                          alloc.lease_expires_at, now, reason,
                          AllocationStatus.SUCCEEDED if succeeded else AllocationStatus.RELEASED)
        self._snapshot = None
        at = bisect.bisect_right(self._release_times, now)
        self._release_times.insert(at, now)
        self.released.insert(at, done)
        run = self._run_of.pop(key)
        tenant, rate, start, _ = self._runs[run]
        self._runs[run] = (tenant, rate, start, now)
        if run in self._open:
            self._open[run] = self._runs[run]
        return done

    def rates(self, keys: Iterable[str]) -> dict[str, int]:
        """Per tenant, the normalised units per second the active allocations of ``keys`` cost."""
        out: dict[str, int] = {}
        for key in keys:
            run = self._run_of.get(key)
            if run is not None:
                tenant, rate, _, _ = self._runs[run]
                out[tenant] = out.get(tenant, 0) + rate
        return out

    def record_checkpoint(self, key: str, at: float) -> None:
        """``key`` reported a checkpoint at ``at``."""
        self.checkpoints[key] = at

    # ---- the Store port ---------------------------------------------------------------------------

    @property
    def snapshot(self) -> FleetSnapshot:
        """The fleet with the usage of the active allocations."""
        if self._snapshot is None:
            self._snapshot = self.fleet.with_usage(s for a in self.active.values() for s in a.shares)
        return self._snapshot

    def cycle_view(self, now: float | None = None) -> tuple[FleetSnapshot, list[Allocation]]:
        return self.snapshot, list(self.active.values())

    def get(self, key: str) -> Allocation | None:
        if key in self.active:
            return self.active[key]
        return next((a for a in reversed(self.released) if a.key == key), None)

    def history(self, since: float, until: float | None = None) -> list[Allocation]:
        first = bisect.bisect_right(self._release_times, since)
        alive = [*self.released[first:], *self.active.values()]
        return alive if until is None else [a for a in alive if a.created_at < until]

    def history_of(self, patterns: Collection[tuple[str, str]]) -> list[Allocation]:
        every = sorted([*self.released, *self.active.values()], key=lambda a: a.created_at)
        return [a for a in every if any(a.key.startswith(p) and a.key.endswith(s) for p, s in patterns)]

    def checkpoint_times(self, keys: Iterable[str]) -> dict[str, float]:
        return {k: self.checkpoints[k] for k in keys if k in self.checkpoints}

    def node_addresses(self) -> dict[str, str]:
        return dict(self.addresses)

    def tenant_use(self, snapshot: FleetSnapshot, since: float, now: float) -> dict[str, int]:
        """As :func:`~gpusched.quota.usage.tenant_usage` over :meth:`history`, each run counted
        ``int(rate × overlap)`` on the idle fleet's rates; runs that ended count once."""
        if since != self._period:  # a new period: recount every run once
            self._period = since
            self._closed = {}
            self._open = {r: run for r, run in self._runs.items() if run[3] is None or run[3] > since}
        used = dict(self._closed)
        still = {}
        for run, (tenant, rate, begin, end) in self._open.items():
            stop = now if end is None else min(end, now)
            seconds = max(0.0, stop - max(begin, since))
            if seconds > 0:
                used[tenant] = used.get(tenant, 0) + int(rate * seconds)
            if end is not None and end <= now:
                if seconds > 0:
                    self._closed[tenant] = self._closed.get(tenant, 0) + int(rate * seconds)
            else:
                still[run] = (tenant, rate, begin, end)
        self._open = still
        return used
