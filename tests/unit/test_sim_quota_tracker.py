"""The simulator's incremental quota state equals the executor's recount over every started job."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpusched.model import DeviceShare
from gpusched.quota.policy import QuotaPolicy
from gpusched.request import GPURequest
from gpusched.sim.fleets import uniform_fleet
from gpusched.sim.quota import QuotaTracker, quota_state_at


@dataclass(frozen=True)
class _Job:
    request: GPURequest


@dataclass(frozen=True)
class _Record:
    key: str
    start_s: float
    end_s: float
    shares: tuple[DeviceShare, ...]


def test_tracker_matches_the_recount_across_periods() -> None:
    rng = random.Random(7)
    fleet = uniform_fleet(4, 8, "P100")
    devices = list(fleet.devices())
    policy = QuotaPolicy(period_s=86400)  # short periods: many resets inside the run
    jobs: dict[str, _Job] = {}
    records: dict[str, _Record] = {}
    tracker = QuotaTracker(policy, jobs, fleet)
    now = 0.0
    for i in range(300):
        now += rng.expovariate(1 / 1800)
        key = f"j{i}"
        jobs[key] = _Job(GPURequest(count=1, tenant=rng.choice(["a", "b", "c"])))
        picked = rng.sample(devices, rng.randint(1, 4))
        shares = tuple(DeviceShare(d.uuid, d.node, d.index, 1000, 0) for d in picked)
        records[key] = _Record(key, now, now + rng.expovariate(1 / 20000), shares)
        tracker.started(records[key])
        if i % 5 == 0 and records[key].end_s > now + 60:  # preempted a minute later, restarted
            now += 60
            del records[key]
            tracker.dropped(key)
            recount = quota_state_at(policy, records, jobs, fleet, now)
            assert dict(tracker.state_at(now).used) == dict(recount.used)
            records[key] = _Record(key, now - 60, now + 600, shares)  # first start kept, as the engine does
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
    # b0 is not hidden behind a's held jobs at the head of the queue.
    assert starts == {"a0": 0.0, "b0": 10.0} and sorted(result.unstarted) == ["a1", "a2", "a3", "a4"]
