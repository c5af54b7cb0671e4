"""The in-memory store answers the scheduler's reads as the ledger does: each tenant's use of a
period (kept incrementally) equals the quota rule's recount over the store's own history."""

from __future__ import annotations

import random

from gpusched.model import DeviceShare
from gpusched.quota.policy import QuotaPolicy
from gpusched.quota.usage import period_start, spans_of, tenant_usage
from gpusched.request import GPURequest
from gpusched.scheduler.quota import quota_at
from gpusched.scheduler.store import InMemoryStore
from gpusched.sim.fleets import uniform_fleet


def test_tenant_use_matches_the_recount_across_periods() -> None:
    rng = random.Random(7)
    fleet = uniform_fleet(4, 8, "P100")
    devices = list(fleet.devices())
    policy = QuotaPolicy(period_s=86400)  # short periods: many resets inside the run
    store = InMemoryStore(fleet)
    ends: dict[str, float] = {}
    now = 0.0
    got = None
    for i in range(300):
        now += rng.expovariate(1 / 1800)
        for key in [k for k, end in ends.items() if end <= now]:  # runs that ended meanwhile
            store.release(key, reason="task succeeded", now=ends.pop(key), succeeded=True)
        key = f"j{i}"
        free = [d for d in devices if store.snapshot.free_milli(d.uuid) == 1000]
        picked = rng.sample(free, min(len(free), rng.randint(1, 4)))
        if not picked:
            continue
        shares = tuple(DeviceShare(d.uuid, d.node, d.index, 1000, 0) for d in picked)
        request = GPURequest(count=len(shares), tenant=rng.choice(["a", "b", "c"]))
        store.allocate(key, request, shares, now=now)
        ends[key] = now + rng.expovariate(1 / 20000)
        if i % 5 == 0 and ends[key] > now + 60:  # stopped a minute later (preempted)
            now += 60
            store.release(key, reason="preempted", now=now)
            del ends[key]
        if i % 7 == 0:
            now += rng.choice([0.0, 3600.0, 2 * 86400.0])  # a pass later, sometimes periods later
            for key in [k for k, end in ends.items() if end <= now]:
                store.release(key, reason="task succeeded", now=ends.pop(key), succeeded=True)
        start = period_start(now, policy.period_s)
        expected = tenant_usage(spans_of(store.history(start, now)), fleet, start, now)
        got = quota_at(policy, store, fleet, now)
        assert got.period_start == start
        assert dict(got.used) == expected, (i, now)
    assert got is not None and any(v > 0 for v in got.used.values())


def test_without_a_policy_the_quota_is_unlimited() -> None:
    fleet = uniform_fleet(1, 8, "P100")
    assert not quota_at(None, InMemoryStore(fleet), fleet, 10.0).enforced


def test_reads_of_the_port() -> None:
    fleet = uniform_fleet(1, 4, "A100")
    store = InMemoryStore(fleet, addresses={"n0": "10.0.0.1"})
    d0, d1 = list(fleet.devices())[:2]
    one = (DeviceShare(d0.uuid, d0.node, d0.index, 1000, 0),)
    store.allocate("a", GPURequest(count=1), one, now=10.0)
    store.allocate("b", GPURequest(count=1), (DeviceShare(d1.uuid, d1.node, d1.index, 500, 0),), now=20.0)
    store.release("a", reason="task succeeded", now=30.0, succeeded=True)
    store.record_checkpoint("b", 25.0)
    snapshot, active = store.cycle_view(40.0)
    assert [a.key for a in active] == ["b"] and snapshot.free_milli(d0.uuid) == 1000
    assert snapshot.free_milli(d1.uuid) == 500
    assert store.get("a") is not None and store.get("a").released_at == 30.0  # type: ignore[union-attr]
    assert [a.key for a in store.history(29.0)] == ["a", "b"]
    assert [a.key for a in store.history(31.0)] == ["b"]
    assert [a.key for a in store.history(0.0, 15.0)] == ["a"]
    assert [a.key for a in store.history_of([("a", "")])] == ["a"]
    assert store.checkpoint_times(["a", "b"]) == {"b": 25.0}
    assert store.node_addresses() == {"n0": "10.0.0.1"}


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
