"""``[gpusched] preemption = service`` in the executor's cycle, with a real SQLite ledger: the
run-time distributions come from the ledger's finished allocations (``DurationHistory``); the
queue is ordered by the Gittins index; a held task preempts a running task of its own priority
that has outlived most runs of its kind, and never one whose index is not lower by the margin.

The Airflow-facing edges (task log, event-log row, clearing) are recorded instead of run, as in
``test_airflow_preemption_cycle.py``; ``tests/system/test_airflow_preemption_e2e.py`` runs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _core_support import GpuschedConf, StubCore

from gpusched.airflow import gpu_preemption
from gpusched.airflow.gpu_inputs import read_cycle_request
from gpusched.airflow.gpu_preemption import Preemptor
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import Policy, RunningTask
from gpusched.placement.warm import WarmPlacement
from gpusched.placement.workload import SteadyWorkload
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.attained import AttainedService
from gpusched.scheduler.cycle import CycleRequest, PendingWork, RunningTasks, decide
from gpusched.scheduler.durations import DurationHistory
from gpusched.scheduler.keys import parse_ti_key, task_of, ti_key

NOW = 5_000_000.0
ONE = GPURequest.build(gpus=1)
FLEET = FleetSnapshot((make_node("n0", "A100-SXM-80GB", 1),))
DEVICE = DeviceShare("n0-gpu0", "n0", 0, 1000, 0)
SETTINGS = {"preemption": "service", "preemption_grace_seconds": "20",
            "preemption_min_runtime_seconds": "60"}


class _Core(StubCore):
    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger, SETTINGS)
        self.durations = DurationHistory(30.0, 60.0, service_history=True)


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(gpu_preemption, "append_task_log", lambda k, m, **kw: None)
    monkeypatch.setattr(gpu_preemption, "save_task_event", lambda ex, **kw: None)
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    led.migrate()
    led.sync_inventory(FLEET.nodes, "test", now=NOW - 30 * 86400)
    # The past: d/train ran 30 times, 27 of them a minute, 3 ten hours; d/long always ten hours.
    runs = [("train", 60.0)] * 27 + [("train", 36_000.0)] * 3 + [("long", 36_000.0)] * 20
    for i, (task, run) in enumerate(runs):
        key, start = ti_key("d", task, f"scheduled__{i}", 1, -1), NOW - 86400.0 * 20 + i * 20_000.0
        led.allocate(key, ONE, [DEVICE], holder="old", now=start)
        led.release(key, reason="task succeeded", now=start + run, succeeded=True)
    yield led
    led.close()


def _cycle(core: _Core, running_for_s: float, *waiting: str) -> tuple[CycleRequest, Any, Preemptor]:
    from airflow.models.taskinstancekey import TaskInstanceKey

    key = ti_key("d", "train", "manual__now", 1, -1)
    running = RunningTask(key, ONE, (DEVICE,), NOW - running_for_s, None)
    parts = parse_ti_key(key)
    assert parts is not None
    core.gpu_running[TaskInstanceKey("d", "train", "manual__now", 1, -1)] = key
    pending = tuple(PendingWork(ti_key("d", task, "manual__w", 1, -1), ONE, NOW - 10 + n)
                    for n, task in enumerate(waiting))
    preemptor = Preemptor(core)
    core.durations.predictor(core.ledger, NOW)  # the cycle reads the history (DurationHistory.apply)
    cycle = preemptor.rank(CycleRequest(pending, FLEET.with_usage([DEVICE]), Policy.named("gpusched"),
                                        (running,), NOW, QuotaState.unlimited()))
    return cycle, decide(cycle), preemptor


def test_a_task_that_outlived_its_kind_is_preempted_by_a_fresh_one(ledger: Ledger) -> None:
    core = _Core(ledger)
    # The running d/train has had 2 h: longer than 90 % of d/train's runs. A fresh d/train
    # (90 % chance to end within a minute) preempts it; a fresh d/long (always ten hours) may not.
    cycle, reply, preemptor = _cycle(core, 7200.0, "long", "train")
    assert cycle.policy.queue_order.value == "ranked"
    assert [w.key.split("/")[2] for w in sorted(cycle.pending, key=lambda w: w.rank)] == ["train", "long"]
    # It has not checkpointed in its two hours (preemption_max_unsaved_seconds, 600 by default):
    # stopping it would throw them away, so it is no victim by index until it saves its work.
    victim = ti_key("d", "train", "manual__now", 1, -1)
    assert preemptor.consider(cycle, reply) == reply and preemptor.evictions == {}
    ledger.report_checkpoint(victim, task_of(victim), step=7, now=NOW - 100.0)
    after = preemptor.consider(cycle, reply)
    assert list(preemptor.evictions) == [victim]
    assert preemptor.evictions[victim].beneficiary == ti_key("d", "train", "manual__w", 1, -1)
    (event,) = ledger.events(10, kinds=["preempted"])
    assert event.subject == victim and "expected-service index" in event.detail["reason"]
    holds = {h.key.split("/")[2]: h.reason for h in after.holds}
    assert holds["train"].startswith("preempting ")


def test_never_for_an_index_that_is_not_higher_by_the_margin(ledger: Ledger) -> None:
    core = _Core(ledger)
    cycle, reply, preemptor = _cycle(core, 7200.0, "long")
    assert preemptor.consider(cycle, reply) == reply and preemptor.evictions == {}
    assert ledger.events(10, kinds=["preempted"]) == []
    # A running task younger than the minimum run time is never a victim either.
    cycle, reply, preemptor = _cycle(_Core(ledger), 30.0, "train")
    assert preemptor.consider(cycle, reply) == reply and preemptor.evictions == {}


class _CycleCore(_Core):
    """The stand-in core plus what the executor's cycle inputs read (``gpu_inputs``)."""

    def __init__(self, ledger: Ledger) -> None:
        super().__init__(ledger)
        self.policy = Policy.named("gpusched")
        self.attained = AttainedService()
        self.preemption = Preemptor(self)
        self.predicted: dict[str, Any] = {}
        self.use_uuids, self.replan_budget_ms, self.replan_weights = False, 0.0, (1.0, 1.0, 0.1)
        self.warm, self.steady, self.kept_running = WarmPlacement(), SteadyWorkload(0.1), RunningTasks()
        self.dispatcher = _OneHost()  # the local executor's: no worker slots to count
        self.slot_notes: list[str] = []


