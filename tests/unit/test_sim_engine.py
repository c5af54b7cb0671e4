"""Event-engine invariants and metric definitions on small fleets, with the real placement engine."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from gpusched.catalog import default_catalog
from gpusched.model import FleetSnapshot
from gpusched.node_builder import SIM_LAYOUT, make_node
from gpusched.placement import Policy
from gpusched.request import GPURequest
from gpusched.sim.engine import SimJob, SimResult, simulate
from gpusched.sim.fleets import uniform_fleet
from gpusched.sim.metrics import percentile, summarize

_SIM: dict = {"layout": SIM_LAYOUT, "rack": "rack0", "cpu_milli": 0, "memory_bytes": 0}


def _jobs(n: int, seed: int) -> list[SimJob]:
    rng = random.Random(seed)
    out = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(1 / 30)
        count = rng.choice((1, 1, 1, 2, 4))
        req = GPURequest(count=count, gang=count > 1)
        if count == 1 and rng.random() < 0.3:
            req = GPURequest(count=1, milli_per_gpu=rng.choice((250, 500)), memory_per_gpu=2**30)
        out.append(SimJob(f"j{i}", req, round(t, 3), rng.uniform(20, 400)))
    return out


def _check_invariants(result: SimResult, jobs: list[SimJob], round_up: bool) -> None:
    by_key = {j.key: j for j in jobs}
    keys = [r.key for r in result.records]
    assert len(keys) == len(set(keys)), "a job started twice"
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for rec in result.records:
        job = by_key[rec.key]
        assert rec.start_s >= job.arrival_s
        assert len(rec.shares) == job.request.count
        assert len({s.uuid for s in rec.shares}) == job.request.count
        for share in rec.shares:
            assert share.milli == (1000 if round_up else job.request.milli_per_gpu)
            events[share.uuid].append((rec.start_s, share.milli))
            events[share.uuid].append((rec.end_s, -share.milli))
    for uuid, items in events.items():
        level = 0
        for _, delta in sorted(items, key=lambda e: (e[0], e[1])):  # releases first at a tie
            level += delta
            assert 0 <= level <= 1000, f"device {uuid} over-committed"
    assert all(p.used_milli <= result.capacity_milli for p in result.timeline)


@pytest.mark.parametrize("policy", ["gpusched", "first-fit", "best-fit", "random"])
def test_every_job_finishes_without_overcommit(policy: str) -> None:
    jobs = _jobs(60, seed=7)
    fleet = uniform_fleet(2, 4, "A100")
    chosen = Policy.named(policy, fractions_need_partitioning=False)
    result = simulate(jobs, fleet, chosen, seed=3)
    assert not result.unstarted and not result.rejected
    assert {r.key for r in result.records} == {j.key for j in jobs}
    assert all(r.end_s <= result.end_time for r in result.records)
    _check_invariants(result, jobs, chosen.round_up_fractions)


def test_duration_depends_on_the_model_it_got() -> None:
    fleet = FleetSnapshot((make_node("fast", "V100", 1, **_SIM), make_node("slow", "K80", 1, **_SIM)))
    durations = {"V100-SXM2-16GB": 10.0, "K80": 40.0}
    jobs = [SimJob(f"j{i}", GPURequest(), 0.0, 10.0, durations) for i in range(2)]
    result = simulate(jobs, fleet, Policy.named("first-fit"))
    runtimes = sorted((r.models[0], r.end_s - r.start_s) for r in result.records)
    assert runtimes == [("K80", 40.0), ("V100-SXM2-16GB", 10.0)]


def test_rounds_start_work_on_round_boundaries_only() -> None:
    jobs = [SimJob("a", GPURequest(), 5.0, 100.0), SimJob("b", GPURequest(), 130.0, 50.0)]
    result = simulate(jobs, uniform_fleet(1, 1), Policy.named("first-fit"), round_s=60.0)
    starts = {r.key: r.start_s for r in result.records}
    assert starts == {"a": 60.0, "b": 180.0}  # b waits for a (ends at 160) and the next round


def test_stop_after_and_permanent_rejection() -> None:
    jobs = [SimJob("big", GPURequest(count=16, gang=True), 0.0, 10.0)]
    jobs += [SimJob(str(i), GPURequest(), float(i), 10.0) for i in range(30)]
    result = simulate(jobs, uniform_fleet(2, 4), Policy.named("gpusched"), stop_after={"2", "3"})
    assert result.rejected.get("big")
    done = {r.key for r in result.records if r.end_s <= result.end_time}
    assert {"2", "3"} <= done
    assert result.not_arrived > 0  # stopped before the stream ended


def test_metrics_on_a_hand_computed_case() -> None:
    fleet = uniform_fleet(1, 1, "H100")
    jobs = [
        SimJob("a", GPURequest(), 0.0, 10.0),
        SimJob("b", GPURequest(), 0.0, 10.0),
        SimJob("c", GPURequest(), 40.0, 10.0),
    ]
    m = summarize(simulate(jobs, fleet, Policy.named("first-fit")))
    # busy 0–20 of the arrival window 0–40 → 50 %; b waits 10 s; JCTs 10, 20, 10
    assert m["utilisation_pct"] == pytest.approx(50.0)
    assert m["queue_delay_mean_s"] == pytest.approx(10 / 3, rel=1e-3)
    assert m["jct_mean_s"] == pytest.approx(40 / 3, rel=1e-3)
    assert m["fragmentation_pct"] == 0.0  # nothing was free while b waited
    tdp_w = default_catalog().get("H100").tdp_milliwatts / 1000
    assert m["energy_kwh"] == pytest.approx(tdp_w * 30 / 3.6e6, rel=1e-3)
    assert m["jobs_finished"] == 3 and m["makespan_s"] == 50.0


def test_percentile() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 95) == 5
    assert percentile(list(range(101)), 95) == 95


def test_head_of_line_blocking_only_when_asked() -> None:
    jobs = [
        SimJob("a", GPURequest(), 0.0, 100.0),
        SimJob("b", GPURequest(count=2, gang=True), 1.0, 10.0),
        SimJob("c", GPURequest(), 2.0, 10.0),
    ]
    fleet = uniform_fleet(1, 2)
    skip = {r.key: r.start_s for r in simulate(jobs, fleet, Policy.named("first-fit")).records}
    assert skip == {"a": 0.0, "c": 2.0, "b": 100.0}  # c uses the free GPU while b waits
    strict = simulate(jobs, fleet, Policy.named("first-fit"), head_of_line=True)
    assert {r.key: r.start_s for r in strict.records} == {"a": 0.0, "b": 100.0, "c": 110.0}


def test_genetic_replanning_runs_inside_the_engine() -> None:
    # A busy small fleet, so most passes offer several jobs: every such pass is re-planned by
    # the genetic optimiser (generation cap binding before the generous budget = deterministic).
    jobs = _jobs(60, seed=4)
    fleet = uniform_fleet(3, 4, "A100")
    kwargs = dict(replan_budget_ms=10_000.0, replan_generations=5, seed=1)
    policy = Policy.named("gpusched", fractions_need_partitioning=False)
    result = simulate(jobs, fleet, policy, **kwargs)  # type: ignore[arg-type]
    greedy = simulate(jobs, fleet, policy, seed=1)
    assert result.replans > 0 and greedy.replans == 0
    assert 0 <= result.replans_improved <= result.replans
    _check_invariants(result, jobs, False)
    assert len(result.records) == len(jobs) == len(greedy.records)
    again = simulate(jobs, fleet, policy, **kwargs)  # type: ignore[arg-type]
    assert [(r.key, r.start_s) for r in again.records] == [(r.key, r.start_s) for r in result.records]
    summary = summarize(result)
    assert summary["replans"] == result.replans
