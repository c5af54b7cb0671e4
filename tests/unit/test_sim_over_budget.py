"""Running work over its tenant's budget in the simulator (``[gpusched] over_budget``), and the
budget accounting of stopped and restarted jobs — all through :func:`simulate`."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusched.errors import ConfigurationError
from gpusched.placement import Policy
from gpusched.quota.policy import QuotaPolicy
from gpusched.quota.usage import period_start
from gpusched.request import GPURequest
from gpusched.sim.engine import SimJob, simulate
from gpusched.sim.fleets import uniform_fleet
from gpusched.sim.overbudget import SimOverBudget
from gpusched.sim.preempt import SimPreemption

WEEK = 7 * 86400.0
MONDAY = 4 * 86400.0  # the sim clock's first Monday 00:00 UTC (its 0 is a Thursday)
FLEET = uniform_fleet(1, 1, "A100")  # one A100: 1 A100-h per hour of use
BUDGET = QuotaPolicy(budgets_hours={"a": 1}, period_s=int(WEEK))


def _three_hour_job(estimate: int = 0) -> SimJob:
    return SimJob("long", GPURequest(count=1, tenant="a", expected_duration_s=estimate), 0.0, 3 * 3600.0)


def _run(jobs: list[SimJob], rule: SimOverBudget, **kw: object):  # type: ignore[no-untyped-def]
    return simulate(jobs, FLEET, Policy.named("gpusched"), quota=BUDGET, over_budget=rule, **kw)  # type: ignore[arg-type]


def _used_per_period(result, tenant: str = "a") -> dict[float, float]:  # type: ignore[no-untyped-def]
    """A100-h per budget period, from the runs of every record."""
    out: dict[float, float] = {}
    for r in result.records:
        for start, end, _ in r.segments:
            at = start
            while at < end:  # split a run at period boundaries
                period = period_start(at, int(WEEK))
                stop = min(end, period + WEEK)
                out[period] = out.get(period, 0.0) + (stop - at) / 3600
                at = stop
    return out


def test_finish_lets_a_job_without_estimate_run_three_times_its_budget() -> None:
    # Charged the 1 h default at admission (it fits the 1 A100-h budget), it runs 3 h.
    result = _run([_three_hour_job()], SimOverBudget("finish"))
    (record,) = result.records
    assert record.segments == ((0.0, 3 * 3600.0, record.shares),)
    assert _used_per_period(result) == {period_start(0.0, int(WEEK)): 3.0}
    assert result.quota is not None and result.quota["over_budget"]["stops"] == 0


def test_stop_stops_it_at_the_budget_and_it_resumes_each_monday_from_its_checkpoint() -> None:
    result = _run([_three_hour_job()], SimOverBudget("stop", check_s=5.0))
    (record,) = result.records
    # Stopped when its tenant's use reaches 1 A100-h (checkpoint at 3600 s: nothing lost), held by
    # the budget until the next period (Monday 00:00 UTC), one hour of work per week.
    assert [(s, e) for s, e, _ in record.segments] == [
        (0.0, 3600.0), (MONDAY, MONDAY + 3600.0), (MONDAY + WEEK, MONDAY + WEEK + 3600.0)]
    assert max(_used_per_period(result).values()) == 1.0
    assert result.quota is not None
    assert result.quota["over_budget"] == {"mode": "stop", "check_s": 5.0, "stops": 2, "jobs_stopped": 1,
                                           "lost_gpu_hours": 0.0}
    assert record.preemptions == 0  # a budget stop is not a preemption


def test_stop_acts_at_the_executors_next_check_and_counts_the_lost_work() -> None:
    # Checks every 7 s: the crossing at 3600 s is seen at 3605 s; the last checkpoint (every
    # 1800 s of run) was at 3600 s, so 5 s of work are lost and run again next week.
    result = _run([_three_hour_job()], SimOverBudget("stop", check_s=7.0),
                  preemption=SimPreemption("off", checkpoint_s=1800.0))
    (record,) = result.records
    # Checks at multiples of 7 s: the crossings at 3600 s and Monday + 3600 s are seen at 3605 s
    # and 349202 s; the last checkpoints (every 1800 s of run) were at the crossings, so 5 s and
    # 2 s of work are lost, and run again in the third week.
    assert [(s, e) for s, e, _ in record.segments] == [
        (0.0, 3605.0), (MONDAY, MONDAY + 3602.0), (MONDAY + WEEK, MONDAY + WEEK + 3600.0)]
    assert sum(e - s for s, e, _ in record.segments) == 3 * 3600.0 + 7.0
    assert max(_used_per_period(result).values()) <= 1.0 + 7.0 / 3600  # over by ≤ one check's use
    assert result.quota is not None
    assert result.quota["over_budget"]["lost_gpu_hours"] == round(7.0 / 3600, 3)


def test_stop_leaves_tenants_within_budget_alone() -> None:
    jobs = [_three_hour_job(), SimJob("b", GPURequest(count=1, tenant="b"), 0.0, 5 * 3600.0)]
    fleet = uniform_fleet(1, 2, "A100")
    result = simulate(jobs, fleet, Policy.named("gpusched"), quota=BUDGET, over_budget=SimOverBudget("stop"))
    b = next(r for r in result.records if r.key == "b")
    assert b.segments == ((0.0, 5 * 3600.0, b.shares),)  # unlimited tenant: never stopped


def test_over_budget_mode_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="over_budget = 'kill' is not finish or stop"):
        SimOverBudget("kill")
    assert SimOverBudget().mode == "finish"  # the [gpusched] over_budget default
    assert SimOverBudget(" Stop ").mode == "stop"


def test_a_preempted_job_counts_only_its_runs_and_is_committed_what_is_left() -> None:
    # "low" (tenant a, budget 2 A100-h, 2 h of work, estimate given) is preempted at 3600 s by a
    # critical job of tenant b; it checkpointed at 3600 s, so 1 h of work is left.
    low = SimJob("low", GPURequest.build(gpus=1, priority="low", tenant="a", expected_duration=7200),
                 0.0, 7200.0)
    urgent = SimJob("urgent", GPURequest.build(gpus=1, priority="critical", tenant="b",
                                               expected_duration=3600), 3600.0, 3600.0)
    quota = QuotaPolicy(budgets_hours={"a": 2}, period_s=int(WEEK))
    result = simulate([low, urgent], FLEET, Policy.named("gpusched"), quota=quota,
                      preemption=SimPreemption("priority", checkpoint_s=1800.0, min_runtime_s=300.0,
                                               grace_s=0.0))
    records = {r.key: r for r in result.records}
    # It restarts as soon as "urgent" ends: 1 A100-h used + its remaining 1 h fits the 2 h budget
    # (committed its full 2 h again, it would wait for next week).
    assert [(s, e) for s, e, _ in records["low"].segments] == [(0.0, 3600.0), (7200.0, 10800.0)]
    assert records["low"].preemptions == 1
    # Its use is its two runs (2 A100-h), not first start to end (3 h).
    assert result.quota is not None and result.quota["tenants"]["a"]["used_gpu_hours"] == 2.0


def test_simulate_quotas_periods_start_on_the_traces_mondays(tmp_path: Path) -> None:
    from gpusched.sim.jobs import load_any_trace

    trace = tmp_path / "philly.csv"
    # Wednesday 2017-10-11 12:00 UTC: two 1-GPU jobs of 1 h on one A100, a budget of 1 A100-h.
    trace.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n"
                     "2017-10-11 12:00:00,3600,1,3600,a\n2017-10-11 12:00:01,3600,1,3600,a\n",
                     encoding="utf-8")
    jobs = load_any_trace(trace, utc_weeks=True)
    first = min(j.arrival_s for j in jobs)
    assert first - period_start(first, int(WEEK)) == 2.5 * 86400  # Wednesday noon of its week
    result = simulate(jobs, FLEET, Policy.named("gpusched"), quota=BUDGET)
    starts = sorted(r.start_s for r in result.records)
    # The second job waits for Monday 2017-10-16 00:00 UTC: 4.5 days after the first arrival.
    assert starts == [first, first + 4.5 * 86400]
    assert load_any_trace(trace)[0].arrival_s == 0.0  # without utc_weeks: from the first job
