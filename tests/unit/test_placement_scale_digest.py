"""Placements at 1,000 nodes stay what they were: a seeded stream of decisions on synthetic fleets,
made by a fresh engine per call (``place``), by ``place`` with several tasks at once, by one
engine kept between decisions (``Placer``) and by ``WarmPlacement``, hashed to one digest per
(policy, seed) and compared with the digest recorded before the engine's speed-ups (issue 33).

A changed digest means some decision changed: devices, shares, rejection reasons or the score
(to 9 significant digits). Record new digests only for an intended change of decisions.

The look-ahead computes the rows of equal node states once in a large batch (held to the rows
computed node by node), and converts to integer scores only the candidates near the top level
(held to converting all of them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

import numpy as np
import pytest

from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement import PendingTask, PlacementPlan, PlacementRequest, Placer, Policy, place
from gpusched.placement.ties import integer_score, near_top
from gpusched.placement.warm import WarmPlacement
from gpusched.placement.workload import workload_for
from gpusched.quota.policy import QuotaState
from gpusched.testing import make_node, synthetic_fleet, synthetic_requests

NODES = 1000

# Recorded from the engine before issue 33's speed-ups.
DIGESTS = {
    ("gpusched", 0, False): "e877f6d77f7a34cbf163c266cd63eedb7e71f78fb0d921eb917d37acee08a751",
    ("gpusched", 1, False): "1b27df539dba46a0f6cd1f0aefad4773b1a939c29360f72471a29a8495a85179",
    ("fgd-lookahead", 0, False): "97a475a449e9269c9e7cdc1f730c9424345f0c15ae6932b29838209fd044e2d3",
    ("gpusched", 0, True): "d7cf03c0978f96e49745c8bfcc535e400b48568b685697619ae2558527fcb0ea",
    ("gpusched", 2, True): "fb667992280a614d37ea5bf270fe44e4e79f3ee75d772615f2f73d9ca7ead35c",
    ("fgd-lookahead", 1, True): "232c8da3509da7f075c5fa16ef8afba0cada98e071a2e97add2afac1fb9bc4b6",
}


def _plan(plan: PlacementPlan) -> list[object]:
    return [
        [[a.key, [[s.uuid, s.milli, s.memory_bytes] for s in a.shares], f"{a.score:.9g}"]
         for a in plan.assignments],
        [[r.key, r.reason, r.permanent] for r in plan.rejections],
        [[r.key, [s.uuid for s in r.shares], r.start] for r in plan.reservations],
    ]


def _request(pending: list[PendingTask], snapshot: FleetSnapshot, policy: Policy, now: float,
             seed: int) -> PlacementRequest:
    return PlacementRequest(pending=pending, snapshot=snapshot, policy=policy, now=now,
                            quota=QuotaState.unlimited(), seed=seed)


_PINNED = ("H100-SXM-80GB", "A100-SXM-80GB", "L40S", "T4")


def _stream(policy_name: str, seed: int, pinned: bool = False) -> list[object]:
    """Every plan of the stream, in order (see the module docstring)."""
    rng = random.Random(seed)
    policy = Policy.named(policy_name)
    fleet = synthetic_fleet(NODES, 8, seed, used_fraction=0.4)
    tasks = [dataclasses.replace(t, cpu_milli=rng.choice((0, 0, 4000)),
                                 host_memory_bytes=rng.choice((0, 0, 16 << 30)))
             for t in synthetic_requests(160, seed=seed)]
    if pinned:  # shapes pinned to models: the shape-by-shape (host-aware) form of the measure
        tasks = [dataclasses.replace(t, request=dataclasses.replace(t.request, models=frozenset(
                     rng.sample(_PINNED, rng.randint(1, 2)))))
                 if t.request.count <= 8 and rng.random() < 0.4 else t for t in tasks]
    out: list[object] = []
    # A fresh engine per decision on a fleet that fills and drains.
    snapshot, held = fleet, []
    for i, task in enumerate(tasks[:40]):
        plan = place(_request([task], snapshot, policy, float(i), i))
        out.append(_plan(plan))
        for a in plan.assignments:
            snapshot = snapshot.with_usage(a.shares)
            held.append(a.shares)
        if held and rng.random() < 0.3:
            snapshot = snapshot.with_usage(held.pop(rng.randrange(len(held))), release=True)
    # Several tasks per call.
    for i in range(5):
        out.append(_plan(place(_request(tasks[40 + 8 * i: 48 + 8 * i], snapshot, policy, 100.0 + i, i))))
    # One engine kept between decisions, committing and releasing.
    placer, kept = Placer(fleet, policy), []
    for i, task in enumerate(tasks[80:120]):
        plan = placer.place(_request([task], fleet, policy, float(i), i))
        out.append(_plan(plan))
        kept += [a.shares for a in plan.assignments]
        if kept and rng.random() < 0.4:
            placer.release(kept.pop(rng.randrange(len(kept))))
    # The executor's warm engine over a changing snapshot.
    warm, snapshot = WarmPlacement(), fleet
    for i in range(10):
        pending = tasks[120 + 4 * i: 124 + 4 * i]
        plan = warm.place(_request(pending, snapshot, policy, 200.0 + i, i))
        out.append(_plan(plan))
        for a in plan.assignments[::2]:
            snapshot = snapshot.with_usage(a.shares)
    return out


def digest(policy_name: str, seed: int, pinned: bool = False) -> str:
    """SHA-256 of the stream's plans (``pinned``: some tasks name their models)."""
    return hashlib.sha256(json.dumps(_stream(policy_name, seed, pinned)).encode()).hexdigest()


