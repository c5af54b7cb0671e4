"""Victim selection for preemption (pure): lower priority or borrowed partition capacity only,
fresh tasks protected, least work lost and fewest victims, and the fit proven before a plan."""

from __future__ import annotations

import pytest

from gpusched.errors import ConfigurationError
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.preemption import (
    NoPreemption,
    PreemptionPlan,
    PreemptionRequest,
    check_mode,
    select_victims,
)
from gpusched.quota.policy import QuotaPolicy, QuotaState
from gpusched.request import GPURequest

NOW = 10_000.0


def _fleet(nodes: int = 1, gpus: int = 4) -> FleetSnapshot:
    return FleetSnapshot(tuple(make_node(f"n{i}", "A100-SXM-80GB", gpus) for i in range(nodes)))


def _running(snapshot: FleetSnapshot, key: str, node: str, indexes: list[int], *, priority: str = "low",
             started: float = NOW - 3600, partition: str = "training") -> RunningTask:
    shares = tuple(DeviceShare(f"{node}-gpu{i}", node, i, 1000, 0) for i in indexes)
    request = GPURequest.build(gpus=len(indexes), priority=priority, partition=partition)
    return RunningTask(key, request, shares, started, None)


def _request(snapshot: FleetSnapshot, running: list[RunningTask], waiting: list[PendingTask], **kw: object
             ) -> PreemptionRequest:
    used = snapshot.with_usage(s for r in running for s in r.shares)
    fields: dict[str, object] = {"mode": "priority", "min_runtime_s": 60.0, "quota": QuotaState.unlimited()}
    fields.update(kw)
    return PreemptionRequest(tuple(waiting), used, tuple(running), Policy.named("gpusched"), NOW,
                             **fields)  # type: ignore[arg-type]


def _critical(key: str = "crit", gpus: int = 2, **kw: object) -> PendingTask:
    return PendingTask(key, GPURequest.build(gpus=gpus, priority="critical", **kw), NOW - 5)


def test_a_critical_task_preempts_the_lower_priority_task_that_loses_least_work() -> None:
    fleet = _fleet()
    running = [_running(fleet, "old", "n0", [0, 1], started=NOW - 7200),
               _running(fleet, "ckpt", "n0", [2, 3], started=NOW - 7200)]
    # "ckpt" checkpointed a minute ago: stopping it loses 2 GPU-minutes, "old" would lose 4 GPU-hours.
    plan = select_victims(_request(fleet, running, [_critical()], checkpoints={"ckpt": NOW - 60}))
    assert isinstance(plan, PreemptionPlan), plan
    assert [v.key for v in plan.victims] == ["ckpt"]
    assert plan.victims[0].lost_gpu_s == pytest.approx(120.0)
    # The placement that justified it is on the victim's devices.
    assert {s.uuid for s in plan.placement["crit"]} == {"n0-gpu2", "n0-gpu3"}


def test_fewest_victims_that_make_room() -> None:
    fleet = _fleet()
    running = [_running(fleet, f"t{i}", "n0", [i], started=NOW - 600 - i) for i in range(4)]
    plan = select_victims(_request(fleet, running, [_critical(gpus=2)]))
    assert isinstance(plan, PreemptionPlan)
    assert len(plan.victims) == 2


def test_equal_or_higher_priority_and_fresh_tasks_are_never_victims() -> None:
    fleet = _fleet()
    running = [_running(fleet, "peer", "n0", [0, 1], priority="critical"),
               _running(fleet, "fresh", "n0", [2, 3], started=NOW - 10)]
    verdict = select_victims(_request(fleet, running, [_critical()]))
    assert isinstance(verdict, NoPreemption)
    assert "no running task of lower priority than 100" in verdict.reason
    assert "1 ran for less than the 60 s minimum" in verdict.reason


def test_a_restarted_task_is_no_victim_again_until_it_has_checkpointed_since_its_restart() -> None:
    fleet = _fleet()
    # "again" was preempted before and restarted an hour ago without checkpointing since: it would
    # lose the least work, and would be stopped again with nothing saved; "old" is taken instead.
    running = [_running(fleet, "again", "n0", [0, 1], started=NOW - 3600),
               _running(fleet, "old", "n0", [2, 3], started=NOW - 7200)]
    restarted = frozenset({"again"})
    plan = select_victims(_request(fleet, running, [_critical()], restarted=restarted,
                                   checkpoints={"again": NOW - 5400}))  # its checkpoint predates the restart
    assert isinstance(plan, PreemptionPlan) and [v.key for v in plan.victims] == ["old"]
    # Alone, it is not a victim, and the reason says why.
    verdict = select_victims(_request(fleet, running[:1], [_critical(gpus=4)], restarted=restarted))
    assert isinstance(verdict, NoPreemption)
    assert "1 preempted before and not checkpointed since restarting" in verdict.reason
    # Once it has checkpointed since the restart it is a victim like any other (least work lost).
    plan = select_victims(_request(fleet, running, [_critical()], restarted=restarted,
                                   checkpoints={"again": NOW - 60}))
    assert isinstance(plan, PreemptionPlan) and [v.key for v in plan.victims] == ["again"]


