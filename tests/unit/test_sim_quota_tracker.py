"""The simulator's incremental quota state equals the executor's recount over every started job."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpusched.model import DeviceShare
from gpusched.quota.policy import QuotaPolicy
from gpusched.request import GPURequest
from gpusched.sim.fleets import uniform_fleet
from gpusched.sim.quota import QuotaTracker, quota_state_at
from gpusched.sim.results import JobRecord


@dataclass(frozen=True)
class _Job:
    request: GPURequest


def test_tracker_matches_the_recount_across_periods() -> None:
    rng = random.Random(7)
    fleet = uniform_fleet(4, 8, "P100")
    devices = list(fleet.devices())
    policy = QuotaPolicy(period_s=86400)  # short periods: many resets inside the run
    jobs: dict[str, _Job] = {}
    records: dict[str, JobRecord] = {}
    tracker = QuotaTracker(policy, jobs, fleet)
    now = 0.0
    for i in range(300):
        now += rng.expovariate(1 / 1800)
        key = f"j{i}"
        jobs[key] = _Job(GPURequest(count=1, tenant=rng.choice(["a", "b", "c"])))
        picked = rng.sample(devices, rng.randint(1, 4))
        shares = tuple(DeviceShare(d.uuid, d.node, d.index, 1000, 0) for d in picked)
        first = now
        records[key] = JobRecord(key, first, first, now + rng.expovariate(1 / 20000), shares, ("P100",))
        tracker.started(records[key])
        if i % 5 == 0 and records[key].end_s > now + 60:  # stopped a minute later, restarted later
            now += 60
            stop = now
            tracker.stopped(key, stop)
            # While it waits only its first run counts (the engine keeps it in ``runs``).
            records[key] = JobRecord(key, first, first, stop, shares, ("P100",),
                                     runs=((first, stop, shares),))
            recount = quota_state_at(policy, records, jobs, fleet, now)
            assert dict(tracker.state_at(now).used) == dict(recount.used)
            now += 900  # waiting: the recount sees only its first run
            waiting = quota_state_at(policy, records, jobs, fleet, now)
            assert dict(tracker.state_at(now).used) == dict(waiting.used)
            records[key] = JobRecord(key, first, first, now + 600, shares, ("P100",),
                                     runs=((first, stop, shares), (now, now + 600, shares)))
            tracker.started(records[key])
        if i % 7 == 0:
            now += rng.choice([0.0, 3600.0, 2 * 86400.0])  # a pass later, sometimes periods later
        expected = quota_state_at(policy, records, jobs, fleet, now)
        got = tracker.state_at(now)
        assert got.period_start == expected.period_start
        assert dict(got.used) == dict(expected.used), (i, now)
    assert any(v > 0 for v in got.used.values())


def test_tracker_without_policy_is_unlimited() -> None:
    tracker = QuotaTracker(None, {}, uniform_fleet(1, 8, "P100"))
    assert not tracker.state_at(10.0).enforced


def test_budget_held_jobs_do_not_fill_the_offer_window() -> None:
    from gpusched.placement import Policy
    from gpusched.sim.engine import SimJob, simulate

    def job(key: str, tenant: str, at: float) -> SimJob:
        return SimJob(key, GPURequest(count=1, tenant=tenant, expected_duration_s=3600), at, 3600.0)

    # a may spend 1 A100-h a week: a0 runs, a1-a4 wait for next week; the pass offers 2 jobs.
    jobs = [job(f"a{i}", "a", float(i)) for i in range(5)] + [job("b0", "b", 10.0)]
    result = simulate(jobs, uniform_fleet(1, 8, "A100"), Policy.named("gpusched"), max_pending=2,
                      quota=QuotaPolicy(budgets_hours={"a": 1}, period_s=7 * 86400))
    starts = {r.key: r.start_s for r in result.records}
    # b0 is not hidden behind a's held jobs at the head of the queue; each held job starts as a
    # new week's budget period begins (Monday 00:00 UTC: 4 days after the sim clock's 0), as the
    # executor, which offers its queue every cycle, would start it — not at the next arrival.
    monday, week = 4 * 86400.0, 7 * 86400.0
    assert starts == {"a0": 0.0, "b0": 10.0, "a1": monday, "a2": monday + week,
                      "a3": monday + 2 * week, "a4": monday + 3 * week}
    assert not result.unstarted
