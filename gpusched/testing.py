"""Helpers for tests and DAG authors: seeded synthetic fleets, request streams and nodes (no I/O).

Part of the installed package (no lab extra needed), so a DAG's own tests can build the fleets
gpusched's tests and latency benchmarks use::

    from gpusched.testing import make_node, synthetic_fleet, synthetic_requests

* :func:`synthetic_fleet` — ``synthetic_fleet(1000)`` gives 1,000 nodes × 8 devices of mixed models
  with realistic topology (NVSwitch/xGMI islands of 8, NVLink/HCCS islands of 4, PCIe switches and
  two NUMA nodes per host), 16 nodes per rack, and about 40 % of the devices partly or wholly in
  use. The same ``seed`` gives the same fleet.
* :func:`synthetic_requests` — ``n`` pending tasks of mixed shapes for the placement engine.
* :func:`make_node` — one node of catalog devices with a conventional topology
  (:mod:`gpusched.node_builder`, re-exported here).

Whether a DAG's GPU tasks fit a fleet is :func:`gpusched.airflow.fit_check.assert_gpu_tasks_fit`:
it parses DAG files with Airflow, so it lives with the Airflow faces (this module imports no
Airflow).
"""

from __future__ import annotations

import random

from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement.types import PendingTask
from gpusched.request import GPURequest, Interconnect, Partition

__all__ = ["make_node", "synthetic_fleet", "synthetic_requests"]

# (model, weight, devices per high-speed island; 0 = PCIe only)
_MODELS = (
    ("H100-SXM-80GB", 3, 8),
    ("A100-SXM-80GB", 4, 4),
    ("A100-PCIE-40GB", 2, 0),
    ("L40S", 2, 0),
    ("T4", 2, 0),
    ("MI300X", 1, 8),
    ("Ascend-910B", 1, 4),
)


def synthetic_fleet(
    nodes: int, gpus_per_node: int = 8, seed: int = 0, *, used_fraction: float = 0.4
) -> FleetSnapshot:
    """A mixed fleet of ``nodes`` hosts with ``gpus_per_node`` devices each, partly in use."""
    rng = random.Random(seed)
    weights = [w for _, w, _ in _MODELS]
    built = []
    for n in range(nodes):
        name, _, island = rng.choices(_MODELS, weights)[0]
        rack = f"rack-{n // 16:04d}"
        built.append(
            make_node(
                f"node-{n:05d}",
                name,
                gpus_per_node,
                rack=rack,
                island_size=min(island, gpus_per_node),
                labels={"zone": "a" if (n // 16) % 2 == 0 else "b"},
            )
        )
    snapshot = FleetSnapshot(tuple(built), source="synthetic")
    shares = []
    for node in built:
        for dev in node.devices:
            if rng.random() >= used_fraction:
                continue
            if rng.random() < 0.6:
                shares.append(DeviceShare(dev.uuid, dev.node, dev.index, MILLI, dev.memory_bytes))
            else:
                milli = rng.choice((250, 500, 750))
                shares.append(
                    DeviceShare(dev.uuid, dev.node, dev.index, milli, dev.memory_bytes * milli // MILLI)
                )
    return snapshot.with_usage(shares)


def synthetic_requests(n: int, seed: int = 0, *, start: float = 0.0) -> list[PendingTask]:
    """``n`` pending tasks of mixed shapes (fractions, 1–8 GPUs, some gangs across nodes)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        roll = rng.random()
        kwargs: dict[str, object] = {
            "priority": rng.choice(("low", "normal", "normal", "high")),
            "partition": rng.choice(list(Partition)).value,
            "expected_duration": rng.choice((600, 3600, 4 * 3600)),
        }
        if roll < 0.3:
            kwargs.update(gpus=rng.choice((0.25, 0.5)), memory=f"{rng.choice((4, 8, 12))}GiB")
        elif roll < 0.65:
            kwargs.update(gpus=1)
        elif roll < 0.8:
            kwargs.update(gpus=2, interconnect=rng.choice(("same_node", "island", "same_numa")))
        elif roll < 0.95:
            kwargs.update(gpus=rng.choice((4, 8)), interconnect=rng.choice(("same_node", "island")))
        else:
            kwargs.update(gpus=16, interconnect=Interconnect.SAME_RACK.value)
        if rng.random() < 0.2:
            kwargs["vendor"] = "nvidia"
        if rng.random() < 0.1:
            kwargs.setdefault("memory", "40GiB")
        out.append(PendingTask(f"task-{seed}-{i:06d}", GPURequest.from_dict(kwargs), start + i))
    return out
