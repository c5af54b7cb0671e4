"""The fleet file: a YAML description of racks, nodes and devices with their topology.

Format (see ``docs/hardware.md`` for the full reference)::

    racks:
      - name: rack-a
        labels: {zone: a}                 # optional, inherited by every node of the rack
        nodes:
          - name: a-h100-1
            cpu: 112                      # cores
            memory: 2TiB
            numa_nodes: 2                 # default 1
            labels: {pool: training}
            standby: false                # true: in the inventory, idle until scaled out
            devices:                      # one group, or a list of groups
              model: H100-SXM-80GB        # catalog name or alias
              count: 8
              numa: [0, 0, 0, 0, 1, 1, 1, 1]        # default: spread evenly over numa_nodes
              pcie_switches: [[0, 1], [2, 3], [4, 5], [6, 7]]   # default: pairs
              islands: [[0, 1, 2, 3, 4, 5, 6, 7]]   # default: one island if the model has
                                                    # NVLink/NVSwitch/xGMI/HCCS, none for PCIe
              memory: 80GiB               # optional override of the catalog figure
              mig: [3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb]   # NVIDIA: MIG instances on each device
              compute_partition: CPX      # AMD: SPX/DPX/QPX/CPX (CPX: 8 logical devices each)
              memory_partition: NPS4      # AMD: NPS1/NPS4 (with compute_partition)

Indices inside a group count from 0 within that group; devices are numbered across groups in
file order. Bounds: at most 128 devices per node, 64 NUMA nodes, 1,000,000 cores, names of 1–253
ASCII characters, labels of 63; the YAML must be UTF-8 and repeat no key (see
``docs/reliability.md``). UUIDs are deterministic: ``GPU-sim-<node>-<i>`` (NVIDIA), ``AMD-sim-<node>-<i>``,
``NPU-sim-<node>-<i>`` (Ascend); MIG instances ``MIG-GPU-sim-<node>-<i>-<k>``; an AMD card in a
compute partition mode is ``AMD-sim-<node>-card<i>`` (``i``: its first logical device) and its
logical devices (the devices the scheduler hands out, numbered on in file order)
``AMD-sim-<node>-<i>``. Every problem raises :class:`~gpusched.errors.FleetFileError`
naming the file, the node, the field and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpusched.catalog import AcceleratorModel, Catalog, LinkKind, Vendor, default_catalog
from gpusched.errors import FleetFileError, GPURequestError
from gpusched.fields import MAX_DEVICES_PER_NODE, MAX_TEXT, FieldProblem, safe_repr, strict_yaml
from gpusched.model import Device, Node
from gpusched.request import parse_size
from gpusched.slices import (
    amd_partitions,
    layout_problem,
    mig_slices,
    partition_count,
    profile_names,
)

__all__ = ["UUID_PREFIX", "load_fleet", "parse_fleet"]

UUID_PREFIX: Mapping[Vendor, str] = {Vendor.NVIDIA: "GPU", Vendor.AMD: "AMD", Vendor.ASCEND: "NPU"}
"""UUID prefix of simulated devices per vendor (NVIDIA's real UUIDs also start with ``GPU-``)."""

_TOP_KEYS = frozenset({"name", "description", "racks"})
_RACK_KEYS = frozenset({"name", "labels", "nodes"})
_NODE_KEYS = frozenset({"name", "cpu", "memory", "numa_nodes", "labels", "standby", "devices"})
_GROUP_KEYS = frozenset({
    "model", "count", "numa", "pcie_switches", "islands", "memory", "mig", "compute_partition",
    "memory_partition",
})


class _Where:
    """Where in the file we are, so every error can say it."""

    def __init__(self, path: str, node: str | None = None) -> None:
        self.path = path
        self.node = node

    def error(self, field: str, problem: str, fix: str) -> FleetFileError:
        at = f" node {self.node!r}," if self.node else ""
        return FleetFileError(f"fleet file {self.path}:{at} field {field!r}: {problem}; fix: {fix}")


def load_fleet(path: str | Path, *, catalog: Catalog | None = None) -> list[Node]:
    """Read and validate the fleet file at ``path`` into nodes (standby nodes included).

    Raises:
        FleetFileError: the file is missing, not YAML, or describes an impossible fleet.
    """
    where = _Where(str(path))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise where.error("<file>", f"is not UTF-8 text (byte {exc.start})",
                          "save the fleet file as UTF-8") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise where.error("<file>", f"cannot be read ({getattr(exc, 'strerror', None) or exc})",
                          "pass an existing fleet file, e.g. gpusched/include/fleets/default.yaml") from None
    try:
        data = strict_yaml(text)
    except FieldProblem as exc:
        raise where.error("<file>", exc.problem, "correct the YAML (each key once per mapping)") from None
    return parse_fleet(data, source=str(path), catalog=catalog)


def parse_fleet(data: object, *, source: str = "<fleet>", catalog: Catalog | None = None) -> list[Node]:
    """Validate an already-loaded fleet mapping (the YAML document) into nodes."""
    cat = catalog or default_catalog()
    where = _Where(source)
    if not isinstance(data, Mapping):
        raise where.error("<file>", "the document is not a mapping", "start the file with 'racks:'")
    _check_keys(data, _TOP_KEYS, "", where)
    racks = data.get("racks")
    if not isinstance(racks, list) or not racks:
        raise where.error("racks", "missing or not a non-empty list", "add 'racks:' with at least one rack")
    nodes: list[Node] = []
    seen_racks: set[str] = set()
    seen_nodes: set[str] = set()
    for position, rack in enumerate(racks):
        if not isinstance(rack, Mapping):
            raise where.error(f"racks[{position}]", "is not a mapping", "give each rack 'name:' and 'nodes:'")
        _check_keys(rack, _RACK_KEYS, f"racks[{position}]", where)
        rack_name = _name(rack.get("name"), f"racks[{position}].name", where)
        if rack_name in seen_racks:
            raise where.error(f"racks[{position}].name", f"rack {rack_name!r} appears twice",
                              "give every rack a unique name")
        seen_racks.add(rack_name)
        rack_labels = _labels(rack.get("labels"), f"rack {rack_name!r} labels", where)
        rack_nodes = rack.get("nodes")
        if not isinstance(rack_nodes, list) or not rack_nodes:
            raise where.error(f"rack {rack_name!r} nodes", "missing or empty",
                              "list the rack's nodes under 'nodes:'")
        for node_position, entry in enumerate(rack_nodes):
            node = _parse_node(entry, rack_name, rack_labels, f"{rack_name}.nodes[{node_position}]",
                               source, cat)
            if node.name in seen_nodes:
                raise _Where(source, node.name).error(
                    "name", "the node name appears twice", "give every node a unique host name")
            seen_nodes.add(node.name)
            nodes.append(node)
    return nodes


def _parse_node(entry: object, rack: str, rack_labels: dict[str, str], position: str, source: str,
                cat: Catalog) -> Node:
    where = _Where(source)
    if not isinstance(entry, Mapping):
        raise where.error(position, "is not a mapping", "give each node 'name:' and 'devices:'")
    name = _name(entry.get("name"), f"{position}.name", where)
    where = _Where(source, name)
    _check_keys(entry, _NODE_KEYS, "", where)
    numa_nodes = _int(entry.get("numa_nodes", 1), "numa_nodes", where, minimum=1, maximum=64)
    cpu = _int(entry.get("cpu", 0), "cpu", where, minimum=0, maximum=1_000_000)
    memory = _size(entry.get("memory"), "memory", where) if entry.get("memory") is not None else 0
    standby = entry.get("standby", False)
    if not isinstance(standby, bool):
        raise where.error("standby", f"{safe_repr(standby)} is not true or false",
                          "write 'standby: true' or omit it")
    labels = dict(rack_labels)
    labels.update(_labels(entry.get("labels"), "labels", where))
    groups = entry.get("devices")
    if isinstance(groups, Mapping):
        groups = [groups]
    if not isinstance(groups, list) or not groups:
        raise where.error("devices", "missing or empty", "add 'devices: {model: H100-SXM-80GB, count: 8}'")
    devices: list[Device] = []
    switch_offset = 0
    island_offset = 0
    for group_number, group in enumerate(groups):
        next_index = 1 + max((d.index for d in devices), default=-1)
        built, switches, islands = _parse_group(
            group, f"devices[{group_number}]", name, numa_nodes, next_index,
            switch_offset, island_offset, where, cat,
        )
        devices.extend(built)
        switch_offset += switches
        island_offset += islands
    return Node(
        name=name, rack=rack, devices=tuple(devices), labels=tuple(sorted(labels.items())),
        cpu_milli=cpu * 1000, memory_bytes=memory, standby=standby,
    )


def _parse_group(group: object, field: str, node: str, numa_nodes: int, first_index: int,
                 switch_offset: int, island_offset: int, where: _Where,
                 cat: Catalog) -> tuple[list[Device], int, int]:
    if not isinstance(group, Mapping):
        raise where.error(field, "is not a mapping", "write '{model: <catalog name>, count: <n>}'")
    _check_keys(group, _GROUP_KEYS, field, where)
    model_name = group.get("model")
    if not isinstance(model_name, str) or cat.find(model_name) is None:
        close = difflib.get_close_matches(safe_repr(model_name).strip("'"), list(cat.names), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise where.error(f"{field}.model", f"unknown accelerator model {safe_repr(model_name)}",
                          f"{hint}use a catalog name: {', '.join(cat.names)}")
    model = cat.get(model_name)
    count = _int(group.get("count", 1), f"{field}.count", where, minimum=1,
                 maximum=MAX_DEVICES_PER_NODE - first_index)
    memory = (_size(group["memory"], f"{field}.memory", where)
              if group.get("memory") is not None else model.memory_bytes)
    numa = _numa(group.get("numa"), count, numa_nodes, f"{field}.numa", where)
    switches = _index_groups(group.get("pcie_switches"), count, f"{field}.pcie_switches", where)
    if switches is None:
        switches = [list(range(i, min(i + 2, count))) for i in range(0, count, 2)]
    switch_of = _membership(switches, count, f"{field}.pcie_switches", where, complete=True)
    islands = _index_groups(group.get("islands"), count, f"{field}.islands", where)
    if islands is None:
        islands = [list(range(count))] if model.link.is_high_speed and count > 1 else []
    elif islands and not model.link.is_high_speed:
        raise where.error(f"{field}.islands", f"{model.name} has no peer links (PCIe only)",
                          "remove 'islands' for this model")
    for island in islands:
        if len(island) < 2:
            raise where.error(f"{field}.islands", f"island {island} has fewer than two devices",
                              "list at least two device indices per island, or drop it")
    island_of = _membership(islands, count, f"{field}.islands", where, complete=False)
    prefix = UUID_PREFIX[model.vendor]
    uuids = [f"{prefix}-sim-{node}-{first_index + i}" for i in range(count)]
    devices = []
    for i in range(count):
        island_number = island_of.get(i)
        peers: tuple[str, ...] = ()
        island_id = None
        link = LinkKind.PCIE
        if island_number is not None:
            island_id = f"{node}/{model.link.value}{island_offset + island_number}"
            peers = tuple(uuids[j] for j in islands[island_number] if j != i)
            link = model.link
        devices.append(_device(model, uuids[i], first_index + i, node, memory, numa[i],
                               f"{node}/pcie{switch_offset + switch_of[i]}", island_id, link, peers))
    return _sliced(group, field, devices, model, memory, where), len(switches), len(islands)


def _sliced(group: Mapping[str, Any], field: str, devices: list[Device], model: AcceleratorModel,
            memory: int, where: _Where) -> list[Device]:
    """The group's devices with MIG instances added (``mig``) or cut into AMD partitions."""
    mig = group.get("mig")
    compute = group.get("compute_partition")
    nps = group.get("memory_partition")
    if mig is None and compute is None and nps is None:
        return devices
    if mig is not None:
        if compute is not None or nps is not None:
            raise where.error(f"{field}.mig", "MIG and AMD partitions in one group",
                              "use 'mig' for NVIDIA models, 'compute_partition' for AMD ones")
        if "mig" not in model.partitioning:
            raise where.error(f"{field}.mig", f"{model.name} has no MIG",
                              "remove 'mig' or use a MIG-capable model (A100, H100, H200)")
        if not isinstance(mig, list) or not mig or not all(isinstance(p, str) for p in mig):
            raise where.error(f"{field}.mig", f"{safe_repr(mig)} is not a list of MIG profiles",
                              f"write e.g. [3g.40gb, 3g.40gb] from: {profile_names(model)}")
        problem = layout_problem(model, mig, memory)
        if problem:
            raise where.error(f"{field}.mig", problem, f"choose profiles from: {profile_names(model)}")
        out: list[Device] = []
        for device in devices:
            parent = replace(device, mig_enabled=True)
            out.append(parent)
            out.extend(mig_slices(parent, model, mig))
        return out
    if "compute-partition" not in model.partitioning:
        raise where.error(f"{field}.compute_partition", f"{model.name} has no compute partitions",
                          "remove 'compute_partition'/'memory_partition' or use an MI300X")
    if not isinstance(compute, str) or model.slice_profile(compute) is None:
        raise where.error(f"{field}.compute_partition", f"{safe_repr(compute)} is not a partition mode",
                          f"use one of: {profile_names(model)}")
    if nps is not None and (not isinstance(nps, str) or nps.upper() not in model.memory_partitions):
        raise where.error(f"{field}.memory_partition", f"{safe_repr(nps)} is not a memory partition mode",
                          f"use one of: {', '.join(model.memory_partitions)}")
    profile = model.slice_profile(compute)
    assert profile is not None
    per_card = partition_count(profile)
    first = devices[0].index
    if first + len(devices) * per_card > MAX_DEVICES_PER_NODE:
        raise where.error(f"{field}.compute_partition", f"{len(devices)} × {per_card} logical devices "
                          f"exceed {MAX_DEVICES_PER_NODE} per node", "use fewer cards or a coarser mode")
    prefix = UUID_PREFIX[model.vendor]
    out = []
    for c, card in enumerate(devices):
        start = first + c * per_card
        uuids = [f"{prefix}-sim-{card.node}-{start + k}" for k in range(per_card)]
        card_id = f"{prefix}-sim-{card.node}-card{start}"
        out.extend(amd_partitions(card, profile, start, card_id, uuids))
    return out


def _device(model: AcceleratorModel, uuid: str, index: int, node: str, memory: int, numa: int,
            switch: str, island: str | None, link: LinkKind, peers: tuple[str, ...]) -> Device:
    return Device(
        uuid=uuid, index=index, node=node, model=model.name, vendor=model.vendor,
        architecture=model.architecture, memory_bytes=memory, numa_node=numa, pcie_switch=switch,
        island=island, link=link, peers=peers,
    )


def _check_keys(mapping: Mapping[Any, Any], allowed: frozenset[str], field: str, where: _Where) -> None:
    for key in mapping:
        if key not in allowed:
            shown = key if isinstance(key, str) and len(key) <= 60 else safe_repr(key)
            close = difflib.get_close_matches(shown, sorted(allowed), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise where.error(f"{field}.{shown}" if field else shown, "unknown key",
                              f"{hint}allowed keys: {', '.join(sorted(allowed))}")


def _name(value: object, field: str, where: _Where) -> str:
    if (isinstance(value, str) and value.strip() and len(value) <= 253
            and all(c.isascii() and (c.isalnum() or c in "-_.") for c in value)):
        return value
    raise where.error(field, f"{safe_repr(value)} is not a valid name",
                      "use 1–253 ASCII letters, digits, '-', '_' or '.' (a host name)")


def _int(value: object, field: str, where: _Where, *, minimum: int, maximum: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum:
        return value
    extra = f" (at most {MAX_DEVICES_PER_NODE} devices per node)" if field.endswith(".count") else ""
    raise where.error(field, f"{safe_repr(value)} is not a whole number from {minimum} to {maximum}{extra}",
                      f"write a number from {minimum} to {maximum}")


def _size(value: object, field: str, where: _Where) -> int:
    try:
        return parse_size(value, field)
    except GPURequestError:
        raise where.error(field, f"{safe_repr(value)} is not a size",
                          "write bytes or a size like '80GiB' (at most 1 PiB)") from None


def _labels(value: object, field: str, where: _Where) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and 0 < len(k) <= MAX_TEXT and isinstance(v, str | int) and not isinstance(v, bool)
        and (len(v) <= MAX_TEXT if isinstance(v, str) else abs(v) < 10**MAX_TEXT)
        for k, v in value.items()
    ):
        raise where.error(field, f"{safe_repr(value)} is not a mapping of names to values",
                          f"write labels as {{key: value}}, each at most {MAX_TEXT} characters")
    return {str(k): str(v) for k, v in value.items()}


def _numa(value: object, count: int, numa_nodes: int, field: str, where: _Where) -> list[int]:
    if value is None:
        return [i * numa_nodes // count for i in range(count)]
    if (not isinstance(value, list) or len(value) != count
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise where.error(field, f"{safe_repr(value)} is not a list of {count} NUMA node numbers",
                          f"give one NUMA node per device ({count} entries) or omit it")
    for v in value:
        if not 0 <= v < numa_nodes:
            raise where.error(field, f"NUMA node {v} does not exist (numa_nodes: {numa_nodes})",
                              f"use 0..{numa_nodes - 1} or raise numa_nodes")
    return list(value)


def _index_groups(value: object, count: int, field: str, where: _Where) -> list[list[int]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(g, list) for g in value):
        raise where.error(field, f"{safe_repr(value)} is not a list of index lists",
                          "write e.g. [[0, 1], [2, 3]]")
    for group in value:
        for index in group:
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
                raise where.error(field, f"device index {safe_repr(index)} is out of range",
                                  f"use indices 0..{count - 1} (they count within this device group)")
    return [list(g) for g in value]


def _membership(groups: Sequence[Sequence[int]], count: int, field: str, where: _Where, *,
                complete: bool) -> dict[int, int]:
    result: dict[int, int] = {}
    for number, group in enumerate(groups):
        for index in group:
            if index in result:
                raise where.error(field, f"device {index} is listed in two groups",
                                  "put each device in exactly one group")
            result[index] = number
    if complete and len(result) != count:
        missing = sorted(set(range(count)) - set(result))
        raise where.error(field, f"devices {missing} are in no group", "list every device index once")
    return result