class _OneHost:
    def full_nodes(self, active: Any) -> dict[str, str]:
        return {}


class _SlotsFull:
    """A dispatcher whose hosts in ``full`` have every worker slot busy."""

    def __init__(self) -> None:
        self.full: dict[str, str] = {}

    def full_nodes(self, active: Any) -> dict[str, str]:
        return dict(self.full)


def test_a_host_whose_worker_slots_are_all_busy_is_closed_for_the_cycle_not_cordoned(ledger: Ledger) -> None:
    core = _CycleCore(ledger)
    slots = core.dispatcher = _SlotsFull()  # type: ignore[assignment]
    waiting = [PendingWork(ti_key("d", "train", "manual__w", 1, -1), ONE, NOW - 10)]
    cycle = read_cycle_request(core, waiting, NOW)
    assert cycle.snapshot.closed == frozenset()
    assert [x.key for x in decide(cycle).launches] == [waiting[0].key]
    slots.full = {"n0": "host h0: 2 of 2 worker slots busy"}
    busy = read_cycle_request(core, waiting, NOW)
    # The node takes nothing this cycle; the inventory is the same (the warm engine and its index
    # stay), and the partitions would still count it.
    assert busy.snapshot.closed == frozenset({"n0"})
    assert busy.snapshot.nodes is cycle.snapshot.nodes and not busy.snapshot.node("n0").cordoned
    reply = decide(busy)
    assert reply.launches == () and "1 cordoned" in reply.holds[0].reason, reply.holds[0].reason
    slots.full = {}
    assert [x.key for x in decide(read_cycle_request(core, waiting, NOW)).launches] == [waiting[0].key]
    assert (core.warm.built, core.warm.rebased) == (1, 2)


