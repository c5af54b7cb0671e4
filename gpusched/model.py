"""The fleet vocabulary: devices, nodes, an immutable fleet snapshot and device samples.

Units are integers throughout: bytes for memory, milli-GPU for compute share (1000 = one whole
device), milli-watts for power, milli-degrees Celsius for temperature.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from gpusched.catalog import LinkKind, Vendor

__all__ = [
    "HOST_SOURCE_PREFIX",
    "MILLI",
    "Device",
    "DeviceSample",
    "DeviceShare",
    "DeviceUsage",
    "FleetSnapshot",
    "Health",
    "MigStep",
    "Node",
    "gpu_cards",
]

MILLI = 1000
"""Compute share of one whole device, in milli-GPU."""

HOST_SOURCE_PREFIX = "host:"
"""Inventory source of the nodes a GPU host's agent registered: ``host:<name>`` (what a
:class:`FleetSnapshot`'s nodes came from; the ledger's host records and the hardware's host slice
both name it)."""


class Health(StrEnum):
    """Device health as the hardware backend or the fault chain last judged it."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator as discovered, with its place in the node's topology.

    Attributes:
        uuid: globally unique id (``GPU-…`` for NVIDIA, the AMD/Ascend serial-based id otherwise).
        index: the device index on its node, as ``*_VISIBLE_DEVICES`` counts it.
        node: host name of the node holding the device.
        model: canonical catalog name (see :mod:`gpusched.catalog`).
        numa_node: NUMA node the device's PCIe root hangs off (-1 if unknown).
        pcie_switch: id of the closest PCIe switch / host bridge shared with siblings.
        island: id of the high-speed link island (NVLink/NVSwitch, xGMI, HCCS), or None.
        peers: uuids of devices reachable over a direct high-speed link.
        mig_enabled: NVIDIA MIG mode is on: the GPU itself takes no work; its MIG instances
            (devices whose ``parent`` is this uuid) do.
        parent: for an isolated slice (a MIG instance, or one logical device of an AMD compute
            partition), the physical device it is carved from (a device uuid for MIG, the
            physical card's id for AMD); None for a whole device.
        profile: the slice's profile (``"3g.40gb"``, ``"CPX"``); None for a whole device.
        compute_milli: the share of the physical device's compute this unit holds, in milli
            (1000 for a whole device, 3/7 of it = 428 for a ``3g`` MIG instance).
    """

    uuid: str
    index: int
    node: str
    model: str
    vendor: Vendor
    architecture: str
    memory_bytes: int
    numa_node: int = -1
    pcie_switch: str | None = None
    island: str | None = None
    link: LinkKind = LinkKind.PCIE
    peers: tuple[str, ...] = ()
    health: Health = Health.HEALTHY
    mig_enabled: bool = False
    cordoned: bool = False
    parent: str | None = None
    profile: str | None = None
    compute_milli: int = MILLI

    @property
    def is_slice(self) -> bool:
        """True for a hard-isolated slice (MIG instance, AMD partition): it is handed out whole."""
        return self.parent is not None

    @property
    def takes_work(self) -> bool:
        """False for a MIG-enabled GPU: its work goes to its MIG instances, never to the GPU itself."""
        return not self.mig_enabled


@dataclass(frozen=True, slots=True)
class Node:
    """One host: its rack, labels, CPU/RAM and devices.

    ``standby`` nodes exist in the inventory but take no work until a scaler activates them.
    """

    name: str
    rack: str
    devices: tuple[Device, ...]
    labels: tuple[tuple[str, str], ...] = ()
    cpu_milli: int = 0
    memory_bytes: int = 0
    cordoned: bool = False
    standby: bool = False

    def label(self, key: str) -> str | None:
        """The value of label ``key``, or None."""
        for name, value in self.labels:
            if name == key:
                return value
        return None


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """How much of one device is taken: compute share and memory."""

    used_milli: int = 0
    used_memory_bytes: int = 0


def _copied(usage: Mapping[str, DeviceUsage]) -> dict[str, DeviceUsage]:
    """A new dict of ``usage``; a snapshot's own (a mapping proxy) is copied by its dict's
    ``copy()``, in C, where ``dict(proxy)`` would go key by key (milliseconds at 80,000 GPUs)."""
    if isinstance(usage, (dict, MappingProxyType)):
        return usage.copy()
    return dict(usage)


@dataclass(frozen=True, slots=True)
class DeviceShare:
    """A piece of one device handed to one task: whole (``milli == 1000``) or a fraction."""

    uuid: str
    node: str
    index: int
    milli: int
    memory_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (the API, ``GPUSCHED_ALLOCATION``, the ledger's JSON columns)."""
        return {"uuid": self.uuid, "node": self.node, "index": self.index, "milli": self.milli,
                "memory_bytes": self.memory_bytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceShare:
        """Inverse of :meth:`to_dict`."""
        return cls(str(data["uuid"]), str(data["node"]), int(data["index"]), int(data["milli"]),
                   int(data["memory_bytes"]))


@dataclass(frozen=True, slots=True)
class MigStep:
    """Re-partition GPU ``gpu`` (on ``node``) into MIG instances of the ``layout`` profiles.

    What the dynamic-MIG planner (:mod:`gpusched.capacity.mig_plan`) decides and a provider
    (:mod:`gpusched.hardware.mig_provider`) carries out; an empty layout turns MIG off.
    """

    gpu: str
    node: str
    model: str
    layout: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """One telemetry reading of one device (what ``HardwareBackend.sample`` returns)."""

    uuid: str
    taken_at: float
    utilization_pct: int
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_mc: int
    power_mw: int
    ecc_uncorrected: int = 0
    xid_errors: tuple[int, ...] = ()


_EMPTY_USAGE = DeviceUsage()


@dataclass(frozen=True)
class FleetSnapshot:
    """The fleet at one instant: nodes with topology plus what is taken on each device.

    Immutable: :meth:`with_usage` returns a new snapshot. Indexes are built once per snapshot.

    ``closed``: names of nodes that take no new work in this view although the inventory has
    them in service (a GPU host whose worker slots are all busy this cycle): placement treats
    them exactly as cordoned nodes, the partitions still count their capacity
    (:func:`~gpusched.quota.policy.partition_capacity`). Not part of the inventory, so the
    placement indexes and a warm engine survive a change of it (:meth:`with_closed`).
    """

    nodes: tuple[Node, ...]
    usage: Mapping[str, DeviceUsage] = field(default_factory=dict)
    source: str = "unknown"
    taken_at: float = 0.0
    closed: frozenset[str] = frozenset()
    _devices: Mapping[str, Device] = field(init=False, repr=False, compare=False)
    _nodes: Mapping[str, Node] = field(init=False, repr=False, compare=False)
    _usage_from: tuple[Mapping[str, DeviceUsage], frozenset[str]] | None = field(
        init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_usage_from", None)
        object.__setattr__(self, "usage", MappingProxyType(_copied(self.usage)))
        object.__setattr__(self, "_nodes", MappingProxyType({n.name: n for n in self.nodes}))
        object.__setattr__(
            self, "_devices", MappingProxyType({d.uuid: d for n in self.nodes for d in n.devices})
        )

    def _with_usage_dict(self, usage: dict[str, DeviceUsage]) -> FleetSnapshot:
        # Same nodes: share the indexes instead of rebuilding them (O(changed), not O(fleet)).
        clone = object.__new__(FleetSnapshot)
        object.__setattr__(clone, "nodes", self.nodes)
        object.__setattr__(clone, "usage", MappingProxyType(usage))
        object.__setattr__(clone, "source", self.source)
        object.__setattr__(clone, "taken_at", self.taken_at)
        object.__setattr__(clone, "closed", self.closed)
        object.__setattr__(clone, "_nodes", self._nodes)
        object.__setattr__(clone, "_devices", self._devices)
        object.__setattr__(clone, "_usage_from", None)
        return clone

    @property
    def usage_from(self) -> tuple[Mapping[str, DeviceUsage], frozenset[str]] | None:
        """``(earlier, changed)`` when this snapshot's :attr:`usage` is the ``earlier`` usage
        mapping (another snapshot's, of the same nodes) with only the devices in ``changed``
        different (:meth:`retaken` with ``changed``); None otherwise. Lets a reader that derived
        something per device from ``earlier`` update it on ``changed`` alone."""
        return self._usage_from

    def retaken(
        self, taken_at: float, usage: Mapping[str, DeviceUsage] | None = None,
        changed: Mapping[str, DeviceUsage | None] | None = None,
    ) -> FleetSnapshot:
        """The same nodes taken at ``taken_at``, with ``usage`` (None: this snapshot's) in which
        each device of ``changed`` has its new usage (None: nothing used). Holds what
        ``FleetSnapshot(self.nodes, that usage, self.source, taken_at)`` holds, but the node and
        device indexes are shared, not rebuilt: O(1) with neither argument (the usage mapping is
        shared too), else one copy of the usage plus O(len(changed))."""
        clone = self._with_usage_dict({})
        object.__setattr__(clone, "taken_at", taken_at)
        if usage is None and not changed:
            object.__setattr__(clone, "usage", self.usage)
            return clone
        copied = _copied(self.usage if usage is None else usage)
        for uuid, used in (changed or {}).items():
            if used is None:
                copied.pop(uuid, None)
            else:
                copied[uuid] = used
        object.__setattr__(clone, "usage", MappingProxyType(copied))
        if usage is None:
            object.__setattr__(clone, "_usage_from", (self.usage, frozenset(changed or ())))
        return clone

    def devices(self) -> Iterator[Device]:
        """All devices, node by node."""
        for node in self.nodes:
            yield from node.devices

    def device(self, uuid: str) -> Device:
        """The device with ``uuid`` (KeyError if absent)."""
        return self._devices[uuid]

    def node(self, name: str) -> Node:
        """The node called ``name`` (KeyError if absent)."""
        return self._nodes[name]

    def has_node(self, name: str) -> bool:
        """Whether the fleet holds a node called ``name``."""
        return name in self._nodes

    def has_device(self, uuid: str) -> bool:
        """Whether the fleet holds a device with ``uuid``."""
        return uuid in self._devices

    def used(self, uuid: str) -> DeviceUsage:
        """What is taken on the device (nothing if it has no entry)."""
        return self.usage.get(uuid, _EMPTY_USAGE)

    def free_milli(self, uuid: str) -> int:
        """Compute share still free on the device, in milli-GPU."""
        return MILLI - self.used(uuid).used_milli

    def free_memory(self, uuid: str) -> int:
        """Device memory still free, in bytes."""
        return self._devices[uuid].memory_bytes - self.used(uuid).used_memory_bytes

    def total_devices(self) -> int:
        """Number of devices in the fleet (standby nodes included)."""
        return len(self._devices)

    def with_usage(self, shares: Iterable[DeviceShare], *, release: bool = False) -> FleetSnapshot:
        """A new snapshot with ``shares`` added to (or, with ``release``, removed from) usage."""
        usage = _copied(self.usage)
        sign = -1 if release else 1
        for share in shares:
            old = usage.get(share.uuid, _EMPTY_USAGE)
            usage[share.uuid] = DeviceUsage(
                old.used_milli + sign * share.milli,
                old.used_memory_bytes + sign * share.memory_bytes,
            )
        return self._with_usage_dict(usage)

    def with_nodes(self, nodes: Iterable[Node]) -> FleetSnapshot:
        """A new snapshot with the given nodes replacing those of the same name (or added)."""
        replaced = {n.name: n for n in nodes}
        kept = tuple(replaced.pop(n.name, n) for n in self.nodes)
        return FleetSnapshot(
            kept + tuple(replaced.values()), self.usage, self.source, self.taken_at, self.closed)

    def with_closed(self, names: Iterable[str]) -> FleetSnapshot:
        """The same fleet and usage with :attr:`closed` = ``names`` (the nodes, usage mapping
        and indexes shared: O(len(names)))."""
        clone = self._with_usage_dict({})
        object.__setattr__(clone, "usage", self.usage)
        object.__setattr__(clone, "_usage_from", self._usage_from)
        object.__setattr__(clone, "closed", frozenset(names))
        return clone

    def takes_no_work(self, node: Node) -> bool:
        """Whether ``node`` (of this snapshot) is cordoned or :attr:`closed`."""
        return node.cordoned or node.name in self.closed

    def with_device(self, device: Device) -> FleetSnapshot:
        """A new snapshot with one device replaced (for health or cordon changes)."""
        node = self._nodes[device.node]
        devices = tuple(device if d.uuid == device.uuid else d for d in node.devices)
        return self.with_nodes([replace(node, devices=devices)])


def gpu_cards(devices: Iterable[Device]) -> tuple[int, int]:
    """(physical GPUs, hard-isolated slices) among ``devices``: a GPU cut into MIG instances or
    partitions counts once however it is recorded (a MIG-enabled device beside its instances, or
    only its partitions naming it as their parent); each slice also counts as a slice. Every
    surface that counts "GPUs" (inventory, ``ledger status``, the fleet page) counts this way."""
    listed = list(devices)
    uuids = {d.uuid for d in listed}
    whole = sum(1 for d in listed if d.parent is None)
    slices = [d for d in listed if d.parent is not None]
    return whole + len({d.parent for d in slices if d.parent not in uuids}), len(slices)
