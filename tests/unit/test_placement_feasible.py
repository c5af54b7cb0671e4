"""placement.feasible is the one feasibility check: it agrees with what placement itself does.

Property-style: seeded random requests (counts, fractions, slices, vendors, models, minimum
architectures, labels, memory, interconnects) against the default fleet, empty and partly busy.
A request ``feasible`` says fits must be placed this cycle; one it says never fits must be
rejected as permanent (so the fault chain never orders a retry placement calls never-fits).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from _placement_support import no_quota

from gpusched.errors import GPURequestError
from gpusched.fleetfile import load_fleet
from gpusched.hardware.simulated import default_fleet_path
from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement import PendingTask, Policy, place
from gpusched.placement.feasible import feasible
from gpusched.placement.reasons import is_repartition_wait
from gpusched.request import GPURequest

_MODELS = ("H100-SXM-80GB", "A100-SXM-80GB", "L40S", "MI300X", "Ascend-910B", "T4")
_ARCHS = ("sm_75", "sm_80", "sm_89", "sm_90", "gfx90a", "gfx942", "ascend910b")


def _fleet() -> FleetSnapshot:
    """The default fleet with every node active (standby is the scaler's business, not placement's)."""
    return FleetSnapshot(tuple(replace(n, standby=False) for n in load_fleet(default_fleet_path())))


def _random_request(rng: random.Random) -> GPURequest | None:
    kwargs: dict[str, Any] = {}
    roll = rng.random()
    if roll < 0.3:
        kwargs["gpus"] = rng.choice((0.1, 0.25, 0.5))
        if rng.random() < 0.4:
            kwargs["isolation"] = rng.choice(("hard", "soft", "any"))
    else:
        kwargs["gpus"] = rng.choice((1, 2, 3, 4, 6, 8, 12, 16))
        kwargs["interconnect"] = rng.choice(("any", "same_node", "same_numa", "island", "same_rack"))
        if kwargs["gpus"] > 8 or kwargs["interconnect"] in ("any", "same_rack"):
            kwargs["gang"] = rng.random() < 0.7
    if rng.random() < 0.3:
        kwargs["models"] = rng.sample(_MODELS, rng.choice((1, 2)))
    elif rng.random() < 0.3:
        kwargs["vendor"] = rng.choice(("nvidia", "amd", "ascend"))
    if rng.random() < 0.3:
        kwargs["min_arch"] = rng.choice(_ARCHS)
    if rng.random() < 0.3:
        kwargs["memory"] = f"{rng.choice((4, 8, 16, 40, 64, 80, 120))}GiB"
    if rng.random() < 0.2:
        kwargs["labels"] = {rng.choice(("pool", "zone")): rng.choice(("training", "inference", "a", "b"))}
    try:
        return GPURequest.build(**kwargs)
    except GPURequestError:
        return None


def _busy(snapshot: FleetSnapshot, rng: random.Random) -> FleetSnapshot:
    shares = []
    for dev in snapshot.devices():
        if dev.takes_work and rng.random() < 0.4:
            milli = rng.choice((MILLI, 500))
            memory = dev.memory_bytes * milli // MILLI
            shares.append(DeviceShare(dev.uuid, dev.node, dev.index, milli, memory))
    return snapshot.with_usage(shares)


def _requests(n: int, seed: int) -> list[GPURequest]:
    rng = random.Random(seed)
    out: list[GPURequest] = []
    while len(out) < n:
        req = _random_request(rng)
        if req is not None:
            out.append(req)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_feasible_on_the_empty_fleet_is_placed_and_infeasible_is_permanent_or_waits(seed: int) -> None:
    fleet = _fleet()
    seen = {True: 0, False: 0}
    for i, req in enumerate(_requests(150, seed)):
        fits = feasible(req, fleet, empty=True)
        seen[fits] += 1
        plan = place(no_quota([PendingTask(f"t{i}", req, 0.0)], fleet, Policy(), now=0.0))
        rejection = plan.rejection(f"t{i}")
        if fits:
            assert plan.assignment(f"t{i}") is not None, (req, rejection)
        else:  # a hard slice no existing slice holds waits for a GPU to be re-partitioned
            assert rejection is not None, (req, plan)
            assert rejection.permanent or is_repartition_wait(rejection.reason), (req, plan)
    assert seen[True] > 20 and seen[False] > 20  # the property was exercised both ways


@pytest.mark.parametrize("seed", [3, 4])
def test_feasible_now_on_a_busy_fleet_matches_placement_now(seed: int) -> None:
    rng = random.Random(seed)
    fleet = _busy(_fleet(), rng)
    seen = {True: 0, False: 0}
    for i, req in enumerate(_requests(150, seed)):
        fits = feasible(req, fleet)
        seen[fits] += 1
        plan = place(no_quota([PendingTask(f"t{i}", req, 0.0)], fleet, Policy(), now=0.0))
        assert (plan.assignment(f"t{i}") is not None) == fits, (req, plan.rejection(f"t{i}"))
        if not feasible(req, fleet, empty=True):
            rejection = plan.rejection(f"t{i}")
            assert rejection is not None
            assert rejection.permanent or is_repartition_wait(rejection.reason)
    assert seen[True] > 20 and seen[False] > 20


def test_excluded_devices_count_as_gone() -> None:
    fleet = _fleet()
    req = GPURequest.build(gpus=8, models=["Ascend-910B"], interconnect="island")
    assert feasible(req, fleet, empty=True)
    one = next(d.uuid for d in fleet.devices() if d.model == "Ascend-910B")
    assert not feasible(req, fleet, empty=True, excluded=frozenset({one}))
