"""Preemption in the simulator: the executor's victim selection, notice and grace, checkpointed
progress, requeue."""

from __future__ import annotations

import random

import pytest

from gpusched.model import FleetSnapshot
from gpusched.node_builder import SIM_LAYOUT, make_node
from gpusched.placement import Policy
from gpusched.request import GPURequest
from gpusched.sim.engine import SimJob, SimResult, simulate
from gpusched.sim.preempt import SimPreemption

FLEET = FleetSnapshot((make_node("n0", "A100-SXM-80GB", 4, layout=SIM_LAYOUT, cpu_milli=0, memory_bytes=0),))


def _run(jobs: list[SimJob], mode: str, **kw: float) -> SimResult:
    preemption = SimPreemption(mode, **kw) if mode != "off" else None  # type: ignore[arg-type]
    return simulate(jobs, FLEET, Policy.named("gpusched"), preemption=preemption)


def _jobs() -> list[SimJob]:
    low = SimJob("low", GPURequest.build(gpus=4, priority="low"), 0.0, 36_000.0)
    urgent = SimJob("urgent", GPURequest.build(gpus=2, priority="critical"), 7_000.0, 3_600.0)
    return [low, urgent]


def test_a_critical_job_preempts_and_the_victim_resumes_from_its_checkpoint() -> None:
    plain = {r.key: r for r in _run(_jobs(), "off").records}
    assert plain["urgent"].start_s == 36_000.0  # non-preemptive: waits for the 10-hour job
    result = _run(_jobs(), "priority", checkpoint_s=1800.0, min_runtime_s=300.0)
    records = {r.key: r for r in result.records}
    # "low" gets its notice at 7000 s and runs through the executor's default grace (30 s).
    assert records["urgent"].start_s == 7_030.0
    # "low" checkpointed at 5400 s: it keeps 5400 of 36000 s of work, loses 1630 s on 4 GPUs,
    # waits for "urgent" (until 10630 s) and runs the remaining 30600 s.
    low = records["low"]
    assert (low.start_s, low.end_s, low.preemptions) == (0.0, 10_630.0 + 30_600.0, 1)
    assert result.preemption == {"mode": "priority", "checkpoint_s": 1800.0, "min_runtime_s": 300.0,
                                 "grace_s": 30.0, "max_unsaved_s": 600.0, "min_rerun_s": 7200.0,
                                 "preemptions": 1, "jobs_preempted": 1,
                                 "lost_gpu_hours": pytest.approx(1630 * 4 / 3600, abs=1e-3)}


def test_without_a_grace_the_victim_stops_and_the_beneficiary_starts_at_the_notice() -> None:
    result = _run(_jobs(), "priority", checkpoint_s=1800.0, min_runtime_s=300.0, grace_s=0.0)
    records = {r.key: r for r in result.records}
    assert records["urgent"].start_s == 7_000.0
    assert records["low"].end_s == 10_600.0 + 30_600.0


def test_a_job_that_ends_in_its_grace_is_not_requeued() -> None:
    jobs = [SimJob("low", GPURequest.build(gpus=4, priority="low"), 0.0, 7_010.0), _jobs()[1]]
    result = _run(jobs, "priority", checkpoint_s=1800.0, min_runtime_s=300.0)
    records = {r.key: r for r in result.records}
    assert records["low"].end_s == 7_010.0 and records["low"].preemptions == 0
    assert records["urgent"].start_s == 7_010.0  # the room its victim left, at once
    assert result.preemption is not None and result.preemption["preemptions"] == 0


def test_energy_counts_a_preempted_job_only_while_it_held_devices() -> None:
    from gpusched.catalog import default_catalog
    from gpusched.sim.metrics import energy_kwh

    result = _run(_jobs(), "priority", checkpoint_s=1800.0, min_runtime_s=300.0)
    watts = default_catalog().get("A100-SXM-80GB").tdp_milliwatts / 1000
    # "low": 4 GPUs for 0–7030 s and 10630–41230 s (not while it waited); "urgent": 2 GPUs for 3600 s.
    gpu_s = 4 * (7_030 + 30_600) + 2 * 3_600
    assert energy_kwh(result.records, result) == pytest.approx(watts * gpu_s / 3.6e6, rel=1e-6)


def test_without_checkpoints_all_work_is_lost_and_fresh_jobs_are_protected() -> None:
    records = {r.key: r for r in _run(_jobs(), "priority", checkpoint_s=0.0).records}
    assert records["low"].end_s == 10_630.0 + 36_000.0
    young = _run(_jobs(), "priority", min_runtime_s=8_000.0)
    assert {r.key: r for r in young.records}["urgent"].start_s == 36_000.0
    assert young.preemption is not None and young.preemption["preemptions"] == 0