@pytest.mark.parametrize(("policy_name", "seed", "pinned"), sorted(DIGESTS))
def test_decisions_at_1000_nodes_equal_the_recorded_ones(policy_name: str, seed: int, pinned: bool) -> None:
    assert digest(policy_name, seed, pinned) == DIGESTS[(policy_name, seed, pinned)]


def _mixed_fleet(nodes: int, seed: int, fractions: tuple[int, ...]) -> FleetSnapshot:
    """Nodes of 1, 2, 4 and 8 devices whose devices are free, full, or hold one of ``fractions``."""
    rng = random.Random(seed)
    built = [make_node(f"n{i:04d}", rng.choice(("A100-SXM-80GB", "T4", "L40S")), rng.choice((1, 2, 4, 8)))
             for i in range(nodes)]
    snapshot = FleetSnapshot(tuple(built), source="test")
    shares = []
    for node in built:
        for dev in node.devices:
            if rng.random() < 0.5:
                milli = rng.choice((MILLI, *fractions))
                shares.append(DeviceShare(dev.uuid, dev.node, dev.index, milli, 1))
    return snapshot.with_usage(shares)


@pytest.mark.parametrize("fractions", [(250, 500, 750), tuple(range(10, 1000, 10))])
def test_a_large_batch_shares_rows_between_equal_nodes_only(fractions: tuple[int, ...]) -> None:
    # Few fraction sizes: counts per value key the node; 99 sizes: its sorted values do.
    fleet = _mixed_fleet(600, 3, fractions)
    requests = [t.request for t in synthetic_requests(40, seed=3)]
    policy = Policy.named("gpusched")
    placer = Placer(fleet, policy, workload=workload_for(policy.workload, requests))
    ahead, stats, state = placer.lookahead, placer.stats, placer.state
    assert ahead is not None
    state.host_cpu[::7] = 0  # some nodes short of host CPU
    stats.refresh(state, range(0, len(fleet.nodes), 7))
    nodes = np.arange(len(fleet.nodes))
    first, inverse = ahead._distinct(stats, state, nodes)
    assert 1 < len(first) < len(nodes) and (inverse[first] == np.arange(len(first))).all()
    batch = ahead.rows_of(stats, state, nodes)
    one_by_one = np.array([ahead.rows_of(stats, state, np.array([n]))[0] for n in nodes])
    np.testing.assert_allclose(batch, one_by_one, rtol=0, atol=1e-9)
    assert (np.isinf(batch) == np.isinf(one_by_one)).all()


@pytest.mark.parametrize("levels", [1, 2, 10, 50, 1000])
def test_near_top_converts_every_candidate_of_the_levels_asked(levels: int) -> None:
    rng = np.random.default_rng(levels)
    edges = np.log(levels / np.arange(1, levels) - 1.0) if levels > 1 else np.zeros(1)
    for trial in range(200):
        size = int(rng.integers(1, 300))
        if trial % 3 == 0:  # on and around the levels' edges
            score = rng.choice(edges, size) + rng.choice([-1e-12, 0.0, 1e-12, 4e-10, 6e-10], size)
        elif trial % 3 == 1:
            score = rng.choice([-40.0, -36.7, -36.0, 0.0, 3.9, 50.0, 60.0], size) + rng.normal(0, 1e-9, size)
        else:
            score = rng.normal(0, 4, size)
        q = integer_score(score, levels)
        for below in (0, 1, 2):
            positions, near = near_top(score, levels, below)
            assert np.array_equal(near, q[positions])
            assert np.array_equal(positions[near >= q.max() - below], np.flatnonzero(q >= q.max() - below))
