"""Fleet snapshots for simulation: from the openb node list, Gavel's cluster, uniform clusters.

Every builder returns an empty :class:`~gpusched.model.FleetSnapshot` (no usage) whose devices
carry catalog models, so the placement engine sees the same vocabulary as on a live fleet.
Device uuids are ``<node>/gpu<i>``; island = the node for NVLink models (all GPUs of one node
form one island), PCIe otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpusched.catalog import default_catalog
from gpusched.errors import ConfigurationError
from gpusched.fields import MAX_DEVICES_PER_NODE
from gpusched.fleetfile import load_fleet
from gpusched.model import FleetSnapshot
from gpusched.node_builder import SIM_LAYOUT, make_node
from gpusched.sim.traces import GAVEL_MODELS, OpenbNode, load_openb_nodes

__all__ = [
    "GAVEL_GPUS_PER_SERVER",
    "MAX_UNIFORM_NODES",
    "PHILLY_DEFAULT_NODES",
    "fleet_from_spec",
    "gavel_fleet",
    "openb_fleet",
    "uniform_fleet",
]

MIB = 1024**2
GAVEL_GPUS_PER_SERVER = 4
"""Gavel's cluster: 36 V100 + 36 P100 + 36 K80, built as 9 servers of 4 GPUs per type."""
PHILLY_DEFAULT_NODES = 50
MAX_UNIFORM_NODES = 100_000
"""Philly cluster size in 8-GPU nodes (400 GPUs; see docs/benchmarks.md for why)."""


def openb_fleet(nodes: Sequence[OpenbNode], *, include_cpu_only: bool = False) -> FleetSnapshot:
    """The openb cluster: one :class:`Node` per listed node, CPU and memory from the trace.

    Trace model names (``V100M16``, ``G2``…) resolve through catalog aliases. CPU-only nodes are
    skipped unless ``include_cpu_only`` (the FGD experiment uses the GPU nodes only).
    """
    cat = default_catalog()
    built = []
    for i, n in enumerate(nodes):
        if n.gpus == 0 and not include_cpu_only:
            continue
        model = n.model or "T4"
        if n.gpus and cat.find(model) is None:
            raise ConfigurationError(
                f"openb node {n.name} has GPU model {model!r} unknown to the catalog; "
                "add it (or an alias) to gpusched/include/catalog/accelerators.json"
            )
        built.append(
            make_node(
                n.name,
                model,
                n.gpus,
                cpu_milli=n.cpu_milli,
                memory_bytes=n.memory_mib * MIB,
                layout=SIM_LAYOUT,
                rack=f"rack{i // 32}",
                catalog=cat,
            )
        )
    return FleetSnapshot(tuple(built), source="openb")


def gavel_fleet(per_type: int = 36, gpus_per_server: int = GAVEL_GPUS_PER_SERVER) -> FleetSnapshot:
    """Gavel's heterogeneous cluster: ``per_type`` V100, P100 and K80 each, in servers of ``gpus_per_server``.

    Nodes are listed V100 first, then P100, then K80 (so a first-fit policy fills the fastest
    GPUs first, like a FIFO scheduler walking its server list).
    """
    if per_type % gpus_per_server:
        raise ConfigurationError(
            f"per_type={per_type} is not a multiple of gpus_per_server={gpus_per_server}; pick divisors"
        )
    nodes = []
    for short, model in GAVEL_MODELS.items():
        for s in range(per_type // gpus_per_server):
            nodes.append(
                make_node(
                    f"{short}-{s:02d}",
                    model,
                    gpus_per_server,
                    layout=SIM_LAYOUT,
                    rack=f"rack-{short}",
                    cpu_milli=0,
                    memory_bytes=0,
                )
            )
    return FleetSnapshot(tuple(nodes), source="gavel")


def uniform_fleet(n_nodes: int, gpus_per_node: int = 8, model: str = "V100-SXM2-16GB") -> FleetSnapshot:
    """``n_nodes`` identical nodes of ``gpus_per_node`` ``model`` devices, 32 nodes per rack.

    Bounds: 1–100,000 nodes of 1–128 GPUs (:data:`~gpusched.fields.MAX_DEVICES_PER_NODE`).
    """
    if not 1 <= n_nodes <= MAX_UNIFORM_NODES or not 1 <= gpus_per_node <= MAX_DEVICES_PER_NODE:
        raise ConfigurationError(
            f"a uniform fleet of {n_nodes} nodes × {gpus_per_node} GPUs is out of range; use 1–"
            f"{MAX_UNIFORM_NODES} nodes of 1–{MAX_DEVICES_PER_NODE} GPUs"
        )
    nodes = tuple(
        make_node(
            f"node-{i:05d}",
            model,
            gpus_per_node,
            layout=SIM_LAYOUT,
            rack=f"rack{i // 32}",
            cpu_milli=0,
            memory_bytes=0,
        )
        for i in range(n_nodes)
    )
    return FleetSnapshot(nodes, source=f"uniform-{n_nodes}x{gpus_per_node}")


def fleet_from_spec(spec: str) -> FleetSnapshot:
    """A fleet from a command-line spec.

    Accepted: ``gavel`` (36+36+36, 4 GPUs/server), ``gavel:GPUS_PER_SERVER``,
    ``uniform:NODESxGPUS[:MODEL]`` (e.g. ``uniform:50x8:V100``), a path to an openb node CSV, or
    a fleet YAML file (read by :func:`gpusched.fleetfile.load_fleet`).
    """
    if spec == "gavel":
        return gavel_fleet()
    if spec.startswith("gavel:"):
        per_server = spec.split(":", 1)[1]
        if not per_server.isdigit() or not 1 <= int(per_server) <= 36 or 36 % int(per_server):
            raise ConfigurationError(
                f"bad fleet spec {spec!r}; write gavel:GPUS_PER_SERVER with a divisor of 36, e.g. gavel:4"
            )
        return gavel_fleet(gpus_per_server=int(per_server))
    if spec.startswith("uniform:"):
        parts = spec.split(":")
        sizes = parts[1].lower().split("x")
        if len(parts) > 3 or len(sizes) != 2 or not all(s.isdigit() and len(s) < 8 for s in sizes):
            raise ConfigurationError(
                f"bad fleet spec {spec!r}; write uniform:NODESxGPUS[:MODEL], e.g. uniform:50x8:V100"
            )
        return uniform_fleet(int(sizes[0]), int(sizes[1]), *(parts[2:3] or []))
    path = Path(spec)
    if not path.is_file():
        raise ConfigurationError(
            f"fleet {spec!r} is neither a file nor a spec; use gavel, uniform:NxG[:MODEL], "
            "an openb node CSV or a fleet YAML"
        )
    if path.suffix == ".csv":
        return openb_fleet(load_openb_nodes(path))
    return FleetSnapshot(tuple(load_fleet(path)), source=str(path))