def _executor_cycle(core: _CycleCore, *waiting: tuple[str, int]) -> tuple[CycleRequest, Any]:
    """One cycle as ``GPUScheduling._schedule`` runs it: inputs read from the ledger, ranked,
    decided, then the preemption step; ``waiting``: (run id, try number) of d/train tries."""
    pending = [PendingWork(ti_key("d", "train", run, try_number, -1), ONE, NOW - 10 + n)
               for n, (run, try_number) in enumerate(waiting)]
    cycle = core.preemption.rank(read_cycle_request(core, pending, NOW))
    return cycle, core.preemption.consider(cycle, decide(cycle))


def _preempted_earlier(ledger: Ledger, run: str, ran_s: float) -> None:
    """Try 1 of d/train in ``run`` ran ``ran_s`` on the device and was preempted (requeued)."""
    key = ti_key("d", "train", run, 1, -1)
    ledger.allocate(key, ONE, [DEVICE], holder="old", now=NOW - ran_s - 300)
    ledger.release(key, reason="preempted for someone; requeued", now=NOW - 300)


def test_a_requeued_try_keeps_the_service_its_earlier_tries_attained(ledger: Ledger) -> None:
    from airflow.models.taskinstancekey import TaskInstanceKey

    core = _CycleCore(ledger)
    _preempted_earlier(ledger, "manual__p", 7200.0)
    running = ti_key("d", "train", "manual__now", 1, -1)
    ledger.allocate(running, ONE, [DEVICE], holder="sched", now=NOW - 7200.0)
    ledger.report_checkpoint(running, task_of(running), step=7, now=NOW - 100.0)  # little work to lose
    core.gpu_running[TaskInstanceKey("d", "train", "manual__now", 1, -1)] = running
    # Try 2 of manual__p has had two hours already: it is no fresher than the running task and
    # does not take its device (a fresh try 2 would, and the two would thrash).
    cycle, reply = _executor_cycle(core, ("manual__p", 2))
    again = ti_key("d", "train", "manual__p", 2, -1)
    assert cycle.attained_gpu_s[again] == pytest.approx(7200.0)
    assert cycle.attained_gpu_s[running] == 0.0  # its first try
    assert core.preemption.evictions == {} and ledger.events(10, kinds=["preempted"]) == []
    assert [h.key for h in reply.holds] == [again]
    # A fresh d/train does preempt it; in the queue it goes before the requeued try.
    cycle, _ = _executor_cycle(core, ("manual__p", 2), ("manual__w", 1))
    assert [w.key.split("/")[-1] for w in sorted(cycle.pending, key=lambda w: w.rank)] == [
        "manual__w", "manual__p"]
    assert list(core.preemption.evictions) == [running]
    assert core.preemption.evictions[running].beneficiary == ti_key("d", "train", "manual__w", 1, -1)


def test_a_try_requeued_by_preemption_is_not_stopped_again_before_it_checkpoints(ledger: Ledger) -> None:
    from airflow.models.taskinstancekey import TaskInstanceKey

    core = _CycleCore(ledger)
    first = ti_key("d", "train", "manual__p", 1, -1)
    ledger.allocate(first, ONE, [DEVICE], holder="old", now=NOW - 9000.0)
    ledger.release(first, reason="preempted for someone; requeued", now=NOW - 7300.0)
    again = ti_key("d", "train", "manual__p", 2, -1)
    ledger.allocate(again, ONE, [DEVICE], holder="sched", now=NOW - 7200.0)
    core.gpu_running[TaskInstanceKey("d", "train", "manual__p", 2, -1)] = again
    # Try 2 has outlived most d/train runs (a fresh d/train outranks it by far), but it was
    # preempted before and has not checkpointed since it started: it is not stopped again.
    _, reply = _executor_cycle(core, ("manual__w", 1))
    assert core.preemption.evictions == {} and ledger.events(10, kinds=["preempted"]) == []
    assert [h.key for h in reply.holds] == [ti_key("d", "train", "manual__w", 1, -1)]
    # A checkpoint from try 1 does not count; one from this try does.
    ledger.report_checkpoint(first, task_of(first), step=3, now=NOW - 7400.0)
    _executor_cycle(core, ("manual__w", 1))
    assert core.preemption.evictions == {}
    ledger.report_checkpoint(again, task_of(again), step=9, now=NOW - 60.0)
    _executor_cycle(core, ("manual__w", 1))
    assert list(core.preemption.evictions) == [again]


