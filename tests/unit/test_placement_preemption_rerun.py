"""What a victim by index (mode ``service``) must leave alone: checkpoint-aware victims
(``max_unsaved_s``, ``[gpusched] preemption_max_unsaved_seconds``: a running task with more run
time than the limit since its last checkpoint, else its start, is no victim; 0 is no limit) and
the minimum rerun of a restarted task (``min_rerun_s``, ``preemption_min_rerun_seconds``: a task
preempted before is no victim before it has run that long since its restart, even after a
checkpoint). A victim of lower priority is held back by neither."""

from __future__ import annotations

import pytest

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.preemption import NoPreemption, PreemptionPlan, PreemptionRequest, select_victims
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.preemption import PreemptionRules

NOW = 100_000.0
FLEET = FleetSnapshot((make_node("n0", "A100-SXM-80GB", 4),))


def _running(key: str, indexes: list[int], started: float, priority: str = "normal") -> RunningTask:
    shares = tuple(DeviceShare(f"n0-gpu{i}", "n0", i, 1000, 0) for i in indexes)
    return RunningTask(key, GPURequest.build(gpus=len(indexes), priority=priority), shares, started, None)


def _select(running: list[RunningTask], checkpoints: dict[str, float], limit: float,
            **kw: object) -> PreemptionPlan | NoPreemption:
    waiting = PendingTask("w", GPURequest.build(gpus=2), NOW - 5)
    used = FLEET.with_usage(s for r in running for s in r.shares)
    indices = {"w": 1e-2, **{r.key: 1e-6 for r in running}}  # every running task far below the waiting one
    return select_victims(PreemptionRequest(
        (waiting,), used, tuple(running), Policy.named("gpusched"), NOW, QuotaState.unlimited(),
        mode="service", min_runtime_s=60.0, checkpoints=checkpoints, indices=indices, max_unsaved_s=limit,
        **kw))  # type: ignore[arg-type]


def test_a_task_long_past_its_checkpoint_is_no_victim_one_just_saved_is() -> None:
    running = [_running("stale", [0, 1], NOW - 7200), _running("saved", [2, 3], NOW - 7200)]
    # "stale" ran 1,000 s since its checkpoint, past the 900 s limit; "saved" 100 s.
    checkpoints = {"stale": NOW - 1000, "saved": NOW - 100}
    plan = _select(running, checkpoints, 900.0)
    assert isinstance(plan, PreemptionPlan) and [v.key for v in plan.victims] == ["saved"]
    assert plan.lost_gpu_s == pytest.approx(200.0)  # 100 s × 2 GPUs


def test_no_victim_within_the_limit_says_why() -> None:
    running = [_running("a", [0, 1], NOW - 7200), _running("b", [2, 3], NOW - 3000)]  # b never checkpointed
    outcome = _select(running, {"a": NOW - 2000}, 900.0)
    assert isinstance(outcome, NoPreemption)
    assert "2 ran more than 900 s since their last checkpoint" in outcome.reason


def test_a_lower_priority_victim_is_not_held_back() -> None:
    running = [_running("low", [0, 1], NOW - 7200, priority="low"), _running("b", [2, 3], NOW - 3000)]
    plan = _select(running, {"low": NOW - 2000}, 900.0, restarted=frozenset({"low"}), min_rerun_s=1e6)
    assert isinstance(plan, PreemptionPlan) and [v.key for v in plan.victims] == ["low"]


def test_zero_is_no_limit() -> None:
    running = [_running("a", [0, 1], NOW - 7200), _running("b", [2, 3], NOW - 3000)]
    plan = _select(running, {"a": NOW - 2000}, 0.0)
    assert isinstance(plan, PreemptionPlan) and [v.key for v in plan.victims] == ["a"]  # 2,000 < 3,000 s


def test_a_restarted_task_is_no_victim_before_its_minimum_rerun_even_after_a_checkpoint() -> None:
    # Both restarted 3,000 s ago and checkpointed since; "old" never was preempted.
    running = [_running("back", [0, 1], NOW - 3000), _running("old", [2, 3], NOW - 3000)]
    checkpoints = {"back": NOW - 10, "old": NOW - 500}
    plain = _select(running, checkpoints, 0.0, restarted=frozenset({"back"}))
    assert isinstance(plain, PreemptionPlan) and [v.key for v in plain.victims] == ["back"]  # least lost
    held = _select(running, checkpoints, 0.0, restarted=frozenset({"back"}), min_rerun_s=7200.0)
    assert isinstance(held, PreemptionPlan) and [v.key for v in held.victims] == ["old"]
    later = [_running("back", [0, 1], NOW - 8000), _running("old", [2, 3], NOW - 3000)]
    again = _select(later, checkpoints, 0.0, restarted=frozenset({"back"}), min_rerun_s=7200.0)
    assert isinstance(again, PreemptionPlan) and [v.key for v in again.victims] == ["back"]
    alone = _select([*running[:1], _running("young", [2, 3], NOW - 30)], checkpoints, 0.0,
                    restarted=frozenset({"back"}), min_rerun_s=7200.0)
    assert isinstance(alone, NoPreemption)
    assert "1 restarted after a preemption less than 7200 s ago" in alone.reason


@pytest.mark.parametrize(("name", "setting"), [
    ("grace_s", "preemption_grace_seconds"), ("min_runtime_s", "preemption_min_runtime_seconds"),
    ("max_unsaved_s", "preemption_max_unsaved_seconds"), ("min_rerun_s", "preemption_min_rerun_seconds")])
def test_the_rules_refuse_a_negative_limit_naming_its_setting(name: str, setting: str) -> None:
    with pytest.raises(ValueError, match=rf"^\[gpusched\] {setting} = -1.0 must be seconds >= 0 \("):
        PreemptionRules("priority", **{name: -1.0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=setting):
        PreemptionRules("priority", **{name: float("nan")})  # type: ignore[arg-type]


def test_the_executor_names_the_setting_of_a_negative_limit() -> None:
    from _core_support import GpuschedConf, StubCore

    from gpusched.airflow.gpu_preemption import Preemptor
    from gpusched.errors import ConfigurationError

    for setting in ("preemption_grace_seconds", "preemption_min_rerun_seconds"):
        core = StubCore(None, {"preemption": "priority", setting: "-5"})  # type: ignore[arg-type]
        assert isinstance(core.conf, GpuschedConf)
        with pytest.raises(ConfigurationError, match=rf"^\[gpusched\] {setting} = -5.0 must be seconds >= 0"):
            Preemptor(core)
