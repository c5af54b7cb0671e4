"""Per-fleet indexes (built once per inventory) and the mutable free-capacity state of one call.

:func:`fleet_index` caches a :class:`FleetIndex` on the identity of the snapshot's ``nodes``
tuple, which :meth:`FleetSnapshot.with_usage` shares between snapshots, so a scheduling loop that
only changes usage never rebuilds it. :class:`FreeState` holds numpy arrays of free milli-GPU and
memory per device that the engine updates as it assigns, so one plan never double-books.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpusched.catalog import AcceleratorModel, Catalog, default_catalog
from gpusched.model import MILLI, Device, DeviceShare, FleetSnapshot, Health, Node

__all__ = [
    "FleetIndex", "FreeState", "LruCache", "closed_devices", "fleet_index", "in_service", "usage_arrays",
]

_CACHE_SIZE = 8


class LruCache:
    """A small thread-safe LRU keyed by identities; each entry keeps the objects it was keyed on
    alive (so an id cannot be reused while cached) and ``get`` checks them again."""

    def __init__(self, size: int = _CACHE_SIZE) -> None:
        self._size = size
        self._data: OrderedDict[tuple[int, ...], tuple[tuple[object, ...], Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, *keys: object) -> Any:
        """The value stored for exactly these objects, or None."""
        ident = tuple(id(k) for k in keys)
        with self._lock:
            hit = self._data.get(ident)
            if hit is None or any(a is not b for a, b in zip(hit[0], keys, strict=True)):
                return None
            self._data.move_to_end(ident)
            return hit[1]

    def put(self, value: Any, *keys: object) -> None:
        """Store ``value`` for these objects, evicting the least recently used beyond the size."""
        with self._lock:
            self._data[tuple(id(k) for k in keys)] = (keys, value)
            while len(self._data) > self._size:
                self._data.popitem(last=False)


_INDEXES = LruCache()


@dataclass(eq=False)
class FleetIndex:
    """Static, array-shaped view of a fleet's inventory (devices grouped by node, in order)."""

    nodes: tuple[Node, ...]
    devices: tuple[Device, ...]
    pos: dict[str, int]
    node_pos: dict[str, int]
    dev_node: np.ndarray  # int64 [D] node position of each device
    node_start: np.ndarray  # int64 [N+1] device offsets
    node_size: np.ndarray  # int64 [N]
    dev_mem: np.ndarray  # int64 [D]
    dev_model: np.ndarray  # int64 [D] position in model_names
    model_names: tuple[str, ...]
    model_info: tuple[AcceleratorModel | None, ...]
    dev_health: np.ndarray  # int8 [D]: 0 healthy, 1 degraded, 2 unhealthy
    dev_cordoned: np.ndarray  # bool [D] (device or its node)
    node_standby: np.ndarray  # bool [N]
    dev_standby: np.ndarray  # bool [D]
    dev_island: np.ndarray  # int64 [D] global island id, -1 = none
    island_node: np.ndarray  # int64 [I]
    dev_numa: np.ndarray  # int64 [D] global (node, numa) id
    numa_node: np.ndarray  # int64 [G]
    dev_switch: np.ndarray  # int64 [D] global (node, pcie switch) id, -1 = unknown
    switch_node: np.ndarray  # int64 [S]
    node_rack: np.ndarray  # int64 [N]
    racks: tuple[str, ...]
    node_labels: tuple[dict[str, str], ...]
    masks: dict[Any, Any] = field(default_factory=dict)  # per-request-signature caches

    @property
    def n_devices(self) -> int:
        """Number of devices."""
        return len(self.devices)

    @property
    def in_service(self) -> np.ndarray:
        """bool [D], read-only: the devices that may take work — not unhealthy, not cordoned (the
        device or its node), not on a standby node. Built once per index."""
        hit: np.ndarray | None = self.masks.get("in_service")
        if hit is None:
            hit = (self.dev_health < 2) & ~self.dev_cordoned & ~self.dev_standby
            hit.flags.writeable = False
            self.masks["in_service"] = hit
        return hit

    def node_devices(self, n: int) -> range:
        """Device positions of node position ``n``."""
        return range(int(self.node_start[n]), int(self.node_start[n + 1]))


def fleet_index(snapshot: FleetSnapshot, catalog: Catalog | None = None) -> FleetIndex:
    """The (cached) index of ``snapshot``'s inventory."""
    nodes = snapshot.nodes
    hit: FleetIndex | None = _INDEXES.get(nodes)
    if hit is not None:
        return hit
    index = _build(nodes, catalog or default_catalog())
    _INDEXES.put(index, nodes)
    return index