def test_a_later_try_waits_as_if_queued_when_its_first_try_was(ledger: Ledger) -> None:
    first = ti_key("d", "train", "manual__p", 1, -1)
    ledger.allocate(first, ONE, [DEVICE], holder="old", now=NOW - 8000.0, queued_at=NOW - 9000.0)
    ledger.release(first, reason="preempted for someone; requeued", now=NOW - 300.0)
    older = ti_key("d", "train", "manual__o", 1, -1)  # written before queue times were recorded
    ledger.allocate(older, ONE, [DEVICE], holder="old", now=NOW - 200.0)
    ledger.release(older, reason="preempted for someone; requeued", now=NOW - 100.0)
    core = _CycleCore(ledger)
    cycle, _ = _executor_cycle(core, ("manual__p", 2), ("manual__o", 2), ("manual__w", 1))
    submitted = {w.key.split("/")[-1]: w.submitted_at for w in cycle.pending}
    # Try 2 ages from try 1's queue time (else its start); a first try from its own sighting.
    assert submitted == {"manual__p": NOW - 9000.0, "manual__o": NOW - 200.0, "manual__w": NOW - 8.0}
    stored = ledger.get(first)
    assert stored is not None and stored.queued_at == NOW - 9000.0  # round-trips through the ledger


def test_other_modes_read_no_attained_service_and_keep_no_service_history(ledger: Ledger) -> None:
    _preempted_earlier(ledger, "manual__p", 7200.0)
    history = {"duration_history_days": "30", "duration_refresh_seconds": "60"}
    for mode, learned in (("priority", 0), ("partitions", 0), ("migrate", 0), ("off", 0), ("service", 50)):
        durations = DurationHistory.from_settings(GpuschedConf({**history, "preemption": mode}))
        assert durations.predictor(ledger, NOW) is not None  # predicted durations in every mode
        assert durations.service.learned == learned, mode
    core = _CycleCore(ledger)
    core.preemption.mode = "priority"
    cycle, _ = _executor_cycle(core, ("manual__p", 2))
    assert cycle.attained_gpu_s == {}


def test_attained_service_is_read_once_per_try_when_final(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    _preempted_earlier(ledger, "manual__p", 600.0)
    _preempted_earlier(ledger, "weird%_run/x", 60.0)  # LIKE wildcards and '/' in a run id
    live = ti_key("d", "train", "manual__q", 1, -1)
    ledger.allocate(live, ONE, [DEVICE], holder="sched", now=NOW - 100.0)
    reads: list[int] = []
    real = ledger.history_of
    monkeypatch.setattr(ledger, "history_of", lambda patterns: reads.append(len(patterns)) or real(patterns))
    attained = AttainedService()
    keys = [ti_key("d", "train", r, 2, -1) for r in ("manual__p", "weird%_run/x", "manual__q", "x")]
    keys.append(ti_key("d", "train", "manual__p", 1, -1))
    got = attained.earlier_tries(ledger, keys, NOW)
    assert got == {keys[0]: pytest.approx(600.0), keys[1]: pytest.approx(60.0), keys[2]: pytest.approx(100.0),
                   keys[3]: 0.0, keys[4]: 0.0}
    assert reads == [4]  # one read for the tries after the first
    assert attained.earlier_tries(ledger, keys, NOW + 50)[keys[2]] == pytest.approx(150.0)
    assert reads == [4, 1]  # try 1 of manual__q still holds devices: read again; the others are final
