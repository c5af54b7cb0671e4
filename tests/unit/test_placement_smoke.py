"""Smoke test of the public placement API on a synthetic fleet (every policy, plan invariants)."""

from __future__ import annotations

import pytest
from _placement_support import no_quota

from gpusched.model import MILLI
from gpusched.placement import Policy, place
from gpusched.testing import synthetic_fleet, synthetic_requests


@pytest.mark.parametrize("name", Policy.names())
def test_every_policy_gives_a_complete_plan_without_double_booking(name: str) -> None:
    snapshot = synthetic_fleet(30, seed=1)
    pending = synthetic_requests(60, seed=2)
    plan = place(no_quota(pending, snapshot, Policy.named(name), now=1000.0, seed=3))
    keys = [a.key for a in plan.assignments] + [r.key for r in plan.rejections]
    assert sorted(keys) == sorted(t.key for t in pending)
    assert plan.assignments, "a partly used fleet of 240 devices must take some of 60 tasks"
    after = snapshot.with_usage(s for a in plan.assignments for s in a.shares)
    for dev in snapshot.devices():
        assert 0 <= after.used(dev.uuid).used_milli <= MILLI
        assert after.used(dev.uuid).used_memory_bytes <= dev.memory_bytes
    assert all(r.reason for r in plan.rejections)


@pytest.mark.parametrize("name", Policy.names())
def test_empty_fleets_and_nodes_without_devices(name: str) -> None:
    from gpusched.model import FleetSnapshot, Node
    from gpusched.testing import make_node

    pending = synthetic_requests(8, seed=4)
    assert place(no_quota([], synthetic_fleet(2), Policy.named(name), now=0.0)).assignments == ()
    empty = place(no_quota(pending, FleetSnapshot(()), Policy.named(name), now=0.0))
    assert len(empty.rejections) == len(pending) and all(r.permanent for r in empty.rejections)
    holes = FleetSnapshot((Node("e1", "r", ()), make_node("a", "T4", 2), Node("e2", "r", ())))
    plan = place(no_quota(pending, holes, Policy.named(name), now=0.0))
    assert len(plan.assignments) + len(plan.rejections) == len(pending)
    assert all(s.node == "a" for a in plan.assignments for s in a.shares)