def _build(nodes: tuple[Node, ...], catalog: Catalog) -> FleetIndex:
    devices: list[Device] = []
    starts = [0]
    for node in nodes:
        devices.extend(node.devices)
        starts.append(len(devices))
    model_pos: dict[str, int] = {}
    islands: dict[tuple[int, str], int] = {}
    numas: dict[tuple[int, int], int] = {}
    switches: dict[tuple[int, str], int] = {}
    racks: dict[str, int] = {}
    dev_node, dev_model, dev_island, dev_numa, dev_switch = [], [], [], [], []
    for n, node in enumerate(nodes):
        racks.setdefault(node.rack, len(racks))
        for dev in node.devices:
            dev_node.append(n)
            dev_model.append(model_pos.setdefault(dev.model, len(model_pos)))
            dev_island.append(islands.setdefault((n, dev.island), len(islands)) if dev.island else -1)
            dev_numa.append(numas.setdefault((n, dev.numa_node), len(numas)))
            dev_switch.append(
                switches.setdefault((n, dev.pcie_switch), len(switches)) if dev.pcie_switch else -1
            )
    names = tuple(model_pos)
    i64 = np.int64
    node_standby = np.array([n.standby for n in nodes], dtype=bool)
    dev_node_arr = np.array(dev_node, dtype=i64)
    return FleetIndex(
        nodes=nodes,
        devices=tuple(devices),
        pos={d.uuid: i for i, d in enumerate(devices)},
        node_pos={n.name: i for i, n in enumerate(nodes)},
        dev_node=dev_node_arr,
        node_start=np.array(starts, dtype=i64),
        node_size=np.diff(np.array(starts, dtype=i64)),
        dev_mem=np.array([d.memory_bytes for d in devices], dtype=i64),
        dev_model=np.array(dev_model, dtype=i64),
        model_names=names,
        model_info=tuple(catalog.find(name) for name in names),
        dev_health=np.array(
            [0 if d.health is Health.HEALTHY else 1 if d.health is Health.DEGRADED else 2 for d in devices],
            dtype=np.int8,
        ),
        dev_cordoned=np.array(
            [d.cordoned or nodes[dev_node[i]].cordoned for i, d in enumerate(devices)], dtype=bool
        ),
        node_standby=node_standby,
        dev_standby=node_standby[dev_node_arr] if devices else np.zeros(0, dtype=bool),
        dev_island=np.array(dev_island, dtype=i64),
        island_node=np.array([k[0] for k in islands], dtype=i64),
        dev_numa=np.array(dev_numa, dtype=i64),
        numa_node=np.array([k[0] for k in numas], dtype=i64),
        dev_switch=np.array(dev_switch, dtype=i64),
        switch_node=np.array([k[0] for k in switches], dtype=i64),
        node_rack=np.array([racks[n.rack] for n in nodes], dtype=i64),
        racks=tuple(racks),
        node_labels=tuple(dict(n.labels) for n in nodes),
    )


_CLOSED = LruCache()


def _closed(index: FleetIndex, closed: frozenset[str]) -> tuple[np.ndarray | None, np.ndarray]:
    """(devices on the ``closed`` nodes or None, in-service devices less those), cached per
    (index, set object)."""
    if not closed:
        return None, index.in_service
    hit: tuple[np.ndarray | None, np.ndarray] | None = _CLOSED.get(index, closed)
    if hit is None:
        nodes = [index.node_pos[name] for name in closed if name in index.node_pos]
        mask: np.ndarray | None = None
        service = index.in_service
        if nodes:
            node_mask = np.zeros(len(index.nodes), dtype=bool)
            node_mask[nodes] = True
            mask = node_mask[index.dev_node]
            mask.flags.writeable = False
            service = index.in_service & ~mask
            service.flags.writeable = False
        hit = (mask, service)
        _CLOSED.put(hit, index, closed)
    return hit


def closed_devices(index: FleetIndex, closed: frozenset[str]) -> np.ndarray | None:
    """bool [D], read-only: the devices of ``index`` on the nodes named in ``closed`` (a
    snapshot's :attr:`~gpusched.model.FleetSnapshot.closed`: no new work, as if cordoned);
    None when none of them is in the fleet."""
    return _closed(index, closed)[0]


def in_service(index: FleetIndex, closed: frozenset[str]) -> np.ndarray:
    """bool [D], read-only: :attr:`FleetIndex.in_service` less the devices of the ``closed``
    nodes (the index's own array when none is in the fleet)."""
    return _closed(index, closed)[1]


_USAGES = LruCache()
# Change stamps: every change of a FreeState's node takes the next number, so two states never
# share a stamp for a node once either changed it (caches keyed on stamps stay exact).
_STAMPS = itertools.count(1)


