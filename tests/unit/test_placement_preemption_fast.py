"""The victim search's shortcuts (cheap necessary check, proving the shortest passing prefix first,
no victim set proven twice) change nothing: on random fleets and loads, ``select_victims`` gives
the same plan (victims, placement) as the plain search — bisection over the candidates with a
placement proof at every step — and never returns a plan the default prover rejects."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.preemption import (
    MAX_CANDIDATES,
    NoPreemption,
    PreemptionPlan,
    PreemptionRequest,
    Victim,
    _candidates,
    _default_prover,
    _proof,
    select_victims,
)
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

NOW = 50_000.0


def _plain(request: PreemptionRequest) -> PreemptionPlan | NoPreemption:
    """The search without shortcuts: prove every candidate prefix the bisection asks about."""
    prove = _default_prover(request)
    candidates = _candidates(request, request.mode)[:MAX_CANDIDATES]
    if not candidates:
        return NoPreemption("nobody")

    def fits(victims: Sequence[Victim]) -> bool:
        return _proof(request, prove, request.running, victims)[0] is not None

    if not fits(candidates):
        return NoPreemption("no room")
    lo, hi = 1, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[:mid]):
            hi = mid
        else:
            lo = mid + 1
    chosen = list(candidates[:lo])
    for victim in sorted(chosen, key=lambda v: -v.lost_gpu_s):
        rest = [v for v in chosen if v.key != victim.key]
        if rest and fits(rest):
            chosen = rest
    placement = _proof(request, prove, request.running, chosen)[0]
    assert placement is not None
    return PreemptionPlan(tuple(chosen), dict(placement), "")


def _case(rng: random.Random) -> PreemptionRequest:
    nodes, gpus = rng.randint(1, 6), rng.choice([2, 4, 8])
    fleet = FleetSnapshot(tuple(make_node(f"n{i}", "A100-SXM-80GB", gpus) for i in range(nodes)))
    free = {(f"n{i}", g): 1000 for i in range(nodes) for g in range(gpus)}
    running: list[RunningTask] = []
    for k in range(rng.randint(1, nodes * gpus)):
        node = f"n{rng.randrange(nodes)}"
        priority = rng.choice(["low", "normal", "high"])
        if rng.random() < 0.3:  # a fraction of one device
            milli = rng.choice([250, 500])
            spots = [g for g in range(gpus) if free[node, g] >= milli]
            if not spots:
                continue
            picked = [rng.choice(spots)]
            request = GPURequest.build(gpus=milli / 1000, memory="8GiB", priority=priority)
            memory = 8 * 2**30
        else:
            milli, memory = 1000, 0
            spots = [g for g in range(gpus) if free[node, g] == 1000]
            if not spots:
                continue
            picked = rng.sample(spots, rng.randint(1, min(len(spots), 4)))
            request = GPURequest.build(gpus=len(picked), priority=priority)
        for g in picked:
            free[node, g] -= milli
        shares = tuple(DeviceShare(f"{node}-gpu{g}", node, g, milli, memory) for g in picked)
        started = NOW - rng.uniform(0, 20_000)
        running.append(RunningTask(f"r{k}", request, shares, started, None))
    span = rng.random() < 0.2
    want = rng.choice([0.5, 1, 1, 2, 4, 8]) if not span else rng.choice([4, 8, 12])
    asked = GPURequest.build(gpus=want, priority="critical", memory="8GiB" if want < 1 else None,
                             interconnect="any" if span else "same_node")
    waiting = PendingTask("w", asked, NOW - 30)
    checkpoints = {r.key: r.started_at + rng.uniform(0, NOW - r.started_at) for r in running
                   if rng.random() < 0.5}
    used = fleet.with_usage(s for r in running for s in r.shares)
    return PreemptionRequest((waiting,), used, tuple(running), Policy.named("gpusched"), NOW,
                             QuotaState.unlimited(), mode="priority", min_runtime_s=300.0,
                             checkpoints=checkpoints)


@pytest.mark.parametrize("seed", range(6))
def test_the_fast_search_chooses_what_the_plain_search_chooses(seed: int) -> None:
    rng = random.Random(seed)
    plans = 0
    for _ in range(60):
        request = _case(rng)
        fast, plain = select_victims(request), _plain(request)
        assert type(fast) is type(plain), (fast, plain)
        if isinstance(fast, PreemptionPlan):
            assert isinstance(plain, PreemptionPlan)
            plans += 1
            assert [v.key for v in fast.victims] == [v.key for v in plain.victims]
            assert dict(fast.placement) == dict(plain.placement)
            # and the plan is proven: the default prover places the waiting task without them
            assert _proof(request, _default_prover(request), request.running, fast.victims)[0] is not None
    assert plans > 5  # the random cases do exercise preemption


def test_the_cheap_check_rules_out_a_set_without_a_proof() -> None:
    rng = random.Random(99)
    asked = 0
    for _ in range(40):
        request = _case(rng)
        calls: list[int] = []
        prove = _default_prover(request)

        def counting(snapshot: FleetSnapshot, running: Sequence[RunningTask], prove=prove, calls=calls):  # type: ignore[no-untyped-def]
            calls.append(1)
            return prove(snapshot, running)

        verdict = select_victims(request, counting)
        if isinstance(verdict, NoPreemption) and "device(s) with" in verdict.reason:
            assert not calls  # ruled out by the necessary check alone
            asked += 1
    assert asked > 0