def test_a_restarted_job_is_not_stopped_again_before_its_first_checkpoint_after_the_restart() -> None:
    # "low" is preempted at 7000 s by u1 and restarts at 10600 s. u2 arrives at 11000 s: "low" has
    # run 400 s since its restart (past the 300 s minimum) and would lose them all, so it is not a
    # victim until its checkpoint at 10600 + 1800 s; the next pass after that (the arrival of
    # "tick" at 12500 s) preempts it for u2.
    jobs = [*_jobs()[:1],
            SimJob("u1", GPURequest.build(gpus=2, priority="critical"), 7_000.0, 3_600.0),
            SimJob("u2", GPURequest.build(gpus=2, priority="critical"), 11_000.0, 3_600.0),
            SimJob("tick", GPURequest.build(gpus=1, priority="low"), 12_500.0, 60.0)]
    result = _run(jobs, "priority", checkpoint_s=1800.0, min_runtime_s=300.0, grace_s=0.0)
    records = {r.key: r for r in result.records}
    assert records["u1"].start_s == 7_000.0
    assert records["u2"].start_s == 12_500.0
    assert records["low"].preemptions == 2
    assert result.preemption is not None
    # Both stops lost only the work since a checkpoint: 1600 s and then 100 s, on 4 GPUs.
    assert result.preemption["lost_gpu_hours"] == pytest.approx((1600 + 100) * 4 / 3600, abs=1e-3)


def test_no_device_is_overcommitted_under_preemption() -> None:
    rng = random.Random(3)
    jobs = [SimJob(f"j{i}", GPURequest.build(gpus=rng.choice((1, 2, 4)),
                                             priority=rng.choice(("low", "normal", "high", "critical"))),
                   i * 400.0, rng.uniform(600, 9000)) for i in range(60)]
    result = _run(jobs, "priority", checkpoint_s=600.0, min_runtime_s=120.0)
    assert result.preemption is not None and result.preemption["preemptions"] > 0
    assert sorted(r.key for r in result.records) == sorted(j.key for j in jobs)  # all finished
    assert all(0 <= p.used_milli <= result.capacity_milli for p in result.timeline)
    assert sum(r.preemptions for r in result.records) == result.preemption["preemptions"]
    # Only lower-priority jobs were stopped: a critical job is never a victim.
    priority = {j.key: j.request.priority for j in jobs}
    assert all(priority[r.key] < 100 for r in result.records if r.preemptions)


def test_the_mode_is_checked() -> None:
    with pytest.raises(Exception, match="is not one of off, priority, partitions"):
        SimPreemption("always")


def test_work_that_cannot_preempt_does_not_starve_a_partition_that_reclaims() -> None:
    """Mode partitions: dev jobs borrow the whole node, more dev jobs wait (dev is over its share:
    they can never preempt), then a training job arrives. The selections a cycle may try
    (``MAX_SELECTIONS_PER_CYCLE``) are not spent on the waiting dev jobs, so training takes back
    its share at once (after the victim's grace), not when the dev jobs end."""
    from gpusched.quota.policy import QuotaPolicy
    from gpusched.scheduler.preemption import MAX_SELECTIONS_PER_CYCLE

    quota = QuotaPolicy.from_dict({"shares": {"training": 70, "burst": 20, "dev": 10}, "borrowing": True})
    dev = GPURequest.build(gpus=1, partition="dev")
    jobs = [SimJob(f"dev{i}", dev, float(i), 36_000.0) for i in range(4)]
    jobs += [SimJob(f"waiting-dev{i}", dev, 100.0 + i, 600.0) for i in range(MAX_SELECTIONS_PER_CYCLE + 1)]
    jobs.append(SimJob("train", GPURequest.build(gpus=1, partition="training"), 1_000.0, 600.0))
    preemption = SimPreemption("partitions", checkpoint_s=600.0, min_runtime_s=300.0)
    result = simulate(jobs, FLEET, Policy.named("gpusched"), quota=quota, preemption=preemption)
    records = {r.key: r for r in result.records}
    assert records["train"].start_s == 1_000.0 + preemption.grace_s
    assert result.preemption is not None and result.preemption["preemptions"] >= 1
    assert all(records[f"waiting-dev{i}"].preemptions == 0 for i in range(MAX_SELECTIONS_PER_CYCLE + 1))