def usage_arrays(index: FleetIndex, snapshot: FleetSnapshot) -> tuple[np.ndarray, np.ndarray]:
    """Used milli and memory per device, cached on the identity of the snapshot's usage mapping.

    A snapshot whose usage is an earlier one's with a few devices changed
    (:attr:`~gpusched.model.FleetSnapshot.usage_from`, as a long-lived ledger reader's cycle
    snapshots are) gets the earlier arrays, when cached, with those devices rewritten: O(changed)
    instead of O(devices in use)."""
    usage = snapshot.usage
    hit: tuple[np.ndarray, np.ndarray] | None = _USAGES.get(index, usage)
    if hit is not None:
        return hit
    pos = index.pos
    lineage = snapshot.usage_from
    earlier = _USAGES.get(index, lineage[0]) if lineage is not None else None
    if lineage is not None and earlier is not None:
        used_milli, used_mem = earlier[0].copy(), earlier[1].copy()
        for uuid in lineage[1]:
            p = pos.get(uuid)
            if p is not None:
                used = usage.get(uuid)
                used_milli[p] = used.used_milli if used is not None else 0
                used_mem[p] = used.used_memory_bytes if used is not None else 0
    else:
        where = np.fromiter((pos.get(u, -1) for u in usage), dtype=np.int64, count=len(usage))
        milli = np.fromiter((v.used_milli for v in usage.values()), dtype=np.int64, count=len(usage))
        mem = np.fromiter((v.used_memory_bytes for v in usage.values()), dtype=np.int64, count=len(usage))
        known = where >= 0
        used_milli = np.zeros(index.n_devices, dtype=np.int64)
        used_mem = np.zeros(index.n_devices, dtype=np.int64)
        used_milli[where[known]] = milli[known]
        used_mem[where[known]] = mem[known]
    used_milli.flags.writeable = False
    used_mem.flags.writeable = False
    _USAGES.put((used_milli, used_mem), index, usage)
    return used_milli, used_mem


class FreeState:
    """Free milli-GPU and memory per device, mutable, for one placement call.

    ``node_stamp[n]`` changes whenever node ``n``'s free capacity or host CPU/RAM changes (a
    number no other change anywhere took), so per-node caches can tell which nodes to recompute.
    """

    __slots__ = ("free_mem", "free_milli", "host_cpu", "host_mem", "index", "node_stamp", "res_start")

    def __init__(self, index: FleetIndex, snapshot: FleetSnapshot | None = None) -> None:
        self.index = index
        self.free_milli = np.full(index.n_devices, MILLI, dtype=np.int64)
        self.free_mem = index.dev_mem.copy()
        # Start time of a reservation holding the device (inf = not reserved).
        self.res_start = np.full(index.n_devices, np.inf)
        # Host CPU/RAM free per node; nodes that declare none are never short of them.
        host = index.masks.get("host_free0")
        if host is None:
            unlimited = np.iinfo(np.int64).max // 4
            host = (
                np.array([n.cpu_milli or unlimited for n in index.nodes], dtype=np.int64),
                np.array([n.memory_bytes or unlimited for n in index.nodes], dtype=np.int64),
            )
            index.masks["host_free0"] = host
        self.host_cpu = host[0].copy()
        self.host_mem = host[1].copy()
        self.node_stamp = np.zeros(len(index.nodes), dtype=np.int64)
        if snapshot is not None and snapshot.usage:
            base = usage_arrays(index, snapshot)
            self.free_milli -= base[0]
            self.free_mem -= base[1]

    def copy(self) -> FreeState:
        """An independent copy."""
        clone = FreeState.__new__(FreeState)
        clone.index = self.index
        clone.free_milli = self.free_milli.copy()
        clone.free_mem = self.free_mem.copy()
        clone.res_start = self.res_start.copy()
        clone.host_cpu = self.host_cpu.copy()
        clone.host_mem = self.host_mem.copy()
        clone.node_stamp = self.node_stamp.copy()
        return clone

    def touch(self, node: int) -> None:
        """Mark node position ``node`` changed (done by :meth:`apply`; call it after changing
        the arrays directly)."""
        self.node_stamp[node] = next(_STAMPS)

    def apply(
        self,
        shares: Iterable[DeviceShare],
        *,
        release: bool = False,
        cpu_milli: int = 0,
        host_memory_bytes: int = 0,
    ) -> None:
        """Take (or give back, with ``release``) the capacity of ``shares``, and the host CPU/RAM
        on the node of the first share."""
        sign = 1 if release else -1
        pos = self.index.pos
        first = True
        for share in shares:
            i = pos.get(share.uuid)
            if i is not None:
                self.free_milli[i] += sign * share.milli
                self.free_mem[i] += sign * share.memory_bytes
                self.node_stamp[self.index.dev_node[i]] = next(_STAMPS)
                if first and (cpu_milli or host_memory_bytes):
                    n = int(self.index.dev_node[i])
                    self.host_cpu[n] += sign * cpu_milli
                    self.host_mem[n] += sign * host_memory_bytes
                first = False
