"""The scheduler's bounded batch (the simulator's backfill depth) against the executors' unbounded one.

The executors offer every queued task and the quota gate says why a budget holds one; a bounded
batch leaves out the tasks the gate would refuse anyway. Unbounded, both give the same launches.
"""

from __future__ import annotations

from gpusched.model import FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import Policy
from gpusched.quota.policy import UNITS_PER_A100_HOUR, QuotaPolicy, QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleReply, CycleRequest, PendingWork, decide
from gpusched.scheduler.quota import BoundedBatch

HOUR = 3600.0


def _fleet() -> FleetSnapshot:
    return FleetSnapshot(tuple(make_node(f"n{i}", "A100-SXM-80GB", 4) for i in range(2)))


def _state() -> QuotaState:
    """Tenant ``a`` has 0.5 of its 2 A100-hours left; ``b`` has no budget."""
    policy = QuotaPolicy(budgets_hours={"a": 2.0}, default_budget_hours=None)
    return QuotaState(policy, used={"a": round(1.5 * UNITS_PER_A100_HOUR)})


def _work(key: str, tenant: str, gpus: int, hours: float, at: float) -> PendingWork:
    req = GPURequest.build(gpus=gpus, tenant=tenant, expected_duration=f"{round(hours * 3600)}s")
    return PendingWork(key, req, at)


def _pending() -> tuple[PendingWork, ...]:
    return (
        _work("a-held-1", "a", 1, 1.0, 1.0),   # 1 A100-h > the 0.5 left: held until the period resets
        _work("a-held-2", "a", 2, 0.5, 2.0),
        _work("a-small", "a", 1, 0.25, 3.0),   # fits the 0.5 left
        _work("a-never", "a", 4, 1.0, 4.0),    # 4 A100-h > the whole budget: offered, failed for good
        _work("b-1", "b", 2, 1.0, 5.0),
        _work("b-2", "b", 1, 1.0, 6.0),
    )


def _decide(pending: tuple[PendingWork, ...], fleet: FleetSnapshot, state: QuotaState) -> CycleReply:
    return decide(CycleRequest(pending, fleet, Policy.named("gpusched"), (), 10.0, state))


def test_offer_leaves_out_exactly_the_tasks_their_budget_holds() -> None:
    fleet, state = _fleet(), _state()
    pending = _pending()
    offered = BoundedBatch(state.policy, fleet).offer(
        [w.task() for w in pending], state, fleet, (), 10.0, limit=len(pending))
    assert [t.key for t in offered] == ["a-small", "a-never", "b-1", "b-2"]


def test_unbounded_the_launches_are_the_executors() -> None:
    fleet, state = _fleet(), _state()
    pending = _pending()
    offered = {t.key for t in BoundedBatch(state.policy, fleet).offer(
        [w.task() for w in pending], state, fleet, (), 10.0, limit=len(pending))}
    everything = _decide(pending, fleet, state)
    batch = _decide(tuple(w for w in pending if w.key in offered), fleet, state)

    assert {x.key for x in everything.launches} == {"a-small", "b-1", "b-2"}
    assert [(x.key, x.shares) for x in batch.launches] == [(x.key, x.shares) for x in everything.launches]
    skipped = {w.key for w in pending} - offered
    held = {h.key: h for h in everything.holds}
    assert skipped == {"a-held-1", "a-held-2"}
    # every task the batch left out, the executors' gate holds for the budget (not for good)
    for key in skipped:
        assert not held[key].permanent and "tenant a used" in held[key].reason, held[key]
    assert held["a-never"].permanent and "exceeds the whole budget" in held["a-never"].reason


def test_a_bounded_batch_is_not_filled_by_budget_held_tasks() -> None:
    fleet, state = _fleet(), _state()
    pending = _pending()
    offered = BoundedBatch(state.policy, fleet).offer(
        [w.task() for w in pending], state, fleet, (), 10.0, limit=2)
    assert [t.key for t in offered] == ["a-small", "a-never"]
    unlimited = BoundedBatch(None, fleet).offer(
        [w.task() for w in pending], QuotaState.unlimited(), fleet, (), 10.0, limit=2)
    assert [t.key for t in unlimited] == ["a-held-1", "a-held-2"]
