"""The executor's preemptor over one cycle, with a real SQLite ledger: a multi-node gang preempts
only when every member fits afterwards on distinct nodes; victims get their notice and ledger
event; they are stopped (cleared) when they checkpoint or when the grace runs out.

The Airflow-facing edges (task log file, event-log row, clearing the task instance) are
recorded instead of run: ``tests/system/test_airflow_preemption_e2e.py`` runs them in real
Airflow.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _core_support import StubCore

from gpusched.airflow import gpu_preemption
from gpusched.airflow.gpu_preemption import Preemptor
from gpusched.gang import GangMember
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import Policy, RunningTask
from gpusched.quota.policy import QuotaPolicy, QuotaState
from gpusched.request import GPURequest, Partition
from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide
from gpusched.scheduler.keys import parse_ti_key, task_of

NOW = 50_000.0
RUN = "manual__r"
SETTINGS = {"preemption": "priority", "preemption_grace_seconds": "20",
            "preemption_min_runtime_seconds": "60"}


def _key(task: str) -> str:
    return f"airflow/d/{task}/-1/1/{RUN}"


def _running(task: str, node: str, indexes: list[int], priority: str) -> RunningTask:
    shares = tuple(DeviceShare(f"{node}-gpu{i}", node, i, 1000, 0) for i in indexes)
    return RunningTask(_key(task), GPURequest.build(gpus=len(indexes), priority=priority), shares,
                       NOW - 3600, None)


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    calls: dict[str, list[Any]] = {"log": [], "event": [], "requeue": []}
    monkeypatch.setattr(gpu_preemption, "append_task_log", lambda k, m, **kw: calls["log"].append((k, m)))
    monkeypatch.setattr(gpu_preemption, "save_task_event", lambda ex, **kw: calls["event"].append(kw))
    monkeypatch.setattr(gpu_preemption, "requeue", lambda k, reason: calls["requeue"].append(k) or "cleared")
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.migrate()
    yield ledger, calls
    ledger.close()


def _cycle(core: StubCore, running: list[RunningTask]) -> tuple[Any, Any]:
    from airflow.models.taskinstancekey import TaskInstanceKey

    fleet = FleetSnapshot(tuple(make_node(n, "A100-SXM-80GB", 4) for n in ("n0", "n1")))
    snapshot = fleet.with_usage(s for r in running for s in r.shares)
    for r in running:
        parts = parse_ti_key(r.key)
        assert parts is not None
        core.gpu_running[TaskInstanceKey("d", parts.task_id, RUN, 1, -1)] = r.key
    request = GPURequest.build(gpus=2, interconnect="same_node", priority="critical")
    members = tuple(PendingWork(_key(f"train__node{r}"), request, NOW - 10,
                                gang=GangMember(f"d/{RUN}/-1/train", 2, r, "any")) for r in range(2))
    cycle = CycleRequest(members, snapshot, Policy.named("gpusched"), tuple(running), NOW,
                         QuotaState.unlimited())
    return cycle, decide(cycle)


def test_a_gang_preempts_only_when_the_whole_gang_fits_on_distinct_nodes(setup: Any) -> None:
    ledger, calls = setup
    core = StubCore(ledger, SETTINGS)
    preemptor = Preemptor(core)
    # n0 is full of low-priority work, n1 runs a critical task: evicting n0 would free 4 GPUs on
    # ONE node; placement alone would fit both members there, the gang needs two nodes.
    running = [_running("low0a", "n0", [0, 1], "low"), _running("low0b", "n0", [2, 3], "low"),
               _running("peer", "n1", [0, 1, 2, 3], "critical")]
    cycle, reply = _cycle(core, running)
    assert reply.launches == () and len(reply.holds) == 2
    assert preemptor.consider(cycle, reply) == reply
    assert preemptor.evictions == {} and ledger.events(10, kinds=["preempted"]) == []
    assert calls["log"] == [] and calls["event"] == []

    # With low-priority work on n1 too, the gang preempts: one victim per node, fewest victims.
    core = StubCore(ledger, SETTINGS)
    preemptor = Preemptor(core)
    running[2] = _running("low1", "n1", [0, 1, 2, 3], "low")
    ledger.report_checkpoint(_key("low0b"), task_of(_key("low0b")), step=7, now=NOW - 30)
    cycle, reply = _cycle(core, running)
    after = preemptor.consider(cycle, reply)
    victims = sorted(preemptor.evictions)
    assert victims == [_key("low0b"), _key("low1")]  # low0b checkpointed 30 s ago: loses least
    assert all(h.reason.startswith("preempting ") for h in after.holds)
    events = ledger.events(10, kinds=["preempted"])
    assert sorted(e.subject for e in events) == victims
    assert all(e.detail["by"] == _key("train__node0") for e in events)
    proof = events[0].detail["proof"]
    assert {v[0].split(":")[0] for v in proof.values()} == {"n0", "n1"}  # the gang's proven nodes
    notice = ledger.checkpoint(_key("low1"))
    assert notice is not None and notice.notice_at == NOW
    assert "preempted for gang" in str(notice.notice_reason)
    assert len(calls["log"]) == 2 and all("does not use a retry" in m for _, m in calls["log"])
    assert [e["event"] for e in calls["event"]] == ["gpusched.preempted"] * 2

    # The next cycle does not preempt again while the victims stop.
    again = preemptor.consider(cycle, reply)
    assert all(h.reason.startswith("waiting for preempted") for h in again.holds)
    assert len(ledger.events(10, kinds=["preempted"])) == 2

    # low0b reports a checkpoint after its notice: stopped at once; low1 when the grace runs out.
    ledger.report_checkpoint(_key("low0b"), task_of(_key("low0b")), step=8, now=NOW + 3)
    preemptor.advance(NOW + 5)
    assert [k.task_id for k in calls["requeue"]] == ["low0b"]
    preemptor.advance(NOW + 21)
    assert [k.task_id for k in calls["requeue"]] == ["low0b", "low1"]
    preemptor.advance(NOW + 22)
    assert len(calls["requeue"]) == 2  # once each
    # Each process ended: the release reason names the preemption; then they are forgotten.
    assert str(preemptor.release_reason(_key("low1"))).startswith("preempted for gang")
    core.gpu_running.clear()
    preemptor.advance(NOW + 30)
    assert preemptor.evictions == {}


def test_a_victim_being_stopped_is_stopped_after_an_executor_restart(setup: Any) -> None:
    ledger, calls = setup
    core = StubCore(ledger, SETTINGS)
    running = [_running("low0", "n0", [0, 1, 2, 3], "low"), _running("low1", "n1", [0, 1, 2, 3], "low")]
    cycle, reply = _cycle(core, running)
    Preemptor(core).consider(cycle, reply)  # notices given; the executor stops before clearing
    assert len(ledger.events(10, kinds=["preempted"])) == 2 and calls["requeue"] == []

    # A new executor adopts the same running tries: it stops them as the first one would have,
    # grace counted from the notice, and the gang keeps waiting for them (no second selection).
    restarted = StubCore(ledger, SETTINGS)
    restarted.gpu_running.update(core.gpu_running)
    preemptor = Preemptor(restarted)
    preemptor.advance(NOW + 5)
    assert sorted(preemptor.evictions) == [_key("low0"), _key("low1")]
    assert {e.beneficiary for e in preemptor.evictions.values()} == {_key("train__node0")}
    assert list(preemptor.nominated) == [_key("train__node0")]  # its first pick once they end
    assert calls["requeue"] == []  # grace (20 s from the notice) not over
    again = preemptor.consider(*_cycle(restarted, running))
    assert all(h.reason.startswith("waiting for preempted") for h in again.holds)
    assert len(ledger.events(10, kinds=["preempted"])) == 2
    preemptor.advance(NOW + 21)
    assert sorted(k.task_id for k in calls["requeue"]) == ["low0", "low1"]
    assert len(ledger.events(10, kinds=["preemption_resumed"])) == 2
    # A running try without a notice is never taken for a victim.
    from airflow.models.taskinstancekey import TaskInstanceKey

    fresh = StubCore(ledger, SETTINGS)
    fresh.gpu_running.update(core.gpu_running)
    fresh.gpu_running[TaskInstanceKey("d", "clean", RUN, 1, -1)] = _key("clean")
    assert Preemptor(fresh).restore(NOW + 1) == [_key("low0"), _key("low1")]


def test_a_victim_selection_counts_the_devices_the_same_cycle_launches_on(setup: Any) -> None:
    ledger, _ = setup
    core = StubCore(ledger, SETTINGS)
    node = make_node("n0", "A100-SXM-80GB", 4)
    low = _running("low", "n0", [0, 1], "low")
    core.gpu_running[_airflow_key("low")] = low.key
    snapshot = FleetSnapshot((node,)).with_usage(low.shares)
    urgent = PendingWork(_key("urgent"), GPURequest.build(gpus=4, priority="critical"), NOW - 10)
    small = PendingWork(_key("small"), GPURequest.build(gpus=2, priority="normal"), NOW - 5)
    cycle = CycleRequest((urgent, small), snapshot, Policy.named("gpusched"), (low,), NOW,
                         QuotaState.unlimited())
    reply = decide(cycle)
    assert [launch.key for launch in reply.launches] == [small.key]  # backfills the 2 free GPUs
    # Stopping "low" frees 2 GPUs; the other 2 are the small task's from this very cycle, so the
    # urgent one would still not fit: nothing is stopped.
    after = Preemptor(core).consider(cycle, reply)
    assert after == reply and ledger.events(10, kinds=["preempted"]) == []
    seen = gpu_preemption.after_launches(cycle, reply)
    assert seen.snapshot.free_milli("n0-gpu2") == 0 and [r.key for r in seen.running] == [low.key, small.key]


def _airflow_key(task: str) -> Any:
    from airflow.models.taskinstancekey import TaskInstanceKey

    return TaskInstanceKey("d", task, RUN, 1, -1)


def test_the_beneficiary_has_the_first_pick_once_its_victims_have_ended(setup: Any) -> None:
    ledger, _ = setup
    core = StubCore(ledger, {**SETTINGS, "preemption": "partitions"})
    preemptor = Preemptor(core)
    fleet = FleetSnapshot((make_node("n0", "A100-SXM-80GB", 1), make_node("n1", "K80", 2)))
    a100 = GPURequest.build(gpus=1, models=["A100-SXM-80GB"], partition="dev")
    borrower = RunningTask(_key("borrow"), a100, (DeviceShare("n0-gpu0", "n0", 0, 1000, 0),),
                           NOW - 3600, None)
    core.gpu_running[_airflow_key("borrow")] = borrower.key
    reclaim = PendingWork(_key("reclaim"), replace(a100, partition=Partition.TRAINING), NOW - 10)
    policy, quota = Policy.named("gpusched"), QuotaState(QuotaPolicy())

    def cycle(pending: tuple[PendingWork, ...], running: tuple[RunningTask, ...], now: float) -> CycleRequest:
        snapshot = fleet.with_usage(s for r in running for s in r.shares)
        return preemptor.hold_nominated(CycleRequest(pending, snapshot, policy, running, now, quota))

    first = cycle((reclaim,), (borrower,), NOW)
    preemptor.consider(first, preemptor.decide(first))
    assert list(preemptor.evictions) == [borrower.key]  # training reclaims what dev borrowed

    # The borrower checkpointed and ended; its next try, aged from its first queue time, is
    # queued before the reclaimer and (borrowing while only one GPU is kept for training) would
    # take the A100 back: the reclaimer picks first.
    preemptor.advance(NOW + 30)
    core.gpu_running.clear()
    retry = PendingWork(_key("borrow").replace("/1/", "/2/"), a100, NOW - 3600)
    after = cycle((retry, reclaim), (), NOW + 35)
    assert [launch.key for launch in decide(after).launches] == [retry.key]  # plain queue order
    reply = preemptor.decide(after)
    assert [launch.key for launch in reply.launches] == [reclaim.key]
    assert [hold.key for hold in reply.holds] == [retry.key]
    assert preemptor.consider(after, reply) == reply  # nothing preempted twice
    assert len(ledger.events(10, kinds=["preempted"])) == 1
    # The first pick lasts one cycle: afterwards the queue order is the plain one again.
    again = cycle((retry,), (), NOW + 40)
    assert preemptor.first_pick == frozenset()
    assert [x.key for x in preemptor.decide(again).launches] == [retry.key]
