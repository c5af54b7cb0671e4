"""The Ledger facade: one object over the ledger's concepts, plus inventory and the fleet view.

Each concept's SQL lives in its own module, mixed in here so callers see one ``Ledger``:
allocations (:mod:`gpusched.ledger.allocations`), the pending queue (:mod:`.queue`), telemetry
samples (:mod:`.samples`), the event log (:mod:`.events`), the fault chain's request overrides
(:mod:`.overrides`), GPU hosts (:mod:`.hosts`), checkpoints with preemption notices
(:mod:`.checkpoints`), the migrate mode's moves in flight (:mod:`.moves`) and the demand that
waited (:mod:`.demand`). This module keeps the lifecycle, inventory, health and cordons, and the
reads that combine concepts (:meth:`Ledger.snapshot`, :meth:`Ledger.cycle_view`). Every method
is one database transaction (see ``docs/ledger.md``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import TracebackType

import sqlalchemy as sa

from gpusched.errors import LedgerError
from gpusched.ledger import capacity, inventory
from gpusched.ledger.active_view import ActiveView
from gpusched.ledger.allocations import LedgerAllocations
from gpusched.ledger.checkpoints import LedgerCheckpoints
from gpusched.ledger.demand import LedgerDemand
from gpusched.ledger.engine import default_url, make_engine, read_tx, write_tx
from gpusched.ledger.events import LedgerEvents, write_event
from gpusched.ledger.hosts import HostState, LedgerHosts
from gpusched.ledger.migrate import upgrade
from gpusched.ledger.moves import LedgerMoves
from gpusched.ledger.overrides import LedgerOverrides
from gpusched.ledger.queue import LedgerQueue
from gpusched.ledger.samples import LedgerSamples
from gpusched.ledger.schema import DEVICES, NODES
from gpusched.model import DeviceUsage, FleetSnapshot, Health, Node
from gpusched.records import Allocation

__all__ = ["Ledger"]

_PG_INVENTORY_LOCK = 0x67707573636866  # advisory lock key for inventory syncs


def _away_node(node: Node, state: str | None) -> Node:
    """``node`` as the snapshot shows it while its GPU host is in ``state`` (None: in service)."""
    if state is None:
        return node
    if state == HostState.STANDBY:
        return replace(node, standby=True)
    return replace(node, cordoned=True)


def _now(now: float | None) -> float:
    return time.time() if now is None else float(now)


def _shown(usage: Mapping[str, DeviceUsage], known: frozenset[str]) -> Mapping[str, DeviceUsage]:
    """``usage`` of the devices in ``known`` only (``usage`` itself when it names no other)."""
    if usage.keys() <= known:
        return usage
    return {u: v for u, v in usage.items() if u in known}


class Ledger(LedgerAllocations, LedgerQueue, LedgerSamples, LedgerEvents, LedgerOverrides, LedgerHosts,
             LedgerCheckpoints, LedgerMoves, LedgerDemand):
    """Allocations, leases, inventory, health, cordons, queue, samples, events and overrides in one database.

    ``Ledger(url)``: ``url`` None means ``$GPUSCHED_DB_URL``, else SQLite (WAL) at
    ``state_dir()/ledger.db``. Call :meth:`migrate` once before use (it is idempotent). A Ledger
    holds a connection pool; create it in the process that uses it (after a fork, make a new one)
    and :meth:`close` it when done (or use it as a context manager). ``lock_wait_s`` bounds how long
    an operation waits for another writer's lock (default 60 s; the executor uses a few seconds).
    """

    def __init__(self, url: str | None = None, *, lock_wait_s: float | None = None) -> None:
        self.url = url or default_url()
        self.engine = make_engine(self.url, lock_wait_s=lock_wait_s)
        # The nodes last loaded, at which inventory revision, and the snapshot view of them
        # without the nodes of lost hosts: reused while the revision and the lost nodes stay the
        # same, so a scheduling cycle reads only the usage and the placement engine's per-fleet
        # index (keyed on the nodes tuple's identity) survives from cycle to cycle.
        self._inventory: tuple[int, tuple[Node, ...], tuple[str, ...]] | None = None
        # (revision, lost nodes, the nodes shown, their devices' uuids)
        self._fleet_view: (tuple[int, frozenset[tuple[str, str]], tuple[Node, ...], frozenset[str]]
                           | None) = None
        # The unreleased allocations and their usage as of the last cycle_view, followed from the
        # change feed, and the snapshot it returned (with the nodes and usage version it shows).
        self._active_view = ActiveView()
        self._cycle_snapshot: tuple[tuple[Node, ...], int, FleetSnapshot] | None = None
        self._cycle_turn = threading.Lock()  # cycle_view's kept state is updated by one caller at a time

    # ---- lifecycle ---------------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the schema to the newest revision (idempotent; safe from several processes)."""
        upgrade(self.engine)

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.engine.url.render_as_string(hide_password=True)!r})"

    # ---- inventory -----------------------------------------------------------------------------

    def sync_inventory(self, nodes: Sequence[Node], source: str, *, now: float | None = None) -> None:
        """Record the nodes ``source`` discovered; that source's nodes not listed are removed.

        Cordons and health overrides survive a sync; the reported health is replaced.
        """
        at = _now(now)
        with write_tx(self.engine) as conn:
            if conn.dialect.name == "postgresql":  # agents syncing at once take turns (SQLite: IMMEDIATE)
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_INVENTORY_LOCK})
            changes = inventory.write_inventory(conn, nodes, source, at)
            if changes["added"] or changes["removed"]:
                write_event(conn, at, "inventory", source, added=changes["added"], removed=changes["removed"])
            for line in changes["health"]:
                write_event(conn, at, "health", line.split(":", 1)[0], reported=line, source=source)

    def snapshot(self, now: float | None = None) -> FleetSnapshot:
        """The fleet now: inventory with health and cordons, plus usage of active allocations."""
        with read_tx(self.engine) as conn:
            return self._snapshot(conn, now)

    def cycle_view(self, now: float | None = None) -> tuple[FleetSnapshot, list[Allocation]]:
        """What one scheduling cycle reads: :meth:`snapshot` and :meth:`active`, in ONE transaction.

        Both come from the same database state, so a task released between two reads can never
        show as running on devices the snapshot already reports free (or the reverse). Equal to
        what a new ``Ledger`` reads, but a long-lived one reads only the allocation rows changed
        since its last call (:class:`~gpusched.ledger.active_view.ActiveView`) and reuses the
        nodes and indexes of its last snapshot while the inventory stays the same.
        """
        with self._cycle_turn, read_tx(self.engine) as conn:
            active = self._active_view.read(conn)
            return self._snapshot_of_view(conn, _now(now)), active

    def _snapshot_of_view(self, conn: sa.Connection, at: float) -> FleetSnapshot:
        """The fleet with the usage of ``self._active_view``. While the nodes shown stay the
        same, built from the last one returned: with its very usage mapping when the usage did
        not change, with its usage updated on the devices the last read changed when that read
        followed the one it was built from; O(fleet) only when the nodes or sources changed."""
        nodes, known, sources = self._load_fleet(conn)
        source = "+".join(sources) or "empty"
        view = self._active_view
        version = view.usage_version
        kept = self._cycle_snapshot
        if kept is None or kept[0] is not nodes or kept[2].source != source:
            snapshot = FleetSnapshot(nodes, _shown(view.usage, known), source=source, taken_at=at)
        elif kept[1] == version:
            snapshot = kept[2].retaken(at)
        elif kept[1] == version - 1 and view.usage_changed_on is not None:
            changed = {uuid: view.usage.get(uuid) for uuid in view.usage_changed_on & known}
            snapshot = kept[2].retaken(at, changed=changed)
        else:
            snapshot = kept[2].retaken(at, _shown(view.usage, known))
        self._cycle_snapshot = (nodes, version, snapshot)
        return snapshot

    def _snapshot(self, conn: sa.Connection, now: float | None) -> FleetSnapshot:
        nodes, known, sources = self._load_fleet(conn)
        return FleetSnapshot(
            nodes,
            _shown(capacity.active_usage(conn), known),
            source="+".join(sources) or "empty",
            taken_at=_now(now),
        )

    def _load_fleet(self, conn: sa.Connection) -> tuple[tuple[Node, ...], frozenset[str], tuple[str, ...]]:
        """The nodes a snapshot shows (without those of lost hosts), their devices' uuids and the
        inventory sources, loaded again only when the inventory's revision or the set of lost
        nodes changed."""
        at = inventory.revision(conn)
        loaded = self._inventory
        if loaded is None or loaded[0] != at:
            loaded = (at, *inventory.load_nodes(conn))
            self._inventory = loaded
        _, nodes, sources = loaded
        away = self.unavailable_nodes(conn)
        gone = frozenset(away.items())
        view = self._fleet_view
        if view is None or view[0] != at or view[1] != gone:
            # Nodes of lost GPU hosts take no work until their agent and worker are back; those of
            # an unconfirmed host (agent silent, its tries alive) keep their running work, cordoned.
            # A standby host's (powered off on purpose) are standby nodes.
            shown = tuple(_away_node(n, away.get(n.name))
                          for n in nodes if away.get(n.name) != HostState.LOST) if away else nodes
            view = (at, gone, shown, frozenset(d.uuid for n in shown for d in n.devices))
            self._fleet_view = view
        return view[2], view[3], sources

    def set_health(self, uuid: str, health: Health, reason: str, *, now: float | None = None) -> None:
        """Override a device's health (the snapshot shows the worse of this and the reported one)."""
        at = _now(now)
        with write_tx(self.engine) as conn:
            result = conn.execute(
                sa.update(DEVICES).where(DEVICES.c.uuid == uuid)
                .values(health_override=str(Health(health)), health_reason=reason)
            )
            if result.rowcount == 0:
                raise LedgerError(f"device {uuid!r} is not in the inventory; sync the inventory first")
            inventory.bump_revision(conn)
            write_event(conn, at, "health", uuid, health=str(health), reason=reason)

    def cordon(self, target: str, reason: str, *, now: float | None = None) -> None:
        """Stop new allocations on a device (by uuid) or a whole node (by name)."""
        self._set_cordon(target, True, reason, _now(now))

    def uncordon(self, target: str, *, now: float | None = None) -> None:
        """Allow new allocations again on a device (uuid) or node (name)."""
        self._set_cordon(target, False, None, _now(now))

    def _set_cordon(self, target: str, cordoned: bool, reason: str | None, at: float) -> None:
        with write_tx(self.engine) as conn:
            values = {"cordoned": cordoned, "cordon_reason": reason}
            hit = conn.execute(sa.update(DEVICES).where(DEVICES.c.uuid == target).values(**values)).rowcount
            if not hit:
                hit = conn.execute(sa.update(NODES).where(NODES.c.name == target).values(**values)).rowcount
            if not hit:
                raise LedgerError(
                    f"{target!r} is neither a device uuid nor a node name in the inventory; "
                    "`gpusched inventory` (or the GPU fleet page) lists the names"
                )
            inventory.bump_revision(conn)
            write_event(conn, at, "cordon" if cordoned else "uncordon", target, reason=reason)
