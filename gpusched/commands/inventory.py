"""``gpusched inventory``: the devices this host (or the simulated fleet) has, with their topology.

    gpusched inventory [--fleet FILE] [--backend auto|nvidia|amd|ascend|simulated] [--json]

The human view lists racks → nodes → devices with NUMA node, PCIe switch and link island, and its
first line says where the inventory comes from ("simulated fleet (include/fleets/default.yaml)"
when no real device is used). ``--json`` prints one object::

    {"source": str, "simulated": bool, "backend": str, "features": [str],
     "nodes": [{"name", "rack", "labels", "standby", "cpu_milli", "memory_bytes",
                "devices": [{"uuid", "index", "model", "vendor", "architecture", "memory_bytes",
                             "numa", "pcie_switch", "island", "link", "links", "health",
                             "mig_enabled", "parent", "profile", "compute_milli"}]}]}

where ``links`` lists the uuids of the device's high-speed link peers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from gpusched.hardware.detect import detect_backend
from gpusched.model import Node, gpu_cards

__all__ = ["inventory_dict", "register", "render_text"]

GIB = 2**30


def register(subparsers: Any) -> None:
    """Add the ``inventory`` command to the ``gpusched`` parser."""
    parser = subparsers.add_parser(
        "inventory", help="list accelerators with their topology (real or simulated)",
        description="List the accelerators of this host, or of the simulated fleet, with topology.",
    )
    parser.add_argument("--fleet", help="fleet YAML for the simulated backend (implies --backend simulated "
                        "unless --backend says otherwise); default $GPUSCHED_FLEET or "
                        "gpusched/include/fleets/default.yaml")
    parser.add_argument("--backend", choices=("auto", "nvidia", "amd", "ascend", "simulated"), default=None,
                        help="which backend to use (default $GPUSCHED_BACKEND or auto)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Discover and print; returns the exit code."""

    kind = args.backend or ("simulated" if args.fleet else None)
    backend = detect_backend(kind, fleet=args.fleet)
    try:
        nodes = backend.discover()
    finally:
        backend.close()
    source = str(getattr(backend, "description", backend.name))
    simulated = backend.name == "simulated"
    if args.json:
        data = inventory_dict(nodes, source=source, simulated=simulated, backend=backend.name,
                              features=sorted(backend.features))
        print(json.dumps(data, indent=2))
    else:
        print(render_text(nodes, source=source, simulated=simulated))
    return 0


def inventory_dict(nodes: Sequence[Node], *, source: str, simulated: bool, backend: str,
                   features: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON form of an inventory (see the module docstring)."""
    return {
        "source": source,
        "simulated": simulated,
        "backend": backend,
        "features": list(features),
        "nodes": [
            {
                "name": node.name,
                "rack": node.rack,
                "labels": dict(node.labels),
                "standby": node.standby,
                "cpu_milli": node.cpu_milli,
                "memory_bytes": node.memory_bytes,
                "devices": [
                    {
                        "uuid": d.uuid,
                        "index": d.index,
                        "model": d.model,
                        "vendor": str(d.vendor),
                        "architecture": d.architecture,
                        "memory_bytes": d.memory_bytes,
                        "numa": d.numa_node,
                        "pcie_switch": d.pcie_switch,
                        "island": d.island,
                        "link": str(d.link),
                        "links": list(d.peers),
                        "health": str(d.health),
                        "mig_enabled": d.mig_enabled,
                        "parent": d.parent,
                        "profile": d.profile,
                        "compute_milli": d.compute_milli,
                    }
                    for d in node.devices
                ],
            }
            for node in nodes
        ],
    }


def render_text(nodes: Sequence[Node], *, source: str, simulated: bool) -> str:
    """The human view: a header naming the source, then racks → nodes → devices."""
    lines = [f"source: {source}" + ("  [SIMULATED — not real hardware]" if simulated else "")]
    gpus, slices = gpu_cards(d for n in nodes for d in n.devices)
    models = sorted({d.model for n in nodes for d in n.devices})
    cut = (f" ({slices} MIG instance(s) / partition(s) of them listed below, each scheduled on its own)"
           if slices else "")
    lines.append(f"{len(nodes)} node(s), {gpus} GPU(s){cut}, models: {', '.join(models) or '-'}")
    racks: dict[str, list[Node]] = {}
    for node in nodes:
        racks.setdefault(node.rack, []).append(node)
    for rack, rack_nodes in racks.items():
        lines.append("")
        lines.append(f"rack {rack}")
        for node in rack_nodes:
            labels = ",".join(f"{k}={v}" for k, v in node.labels) or "-"
            state = "  (standby)" if node.standby else ""
            lines.append(
                f"  node {node.name}{state}  cpu={node.cpu_milli // 1000}  "
                f"ram={node.memory_bytes / GIB:.0f}GiB  labels={labels}"
            )
            for d in node.devices:
                island = f"{d.island} ({d.link}, {len(d.peers)} peers)" if d.island else "-"
                health = "" if str(d.health) == "healthy" else f"  [{d.health}]"
                mig = "  MIG" if d.mig_enabled else f"  slice {d.profile} of {d.parent}" if d.parent else ""
                lines.append(
                    f"    [{d.index}] {d.model:<16} {d.vendor!s:<6} {d.architecture:<10} "
                    f"{d.memory_bytes / GIB:>5.0f}GiB  numa={d.numa_node}  switch={d.pcie_switch or '-'}  "
                    f"island={island}  {d.uuid}{mig}{health}"
                )
    return "\n".join(lines)
