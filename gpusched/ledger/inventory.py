"""Inventory rows: writing discovered nodes, reading them back as :class:`~gpusched.model.Node`.

Discovery owns topology and the *reported* health; the ledger owns cordons and the health
*override* set by the fault chain. A sync never clears a cordon or an override, and the health a
snapshot shows is the worse of the reported one and the override.

Every transaction that changes what :func:`load_nodes` returns calls :func:`bump_revision`
(a sync only when some value other than its time stamp changed), so a reader that loaded the
nodes at :func:`revision` ``r`` may reuse them while the revision is still ``r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from gpusched.catalog import LinkKind, Vendor
from gpusched.ledger.schema import DEVICES, INVENTORY_REVISION, NODES
from gpusched.model import Device, Health, Node

__all__ = ["bump_revision", "effective_health", "load_nodes", "revision", "write_inventory"]

_SEVERITY = {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.UNHEALTHY: 2}


def effective_health(reported: str, override: str | None) -> Health:
    """The worse of the health the backend reported and the override the ledger holds."""
    health = Health(reported)
    if override is not None and _SEVERITY[Health(override)] > _SEVERITY[health]:
        return Health(override)
    return health


def revision(conn: sa.Connection) -> int:
    """The inventory's revision number now (see the module docstring)."""
    query = sa.select(INVENTORY_REVISION.c.revision).where(INVENTORY_REVISION.c.id == 1)
    value = conn.execute(query).scalar()
    return int(value or 0)


def bump_revision(conn: sa.Connection) -> None:
    """Increase the inventory's revision number (in the caller's write transaction)."""
    conn.execute(
        sa.update(INVENTORY_REVISION).where(INVENTORY_REVISION.c.id == 1)
        .values(revision=INVENTORY_REVISION.c.revision + 1)
    )


def write_inventory(
    conn: sa.Connection, nodes: Sequence[Node], source: str, now: float
) -> dict[str, list[str]]:
    """Upsert ``nodes`` for ``source`` and drop that source's nodes no longer listed.

    Returns the changes worth an event: ``added`` / ``removed`` node names and ``health`` lines
    for devices whose reported health changed. Bumps the inventory's revision when anything but
    the rows' ``updated_at`` changed.
    """
    existing_nodes = {row.name: row for row in conn.execute(sa.select(NODES))}
    devices_query = sa.select(DEVICES).order_by(DEVICES.c.uuid)
    if conn.dialect.name == "postgresql":
        # Lock every device row up front, in uuid order — the order allocate() locks its devices
        # in — so a sync and an allocation never wait for each other in a cycle (no deadlock).
        devices_query = devices_query.with_for_update(of=DEVICES)
    existing_devices = {row.uuid: row for row in conn.execute(devices_query)}
    listed = {n.name for n in nodes}
    removed = sorted(
        name for name, row in existing_nodes.items() if row.source == source and name not in listed
    )
    if removed:
        conn.execute(sa.delete(DEVICES).where(DEVICES.c.node.in_(removed)))
        conn.execute(sa.delete(NODES).where(NODES.c.name.in_(removed)))
    changes: dict[str, list[str]] = {"added": [], "removed": removed, "health": []}
    changed = bool(removed)
    for position, node in enumerate(nodes):
        values = {
            "rack": node.rack,
            "labels": [list(pair) for pair in node.labels],
            "cpu_milli": node.cpu_milli,
            "memory_bytes": node.memory_bytes,
            "standby": node.standby,
            "source": source,
            "position": position,
            "updated_at": now,
        }
        if node.name in existing_nodes:
            changed = changed or _differs(existing_nodes[node.name], values)
            conn.execute(sa.update(NODES).where(NODES.c.name == node.name).values(**values))
        else:
            changed = True
            changes["added"].append(node.name)
            conn.execute(sa.insert(NODES).values(
                name=node.name, cordoned=node.cordoned,
                cordon_reason="cordoned in the inventory" if node.cordoned else None, **values,
            ))
        listed_devices = {d.uuid for d in node.devices}
        stale = [
            u for u, row in existing_devices.items() if row.node == node.name and u not in listed_devices
        ]
        if stale:
            changed = True
            conn.execute(sa.delete(DEVICES).where(DEVICES.c.uuid.in_(stale)))
        for device in node.devices:
            changed = _write_device(conn, device, existing_devices.get(device.uuid), now, changes) or changed
    if changed:
        bump_revision(conn)
    return changes


def _differs(old: Any, values: dict[str, Any]) -> bool:
    """Whether ``values`` change the row ``old`` in anything but its time stamp."""
    return any(getattr(old, column) != value for column, value in values.items() if column != "updated_at")


def _write_device(
    conn: sa.Connection, device: Device, old: Any, now: float, changes: dict[str, list[str]]
) -> bool:
    """Insert or update ``device``'s row; whether that changed anything but its time stamp."""
    values = {
        "node": device.node,
        "idx": device.index,
        "model": device.model,
        "vendor": str(device.vendor),
        "architecture": device.architecture,
        "memory_bytes": device.memory_bytes,
        "numa_node": device.numa_node,
        "pcie_switch": device.pcie_switch,
        "island": device.island,
        "link": str(device.link),
        "peers": list(device.peers),
        "mig_enabled": device.mig_enabled,
        "parent": device.parent,
        "profile": device.profile,
        "compute_milli": device.compute_milli,
        "reported_health": str(device.health),
        "updated_at": now,
    }
    if old is None:
        conn.execute(sa.insert(DEVICES).values(
            uuid=device.uuid, health_override=None, health_reason=None, cordoned=device.cordoned,
            cordon_reason="cordoned in the inventory" if device.cordoned else None, **values,
        ))
        return True
    if old.reported_health != str(device.health):
        changes["health"].append(f"{device.uuid}: {old.reported_health} -> {device.health}")
    conn.execute(sa.update(DEVICES).where(DEVICES.c.uuid == device.uuid).values(**values))
    return _differs(old, values)


def load_nodes(conn: sa.Connection) -> tuple[tuple[Node, ...], tuple[str, ...]]:
    """Every node with its devices (cordons and effective health applied) and the inventory sources."""
    device_rows = conn.execute(sa.select(DEVICES).order_by(DEVICES.c.node, DEVICES.c.idx, DEVICES.c.uuid))
    by_node: dict[str, list[Device]] = {}
    for row in device_rows:
        by_node.setdefault(row.node, []).append(Device(
            uuid=row.uuid,
            index=row.idx,
            node=row.node,
            model=row.model,
            vendor=Vendor(row.vendor),
            architecture=row.architecture,
            memory_bytes=row.memory_bytes,
            numa_node=row.numa_node,
            pcie_switch=row.pcie_switch,
            island=row.island,
            link=LinkKind(row.link),
            peers=tuple(row.peers),
            health=effective_health(row.reported_health, row.health_override),
            mig_enabled=row.mig_enabled,
            cordoned=row.cordoned,
            parent=row.parent,
            profile=row.profile,
            compute_milli=row.compute_milli,
        ))
    nodes = []
    sources: set[str] = set()
    for row in conn.execute(sa.select(NODES).order_by(NODES.c.source, NODES.c.position, NODES.c.name)):
        sources.add(row.source)
        nodes.append(Node(
            name=row.name,
            rack=row.rack,
            devices=tuple(by_node.get(row.name, ())),
            labels=tuple((str(k), str(v)) for k, v in row.labels),
            cpu_milli=row.cpu_milli,
            memory_bytes=row.memory_bytes,
            cordoned=row.cordoned,
            standby=row.standby,
        ))
    return tuple(nodes), tuple(sorted(sources))
