"""GPU hosts of a multi-host fleet, in the ledger: registration, heartbeats, lost and re-admitted.

Each GPU host's agent registers the host under its name with the nodes it discovered (inventory
source ``host:<name>``) and heartbeats, saying with each heartbeat what it sees of the host's
Celery worker (:class:`WorkerStatus`). The fleet snapshot leaves out the nodes of a ``lost`` host,
shows those of an ``unconfirmed`` one cordoned (its running work goes on; nothing new goes
there) and those of a ``standby`` one as standby nodes (a powered-off host the standby scale-out
may switch on: :meth:`LedgerHosts.standby_host`; its agent's registration makes it live again).
The scheduler judges the hosts (:mod:`gpusched.scheduler.hosts`) and records its verdicts
with :meth:`LedgerHosts.set_host_state`; an agent's heartbeat re-admits a lost host only while
its worker runs.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import sqlalchemy as sa

from gpusched.errors import HostConflictError, LedgerError
from gpusched.gang import is_loopback
from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.events import write_event
from gpusched.ledger.inventory import bump_revision
from gpusched.ledger.schema import ALLOCATIONS, DEVICES, HOSTS, NODES, SHARES
from gpusched.model import HOST_SOURCE_PREFIX, Node

__all__ = [
    "LAUNCH_EVENT", "HostRecord", "HostState", "LedgerHosts", "WorkerState", "WorkerStatus",
    "devices_fingerprint", "host_queue", "loopback_warning",
]

LAUNCH_EVENT = "launch"
"""Event the Celery executor records per dispatched task: the task's environment and its host."""


class HostState:
    """Values of the ``state`` column of a host."""

    LIVE = "live"
    LOST = "lost"
    UNCONFIRMED = "unconfirmed"
    """Its agent is silent but its running tries still heartbeat (Airflow's task supervisor): the
    work there goes on, nothing new is placed there."""
    STANDBY = "standby"
    """Powered off on purpose (declared standby, or released by the scale-in): its nodes are
    standby nodes of the snapshot, the scheduler does not judge it (its silence is no loss), a
    heartbeat does not wake it; its agent's next registration (the host switched on) does."""


class WorkerState:
    """What an agent sees of its host's Celery worker (``worker_state`` of a host)."""

    RUNNING = "running"
    STOPPED = "stopped"  # every process of it stopped (SIGSTOP): frozen
    MISSING = "missing"  # no process of it


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One look of an agent at its host's Celery worker: ``state`` (:class:`WorkerState`) and
    ``slots`` (its concurrency, None when unknown)."""

    state: str
    slots: int | None = None


@dataclass(frozen=True, slots=True)
class HostRecord:
    """One registered GPU host.

    ``worker_state`` / ``worker_seen_at`` / ``worker_slots``: what its agent last reported of the
    host's Celery worker, when it last saw it running, and its slots (None: not watched).
    """

    name: str
    fingerprint: str
    devices: tuple[str, ...]
    address: str
    state: str
    reason: str | None
    registered_at: float
    last_heartbeat: float
    worker_state: str | None = None
    worker_seen_at: float | None = None
    worker_slots: int | None = None

    @property
    def queue(self) -> str:
        """The Celery queue of this host's worker."""
        return host_queue(self.name)


def host_queue(host: str) -> str:
    """The Celery queue a GPU host's worker listens on: ``gpusched@<host>``."""
    return f"gpusched@{host}"


def devices_fingerprint(nodes: Sequence[Node]) -> tuple[str, list[str]]:
    """A stable digest of the devices of ``nodes`` (node, index, uuid, model) and the device list."""
    devices = sorted(f"{d.node}/{d.index}/{d.uuid}/{d.model}" for n in nodes for d in n.devices)
    return hashlib.sha256(json.dumps(devices).encode()).hexdigest()[:32], devices


def loopback_warning(hosts: Sequence[HostRecord]) -> str | None:
    """One line when the live ``hosts`` mix loopback and routable addresses, else None.

    A multi-node gang whose rank 0 runs on a host registered at a loopback address gets it as
    ``MASTER_ADDR``, which the members on the other hosts cannot reach. Every live host on
    loopback passes: that is the fleet of one machine (each agent given ``--address 127.0.0.1``
    on purpose), where loopback reaches every member.
    """
    live = [h for h in hosts if h.state == HostState.LIVE]
    looped = [h for h in live if is_loopback(h.address)]
    if not looped or len(looped) == len(live):
        return None
    names = ", ".join(f"{h.name} ({h.address})" for h in looped)
    return (f"GPU host(s) {names} registered a loopback address beside {len(live) - len(looped)} "
            "routable host(s): a multi-node gang whose rank 0 runs there gets a MASTER_ADDR the other "
            "hosts cannot reach; restart each such agent with --address <the host's routable address> "
            "(GPUSCHED_HOST_ADDRESS)")


