"""Preemption by expected remaining service in the simulator (``SimPreemption('service')``):
short jobs of a group whose runs are mostly short take the devices of jobs that have outlived
most of them; the victims resume; nothing is over-committed."""

from __future__ import annotations

import random

import pytest

from gpusched.durations import FinishedRun
from gpusched.model import FleetSnapshot
from gpusched.node_builder import SIM_LAYOUT, make_node
from gpusched.placement import Policy
from gpusched.request import GPURequest
from gpusched.sim.engine import SimJob, SimResult, simulate
from gpusched.sim.preempt import SimPreemption

FLEET = FleetSnapshot((make_node("n0", "A100-SXM-80GB", 4, layout=SIM_LAYOUT, cpu_milli=0, memory_bytes=0),))
ONE = GPURequest.build(gpus=1, tenant="vc")
# The group's past: 90 % of its 1-GPU runs took a minute, 10 % ten hours (Philly-like).
HISTORY = [FinishedRun("", "vc", 1000, "any", d) for d in [60.0] * 27 + [36_000.0] * 3]


def _run(jobs: list[SimJob], mode: str, max_unsaved_s: float = 0.0) -> SimResult:
    """The replay; ``max_unsaved_s`` 0 by default: these tests are about the index alone."""
    preemption = (SimPreemption(mode, checkpoint_s=1800.0, min_runtime_s=300.0, max_unsaved_s=max_unsaved_s)
                  if mode != "off" else None)
    return simulate(jobs, FLEET, Policy.named("gpusched"), preemption=preemption, duration_history=HISTORY)


def test_short_jobs_preempt_jobs_that_outlived_their_group_and_the_victims_resume() -> None:
    longs = [SimJob(f"long{i}", ONE, 0.0, 36_000.0) for i in range(4)]
    shorts = [SimJob(f"short{i}", ONE, 1000.0, 60.0) for i in range(4)]
    plain = {r.key: r for r in _run(longs + shorts, "off").records}
    assert plain["short0"].start_s == 36_000.0  # non-preemptive: behind the ten-hour jobs
    result = _run(longs + shorts, "service")
    records = {r.key: r for r in result.records}
    # Each long job is told at 1000 s and stops when its 30 s grace ends; the shorts start then.
    assert all(records[f"short{i}"].start_s == 1030.0 for i in range(4))
    # Each long job ran 1030 s (no checkpoint yet: all lost), waited for the shorts, then reran
    # in full; it is never preempted again (its attained service keeps its index low).
    assert all((records[f"long{i}"].preemptions, records[f"long{i}"].end_s) == (1, 1090.0 + 36_000.0)
               for i in range(4))
    assert result.preemption is not None
    assert (result.preemption["mode"], result.preemption["preemptions"]) == ("service", 4)
    assert result.preemption["service"]["warm_up_runs"] == 30
    assert all(0 <= p.used_milli <= result.capacity_milli for p in result.timeline)


def test_with_a_limit_on_unsaved_work_the_victims_are_stopped_just_after_their_checkpoint() -> None:
    # As above, but no victim by index may lose more than 600 s of run: the long jobs (started at
    # 0 s, checkpoints every 1800 s) have run 1000 s unsaved when the shorts arrive, so the shorts
    # wait. The replay passes on events (an executor: every heartbeat): the next is an arrival at
    # 1850 s, 50 s after the long jobs' checkpoint; each is told then and stops 30 s later,
    # losing 80 s instead of 1030 s.
    longs = [SimJob(f"long{i}", ONE, 0.0, 36_000.0) for i in range(4)]
    shorts = [SimJob(f"short{i}", ONE, 1000.0, 60.0) for i in range(4)]
    result = _run([*longs, *shorts, SimJob("later", ONE, 1850.0, 60.0)], "service", max_unsaved_s=600.0)
    records = {r.key: r for r in result.records}
    assert all(records[f"short{i}"].start_s == 1880.0 for i in range(4))
    assert all(records[f"long{i}"].preemptions == 1 for i in range(4))
    assert result.preemption is not None
    assert result.preemption["lost_gpu_hours"] == pytest.approx(4 * 80 / 3600, abs=1e-3)


def test_preempted_jobs_keep_their_attained_service_and_do_not_thrash() -> None:
    # Eight ten-hour jobs of one group on four GPUs; a ninth arrives at 5000 s (a pass). The four
    # running ones have outlived 90 % of their group: the fresh waiting ones preempt them (one
    # preemption per cycle, the cycles of one instant in a row) and start when the victims' 30 s
    # grace ends. The victims keep the 5030 s they received as attained service, so they never
    # take the devices back: each job is preempted at most once. (At 36,000 s the ninth, still
    # fresh, preempts one more job, which has attained 31,000 s by then.)
    jobs = [SimJob(f"j{i}", ONE, i * 10.0, 36_000.0) for i in range(8)]
    jobs.append(SimJob("j8", ONE, 5000.0, 36_000.0))
    result = _run(jobs, "service")
    records = {r.key: r for r in result.records}
    assert result.preemption is not None and result.preemption["preemptions"] == 5
    assert [records[f"j{i}"].preemptions for i in range(9)] == [1] * 5 + [0] * 4
    assert all(records[f"j{i}"].start_s == 5030.0 for i in range(4, 8))
    assert records["j8"].start_s == 36_030.0 and len(records) == 9


def test_no_device_is_overcommitted_and_every_job_finishes() -> None:
    rng = random.Random(5)
    jobs = [SimJob(f"j{i}", GPURequest.build(gpus=rng.choice((1, 2, 4)), tenant="vc"), i * 300.0,
                   rng.choice((60.0, 600.0, 20_000.0))) for i in range(80)]
    history = [FinishedRun("", "vc", g * 1000, "any", d)
               for g in (1, 2, 4) for d in [60.0] * 20 + [20_000.0] * 5]
    result = simulate(jobs, FLEET, Policy.named("gpusched"), duration_history=history,
                      preemption=SimPreemption("service", checkpoint_s=600.0, min_runtime_s=120.0))
    assert result.preemption is not None and result.preemption["preemptions"] > 0
    assert sorted(r.key for r in result.records) == sorted(j.key for j in jobs)
    assert all(0 <= p.used_milli <= result.capacity_milli for p in result.timeline)
    assert sum(r.preemptions for r in result.records) == result.preemption["preemptions"]
