"""Build one :class:`~gpusched.model.Node` of catalog devices: the one ``make_node``.

Two naming/topology conventions are in use and kept apart by :class:`NodeLayout`, so fleets
built before the merge stay byte-identical:

* :data:`PLACEMENT_LAYOUT` (synthetic latency fleets, placement tests): uuids ``<node>-gpu<i>``,
  PCIe switches ``sw<i // 2>``, high-speed islands of ``island_size`` consecutive devices
  (default 8 for NVSwitch/xGMI, 4 for NVLink/HCCS, none for PCIe), NUMA split at ``gpus / 2``.
* :data:`SIM_LAYOUT` (simulator fleets: openb, Gavel, uniform): uuids ``<node>/gpu<i>``, switches
  ``<node>/sw<i // 2>``, one island = the whole node for high-speed models (with peer lists),
  PCIe link otherwise, NUMA split at ``max(1, gpus // 2)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpusched.catalog import Catalog, LinkKind, default_catalog
from gpusched.model import Device, Node

__all__ = ["PLACEMENT_LAYOUT", "SIM_LAYOUT", "NodeLayout", "make_node"]

GIB = 1024**3

_ISLAND_BY_LINK = {"nvswitch": 8, "xgmi": 8, "nvlink": 4, "hccs": 4}


@dataclass(frozen=True)
class NodeLayout:
    """How :func:`make_node` names devices and lays out their topology.

    ``uuid_separator`` joins node name and ``gpu<i>``; ``qualified_switches`` prefixes PCIe
    switch names with the node; ``whole_node_island`` makes every device of a high-speed model
    one island named after the node (with peers), instead of islands of ``island_size``;
    ``numa_floor_half`` splits NUMA nodes at ``max(1, gpus // 2)`` instead of ``gpus / 2``.
    """

    uuid_separator: str
    qualified_switches: bool
    whole_node_island: bool
    numa_floor_half: bool


PLACEMENT_LAYOUT = NodeLayout("-", qualified_switches=False, whole_node_island=False, numa_floor_half=False)
SIM_LAYOUT = NodeLayout("/", qualified_switches=True, whole_node_island=True, numa_floor_half=True)


def make_node(
    name: str,
    model: str,
    gpus: int = 8,
    *,
    layout: NodeLayout = PLACEMENT_LAYOUT,
    rack: str = "rack-0",
    island_size: int | None = None,
    labels: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    cpu_milli: int = 96_000,
    memory_bytes: int = 1024 * GIB,
    catalog: Catalog | None = None,
) -> Node:
    """One node ``name`` of ``gpus`` devices of catalog ``model`` (alias accepted), laid out per ``layout``.

    ``island_size`` applies to layouts without ``whole_node_island`` (None = by link kind, 0 = no
    islands). ``labels`` are sorted when given as a mapping and kept in order otherwise.
    """
    spec = (catalog or default_catalog()).get(model)
    label_pairs = tuple(sorted(labels.items())) if isinstance(labels, Mapping) else tuple(labels)
    uuids = [f"{name}{layout.uuid_separator}gpu{i}" for i in range(gpus)]
    numa_split = max(1, gpus // 2) if layout.numa_floor_half else gpus / 2
    devices = []
    for i in range(gpus):
        if layout.whole_node_island:
            island = name if spec.link.is_high_speed else None
            link = spec.link if island else LinkKind.PCIE
            peers = tuple(u for u in uuids if u != uuids[i]) if island else ()
        else:
            size = _ISLAND_BY_LINK.get(spec.link.value, 0) if island_size is None else island_size
            island = f"isl{i // size}" if size else None
            link, peers = spec.link, ()
        devices.append(
            Device(
                uuid=uuids[i],
                index=i,
                node=name,
                model=spec.name,
                vendor=spec.vendor,
                architecture=spec.architecture,
                memory_bytes=spec.memory_bytes,
                numa_node=0 if i < numa_split else 1,
                pcie_switch=f"{name}/sw{i // 2}" if layout.qualified_switches else f"sw{i // 2}",
                island=island,
                link=link,
                peers=peers,
            )
        )
    return Node(
        name=name,
        rack=rack,
        devices=tuple(devices),
        labels=label_pairs,
        cpu_milli=cpu_milli,
        memory_bytes=memory_bytes,
    )