def _record(row: Any) -> HostRecord:
    return HostRecord(row.name, row.fingerprint, tuple(row.devices), row.address, row.state, row.reason,
                      row.registered_at, row.last_heartbeat, row.worker_state, row.worker_seen_at,
                      row.worker_slots)


def _no_worker(name: str, worker: WorkerStatus | None) -> str:
    return (f"node lost: no heartbeat from host {name}: its Celery worker (queue {host_queue(name)}) is "
            f"{worker.state if worker else 'unknown'}")


def _worker_values(worker: WorkerStatus | None, at: float, seen_at: float | None) -> dict[str, Any]:
    if worker is None:
        return {"worker_state": None, "worker_seen_at": None, "worker_slots": None}
    running = worker.state == WorkerState.RUNNING
    return {"worker_state": worker.state, "worker_seen_at": at if running else seen_at,
            "worker_slots": worker.slots}


class LedgerHosts:
    """Host methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine`` and ``sync_inventory``)."""

    engine: sa.Engine

    def sync_inventory(self, nodes: Sequence[Node], source: str, *, now: float | None = None) -> None:
        raise NotImplementedError  # provided by Ledger

    def register_host(
        self, name: str, nodes: Sequence[Node], *, stale_after_s: float, address: str = "127.0.0.1",
        now: float | None = None, worker: WorkerStatus | None = None,
    ) -> HostRecord:
        """Register (or re-admit) host ``name`` with ``nodes`` and record its inventory.

        ``address`` is where other hosts reach this one (rank 0 of a multi-node gang); ``worker``
        what the agent sees of the host's Celery worker (None: not watched). A host whose worker
        is not running is registered ``lost`` (its nodes take no work until the worker runs).

        Raises:
            HostConflictError: ``name`` is registered, alive (heartbeat within ``stale_after_s``),
                with other devices: two hosts share one name.
            LedgerError: ``nodes`` is empty.
        """
        at = time.time() if now is None else now
        if not nodes:
            raise LedgerError(
                f"host {name!r} has no GPU node to register; on a simulated fleet name a node "
                f"{name!r} in the fleet file, on hardware check the driver (gpusched inventory)"
            )
        fingerprint, devices = devices_fingerprint(nodes)
        with write_tx(self.engine) as conn:
            row = conn.execute(sa.select(HOSTS).where(HOSTS.c.name == name)).first()
            if row is not None and row.fingerprint != fingerprint and row.state == HostState.LIVE \
                    and at - row.last_heartbeat < stale_after_s:
                raise HostConflictError(
                    f"host name {name!r} is already registered with other devices "
                    f"({len(row.devices)} device(s), heartbeat {at - row.last_heartbeat:.0f} s ago); "
                    "give each GPU host its own name (GPUSCHED_HOST) or stop the other agent"
                )
            serving = worker is None or worker.state == WorkerState.RUNNING
            values = {"fingerprint": fingerprint, "devices": devices, "address": address,
                      "state": HostState.LIVE if serving else HostState.LOST,
                      "reason": None if serving else _no_worker(name, worker),
                      "last_heartbeat": at,
                      **_worker_values(worker, at, None if row is None else row.worker_seen_at)}
            if row is None:
                conn.execute(sa.insert(HOSTS).values(name=name, registered_at=at, **values))
                write_event(conn, at, "host", name, state="registered", devices=len(devices))
            else:
                conn.execute(sa.update(HOSTS).where(HOSTS.c.name == name).values(**values))
                if row.state != HostState.LIVE and serving:
                    came = "switched_on" if row.state == HostState.STANDBY else "readmitted"
                    write_event(conn, at, "host", name, state=came, devices=len(devices))
        self.sync_inventory(nodes, source=HOST_SOURCE_PREFIX + name, now=at)
        return self.host(name)  # type: ignore[return-value]

    def heartbeat_host(
        self, name: str, *, now: float | None = None, worker: WorkerStatus | None = None,
    ) -> str:
        """Record a heartbeat of ``name`` by its agent, with what it sees of the host's Celery
        worker (None: not watched). A lost or unconfirmed host comes back ``live`` when its worker
        runs (or is not watched); a live host whose worker stopped stays live until the scheduler
        judges it (:mod:`gpusched.scheduler.hosts`). Returns the state."""
        at = time.time() if now is None else now
        with write_tx(self.engine) as conn:
            row = conn.execute(sa.select(HOSTS.c.state, HOSTS.c.worker_seen_at)
                               .where(HOSTS.c.name == name)).first()
            if row is None:
                raise LedgerError(
                    f"host {name!r} is not registered; start `gpusched agent --host-name {name}`"
                )
            serving = worker is None or worker.state == WorkerState.RUNNING
            state = HostState.LIVE if serving or row.state == HostState.LIVE else row.state
            if row.state == HostState.STANDBY:  # the agent of a released host, not yet stopped
                state = HostState.STANDBY
            values: dict[str, Any] = {"last_heartbeat": at, "state": state,
                                      **_worker_values(worker, at, row.worker_seen_at)}
            if state == HostState.LIVE:
                values["reason"] = None
            conn.execute(sa.update(HOSTS).where(HOSTS.c.name == name).values(**values))
            if row.state != HostState.LIVE and state == HostState.LIVE:
                write_event(conn, at, "host", name, state="readmitted")
        return state

    def standby_host(
        self, name: str, nodes: Sequence[Node] = (), *, reason: str, now: float | None = None,
    ) -> HostRecord | None:
        """Mark GPU host ``name`` standby: powered off on purpose, its nodes offered to the standby
        scale-out, its silence no loss. With ``nodes`` (what its agent discovered: ``gpusched agent
        --host-name NAME --standby``) the host is declared, registered when new; without, a
        registered host goes back to standby (the scale-in released it) — unless an active
        allocation holds one of its devices. Its nodes' rows are marked standby too, so an
        allocation's capacity re-check refuses them: the check and the change take the devices'
        row locks (PostgreSQL; SQLite: ``BEGIN IMMEDIATE``), so a task placed there at the same
        moment either keeps the host in service or is refused. Returns the host, or None when
        ``name`` is not registered and no ``nodes`` are given, or it is busy."""
        at = time.time() if now is None else now
        source = HOST_SOURCE_PREFIX + name
        if nodes:
            self.sync_inventory([replace(n, standby=True) for n in nodes], source=source, now=at)
        with write_tx(self.engine) as conn:
            row = conn.execute(sa.select(HOSTS).where(HOSTS.c.name == name)).first()
            if row is None and not nodes:
                return None
            mine = sa.select(NODES.c.name).where(NODES.c.source == source)
            devices = sa.select(DEVICES.c.uuid).where(DEVICES.c.node.in_(mine)).order_by(DEVICES.c.uuid)
            if conn.dialect.name == "postgresql":  # the order allocate() locks devices in
                conn.execute(devices.with_for_update(of=DEVICES)).all()
            busy = conn.execute(sa.select(SHARES.c.node).join(ALLOCATIONS, SHARES.c.allocation_id
                                                               == ALLOCATIONS.c.id)
                                .where(ALLOCATIONS.c.released_at.is_(None), SHARES.c.node.in_(mine))
                                .limit(1)).first()
            if busy is not None and not nodes:
                return None
            values: dict[str, Any] = {"state": HostState.STANDBY, "reason": reason}
            if nodes:
                fingerprint, listed = devices_fingerprint(nodes)
                values.update(fingerprint=fingerprint, devices=listed)
            if row is None:
                conn.execute(sa.insert(HOSTS).values(name=name, address="", registered_at=at,
                                                     last_heartbeat=at, **values))
            else:
                conn.execute(sa.update(HOSTS).where(HOSTS.c.name == name).values(**values))
            if conn.execute(sa.update(NODES).where(NODES.c.source == source, NODES.c.standby.is_(False))
                            .values(standby=True)).rowcount:
                bump_revision(conn)
            if row is None or row.state != HostState.STANDBY:
                write_event(conn, at, "host", name, state=HostState.STANDBY, reason=reason)
        return self.host(name)

    def resume_host(self, name: str, reason: str, *, now: float | None = None) -> bool:
        """Put a ``standby`` host whose release did not happen (its scaler call failed) back in
        service: ``live``, its nodes no longer standby. False when it is not standby."""
        at = time.time() if now is None else now
        with write_tx(self.engine) as conn:
            standby = sa.and_(HOSTS.c.name == name, HOSTS.c.state == HostState.STANDBY)
            back = sa.update(HOSTS).where(standby).values(state=HostState.LIVE, reason=None)
            done = conn.execute(back).rowcount
            if not done:
                return False
            conn.execute(sa.update(NODES).where(NODES.c.source == HOST_SOURCE_PREFIX + name)
                         .values(standby=False))
            bump_revision(conn)
            write_event(conn, at, "host", name, state=HostState.LIVE, reason=reason)
        return True

    def host(self, name: str) -> HostRecord | None:
        """The host registered as ``name``, or None."""
        with read_tx(self.engine) as conn:
            row = conn.execute(sa.select(HOSTS).where(HOSTS.c.name == name)).first()
        return None if row is None else _record(row)

    def hosts(self) -> list[HostRecord]:
        """Every registered host, by name."""
        with read_tx(self.engine) as conn:
            return [_record(r) for r in conn.execute(sa.select(HOSTS).order_by(HOSTS.c.name))]

    def host_nodes(self, name: str) -> list[str]:
        """Names of the nodes host ``name`` registered."""
        with read_tx(self.engine) as conn:
            rows = conn.execute(sa.select(NODES.c.name).where(NODES.c.source == HOST_SOURCE_PREFIX + name))
            return sorted(r.name for r in rows)

    def node_addresses(self) -> dict[str, str]:
        """Node name -> address of the GPU host that registered it."""
        with read_tx(self.engine) as conn:
            addresses = {r.name: r.address for r in conn.execute(sa.select(HOSTS.c.name, HOSTS.c.address))}
            rows = conn.execute(sa.select(NODES.c.name, NODES.c.source).where(
                NODES.c.source.startswith(HOST_SOURCE_PREFIX)))
            return {r.name: addresses[r.source[len(HOST_SOURCE_PREFIX):]] for r in rows
                    if r.source[len(HOST_SOURCE_PREFIX):] in addresses}

    def node_hosts(self) -> dict[str, tuple[str, str]]:
        """Node name -> (host name, host state) for every node a host's agent registered."""
        with read_tx(self.engine) as conn:
            states = {r.name: r.state for r in conn.execute(sa.select(HOSTS.c.name, HOSTS.c.state))}
            rows = conn.execute(sa.select(NODES.c.name, NODES.c.source).where(
                NODES.c.source.startswith(HOST_SOURCE_PREFIX)))
            result = {}
            for row in rows:
                host = row.source[len(HOST_SOURCE_PREFIX):]
                result[row.name] = (host, states.get(host, HostState.LOST))
            return result

    def set_host_state(self, name: str, state: str, reason: str | None, *, expected: str,
                       now: float | None = None) -> HostRecord | None:
        """Move host ``name`` from state ``expected`` to ``state`` (with ``reason``), recording
        the change; None (nothing written) when it is no longer in ``expected`` (its agent
        re-admitted it meanwhile, or another scheduler got there first)."""
        at = time.time() if now is None else now
        with write_tx(self.engine) as conn:
            done = conn.execute(sa.update(HOSTS).where(HOSTS.c.name == name, HOSTS.c.state == expected)
                                .values(state=state, reason=reason)).rowcount
            if not done:
                return None
            write_event(conn, at, "host", name, state=state, reason=reason)
            row = conn.execute(sa.select(HOSTS).where(HOSTS.c.name == name)).first()
        return _record(row)

    def unavailable_nodes(self, conn: sa.Connection) -> dict[str, str]:
        """Node -> state of the nodes of hosts that take no new work: a lost host's leave the
        snapshot; a standby host's show as standby nodes; an unconfirmed host's, and a live
        host's whose agent last saw its worker not running, show cordoned (their running work
        stays in view)."""
        rows = conn.execute(sa.select(HOSTS.c.name, HOSTS.c.state).where(sa.or_(
            HOSTS.c.state != HostState.LIVE,
            HOSTS.c.worker_state.in_([WorkerState.STOPPED, WorkerState.MISSING]))))
        states = {HOST_SOURCE_PREFIX + r.name: r.state for r in rows}
        if not states:
            return {}
        return {r.name: states[r.source] for r in conn.execute(
            sa.select(NODES.c.name, NODES.c.source).where(NODES.c.source.in_(list(states))))}
