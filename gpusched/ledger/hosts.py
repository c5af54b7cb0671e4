"""GPU hosts of a multi-host fleet, in the ledger: registration, heartbeats, lost and re-admitted.

Each GPU host's agent registers the host under its name with the nodes it discovered (inventory
source ``host:<name>``) and heartbeats. The fleet snapshot leaves out the nodes of a host that is
not ``live``; :meth:`LedgerHosts.mark_lost_hosts` turns a host whose heartbeat is older than a
timeout into ``lost``; its next registration or heartbeat re-admits it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from gpusched.errors import HostConflictError, LedgerError
from gpusched.gang import is_loopback
from gpusched.ledger.engine import read_tx, write_tx
from gpusched.ledger.events import write_event
from gpusched.ledger.schema import HOSTS, NODES
from gpusched.model import HOST_SOURCE_PREFIX, Node

__all__ = [
    "LAUNCH_EVENT", "HostRecord", "HostState", "LedgerHosts", "devices_fingerprint",
    "host_queue", "loopback_warning",
]

LAUNCH_EVENT = "launch"
"""Event the Celery executor records per dispatched task: the task's environment and its host."""


class HostState:
    """Values of the ``state`` column of a host."""

    LIVE = "live"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class HostRecord:
    """One registered GPU host."""

    name: str
    fingerprint: str
    devices: tuple[str, ...]
    address: str
    state: str
    reason: str | None
    registered_at: float
    last_heartbeat: float

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
                      row.registered_at, row.last_heartbeat)


class LedgerHosts:
    """Host methods of :class:`gpusched.ledger.Ledger` (needs ``self.engine`` and ``sync_inventory``)."""

    engine: sa.Engine

    def sync_inventory(self, nodes: Sequence[Node], source: str, *, now: float | None = None) -> None:
        raise NotImplementedError  # provided by Ledger

    def register_host(
        self, name: str, nodes: Sequence[Node], *, stale_after_s: float, address: str = "127.0.0.1",
        now: float | None = None,
    ) -> HostRecord:
        """Register (or re-admit) host ``name`` with ``nodes`` and record its inventory.

        ``address`` is where other hosts reach this one (rank 0 of a multi-node gang).

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
            values = {"fingerprint": fingerprint, "devices": devices, "address": address,
                      "state": HostState.LIVE,
                      "reason": None, "last_heartbeat": at}
            if row is None:
                conn.execute(sa.insert(HOSTS).values(name=name, registered_at=at, **values))
                write_event(conn, at, "host", name, state="registered", devices=len(devices))
            else:
                conn.execute(sa.update(HOSTS).where(HOSTS.c.name == name).values(**values))
                if row.state != HostState.LIVE:
                    write_event(conn, at, "host", name, state="readmitted", devices=len(devices))
        self.sync_inventory(nodes, source=HOST_SOURCE_PREFIX + name, now=at)
        return self.host(name)  # type: ignore[return-value]

    def heartbeat_host(self, name: str, *, now: float | None = None) -> str:
        """Record a heartbeat of ``name``; a lost host comes back ``live``. Returns the state."""
        at = time.time() if now is None else now
        with write_tx(self.engine) as conn:
            row = conn.execute(sa.select(HOSTS.c.state).where(HOSTS.c.name == name)).first()
            if row is None:
                raise LedgerError(
                    f"host {name!r} is not registered; start `gpusched agent --host-name {name}`"
                )
            conn.execute(sa.update(HOSTS).where(HOSTS.c.name == name).values(
                last_heartbeat=at, state=HostState.LIVE, reason=None))
            if row.state != HostState.LIVE:
                write_event(conn, at, "host", name, state="readmitted")
        return HostState.LIVE

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

    def mark_lost_hosts(self, timeout_s: float, *, now: float | None = None) -> list[HostRecord]:
        """Mark every live host whose last heartbeat is older than ``timeout_s`` lost; return them."""
        at = time.time() if now is None else now
        lost = []
        with write_tx(self.engine) as conn:
            rows = conn.execute(sa.select(HOSTS).where(
                HOSTS.c.state == HostState.LIVE, HOSTS.c.last_heartbeat < at - timeout_s)).all()
            for row in rows:
                reason = f"node lost: no heartbeat from host {row.name} for {at - row.last_heartbeat:.0f} s"
                conn.execute(sa.update(HOSTS).where(HOSTS.c.name == row.name).values(
                    state=HostState.LOST, reason=reason))
                write_event(conn, at, "host", row.name, state="lost", reason=reason)
                lost.append(HostRecord(row.name, row.fingerprint, tuple(row.devices), row.address,
                                       HostState.LOST, reason, row.registered_at, row.last_heartbeat))
        return lost

    def unavailable_nodes(self, conn: sa.Connection) -> set[str]:
        """Nodes of hosts that are not live (they leave the snapshot)."""
        rows = conn.execute(sa.select(HOSTS.c.name).where(HOSTS.c.state != HostState.LIVE))
        sources = [HOST_SOURCE_PREFIX + r.name for r in rows]
        if not sources:
            return set()
        return {r.name for r in conn.execute(sa.select(NODES.c.name).where(NODES.c.source.in_(sources)))}