def test_no_victim_is_stopped_when_the_waiting_task_would_not_fit_anyway() -> None:
    fleet = _fleet()
    running = [_running(fleet, "low", "n0", [0, 1])]
    verdict = select_victims(_request(fleet, running, [_critical(gpus=8)]))
    assert isinstance(verdict, NoPreemption)
    assert verdict.reason.startswith("stopping all 1 task(s) it may preempt would still not make room")


def test_protected_tasks_and_off_mode() -> None:
    fleet = _fleet()
    running = [_running(fleet, "low", "n0", [0, 1, 2, 3])]
    assert isinstance(select_victims(_request(fleet, running, [_critical()], protected=frozenset({"low"}))),
                      NoPreemption)
    assert select_victims(_request(fleet, running, [_critical()], mode="off")) == NoPreemption(
        "preemption is off")
    with pytest.raises(ConfigurationError, match="is not one of off, priority, partitions"):
        check_mode("sometimes")


def test_a_gang_preempts_only_when_every_member_fits_afterwards() -> None:
    fleet = _fleet(nodes=2, gpus=2)
    running = [_running(fleet, "low0", "n0", [0, 1]),
               _running(fleet, "high1", "n1", [0, 1], priority="critical")]
    members = [_critical(f"m{i}", gpus=2) for i in range(2)]
    # Evicting low0 would make room for one member only: nothing is stopped.
    verdict = select_victims(_request(fleet, running, members))
    assert isinstance(verdict, NoPreemption) and "would still not make room" in verdict.reason
    running[1] = _running(fleet, "low1", "n1", [0, 1])
    plan = select_victims(_request(fleet, running, members))
    assert isinstance(plan, PreemptionPlan)
    assert {v.key for v in plan.victims} == {"low0", "low1"} and set(plan.placement) == {"m0", "m1"}


def test_a_custom_prover_decides_the_fit() -> None:
    fleet = _fleet()
    running = [_running(fleet, "low", "n0", [0, 1, 2, 3])]
    calls: list[int] = []

    def never(snapshot: FleetSnapshot, rest: object) -> tuple[None, str]:
        calls.append(1)
        return None, "the gang prover says no"

    verdict = select_victims(_request(fleet, running, [_critical()]), never)
    assert isinstance(verdict, NoPreemption) and verdict.reason.endswith("the gang prover says no")
    assert calls


def test_partitions_mode_reclaims_borrowed_capacity_at_equal_priority() -> None:
    fleet = _fleet(nodes=1, gpus=10)
    quota = QuotaState(QuotaPolicy())  # 70/20/10 with borrowing
    # dev borrowed: it runs 6 GPUs (share 1); training runs 4 (share 7) and wants 3 more.
    running = [_running(fleet, "dev-a", "n0", [0, 1, 2], priority="normal", partition="dev"),
               _running(fleet, "dev-b", "n0", [3, 4, 5], priority="normal", partition="dev",
                        started=NOW - 100),
               _running(fleet, "train", "n0", [6, 7, 8, 9], priority="normal")]
    waiting = [PendingTask("t2", GPURequest.build(gpus=3, priority="normal"), NOW - 5)]
    assert isinstance(select_victims(_request(fleet, running, waiting, quota=quota)), NoPreemption)
    plan = select_victims(_request(fleet, running, waiting, quota=quota, mode="partitions"))
    assert isinstance(plan, PreemptionPlan), plan
    assert [v.key for v in plan.victims] == ["dev-b"]  # the younger borrower loses less
    assert "borrowed" in plan.victims[0].reason
    # Training beyond its own share does not reclaim: nothing to take back.
    waiting = [PendingTask("t8", GPURequest.build(gpus=8, priority="normal"), NOW - 5)]
    assert isinstance(select_victims(_request(fleet, running, waiting, quota=quota, mode="partitions")),
                      NoPreemption)
