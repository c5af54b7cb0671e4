"""GPUExecutor in-process against a real ledger and a migrated Airflow DB (no worker processes).

The workers' queue is inspected directly: GPU workloads arrive as (workload, env) pairs once the
ledger holds their allocation; the rest pass through untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from _airflow_support import gpu_workload, queue_reading_executor
from _ledger_support import budget_period_around

from gpusched.model import DeviceShare
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

pytestmark = pytest.mark.airflow


@pytest.fixture
def executor(airflow_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from queue_reading_executor(monkeypatch)


def _workload(task_id: str, gpu: dict[str, Any] | None) -> Any:
    return gpu_workload(task_id, {"gpusched": GPURequest.build(**gpu).to_dict()} if gpu is not None else None)


def _submit(ex: Any, *workloads: Any) -> None:
    for w in workloads:
        ex.queue_workload(w, session=None)
    ex.trigger_tasks(ex.parallelism)


def _drain(ex: Any) -> list[Any]:
    items = []
    while not ex.activity_queue.empty():
        items.append(ex.activity_queue.get())
    return items


def _key(w: Any) -> str:
    return ti_key("d", w.ti.task_id, "manual__1", 1, -1)


def test_gpu_workload_dispatched_with_env_and_released_on_completion(executor: Any) -> None:
    from airflow.utils.state import TaskInstanceState

    train = _workload("train", {"gpus": 4, "vendor": "nvidia", "interconnect": "island"})
    plain = _workload("plain", None)
    _submit(executor, train, plain)

    items = _drain(executor)
    assert plain in items  # non-GPU work passes straight through
    (pair,) = [i for i in items if isinstance(i, tuple)]
    sent, env = pair
    assert sent.key == train.key and sent.token != "minted-at-queue-time"  # fresh token
    alloc = executor.ledger.get(_key(train))
    assert alloc is not None and alloc.active and alloc.holder == executor.holder
    indices = sorted(s.index for s in alloc.shares)
    assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, indices))
    assert not executor.queued_tasks and executor.gpu_running == {train.key: _key(train)}

    executor.change_state(train.key, TaskInstanceState.SUCCESS)
    assert executor.ledger.get(_key(train)).released_at is not None
    assert executor.gpu_running == {}


def test_waits_with_reason_then_runs_when_devices_free(executor: Any) -> None:
    from airflow.utils.state import TaskInstanceState

    from gpusched.airflow.fault_listener import read_log_tail

    need = {"gpus": 8, "models": ["H100-SXM-80GB"], "interconnect": "island"}
    first, second = _workload("first", need), _workload("second", need)
    waits = "gpusched: waiting for GPUs"
    before = {w.task_id: read_log_tail(w.key).count(waits) for w in (first.ti, second.ti)}
    _submit(executor, first, second)
    assert len(_drain(executor)) == 1
    waiting = [w for w in (first, second) if w.key in executor.queued_tasks]
    assert len(waiting) == 1
    (entry,) = executor.ledger.queue()
    assert entry.key == _key(waiting[0]) and entry.reason
    # The reason is readable from the task itself: its try log (Logs tab), written once.
    shown = read_log_tail(waiting[0].key)
    said = shown.count(waits)
    assert said - before[waiting[0].ti.task_id] == 1 and f"waiting for GPUs: {entry.reason}" in shown

    executor.trigger_tasks(executor.parallelism)  # still full: stays queued, nothing sent
    assert _drain(executor) == [] and waiting[0].key in executor.queued_tasks
    assert read_log_tail(waiting[0].key).count(waits) == said

    running = first if waiting[0] is second else second
    executor.change_state(running.key, TaskInstanceState.FAILED)  # a failed task frees its devices too
    executor.trigger_tasks(executor.parallelism)
    assert [item[0].key for item in _drain(executor)] == [waiting[0].key]
    assert executor.ledger.queue() == []


def test_capacity_taken_meanwhile_is_retried_not_double_booked(
    executor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = executor.ledger.snapshot()
    need = {"gpus": 8, "models": ["H100-SXM-80GB"], "interconnect": "island"}
    rival = executor.ledger  # another scheduler books the whole H100 island after our snapshot
    device_shares = [
        DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in stale.node("a-h100-1").devices
    ]
    rival.allocate("rival", GPURequest.build(**need), device_shares, holder="other-scheduler")
    # the cycle reads the fleet as it was before the rival booked it (snapshot and running tasks)
    monkeypatch.setattr(executor.ledger, "cycle_view", lambda now=None: (stale, []))

    w = _workload("late", need)
    _submit(executor, w)
    assert _drain(executor) == []
    assert w.key in executor.queued_tasks
    (entry,) = executor.ledger.queue()
    assert "taken meanwhile" in entry.reason
    assert [a.key for a in executor.ledger.active()] == ["rival"]


def test_never_fitting_or_invalid_requests_fail_at_once(executor: Any) -> None:
    from airflow.utils.state import TaskInstanceState

    huge = _workload("huge", {"gpus": 16, "vendor": "nvidia", "interconnect": "island"})
    bad = _workload("bad", {"gpus": 1})
    bad.ti.executor_config = {"gpusched": {"gpus": 1, "partition": "prod"}}
    _submit(executor, huge, bad)
    assert _drain(executor) == []
    assert not executor.queued_tasks
    state, info = executor.event_buffer[huge.key]
    assert state == TaskInstanceState.FAILED and "largest" in info
    state, info = executor.event_buffer[bad.key]
    assert state == TaskInstanceState.FAILED and "partition" in info


def test_revoke_forgets_waiting_and_releases_dispatched(executor: Any) -> None:
    need = {"gpus": 8, "models": ["H100-SXM-80GB"], "interconnect": "island"}
    a, b = _workload("a", need), _workload("b", need)
    _submit(executor, a, b)
    _drain(executor)
    for w in (a, b):
        executor.revoke_task(ti=w.ti)
    assert not executor.queued_tasks and not executor.gpu_running
    assert executor.ledger.active() == [] and executor.ledger.queue() == []


def test_reconcile_releases_own_allocations_of_dead_tasks_only(executor: Any) -> None:
    snap = executor.ledger.snapshot()
    t4 = [d for d in snap.devices() if d.model == "T4"]
    for holder, device, key in ((executor.holder, t4[0], ti_key("d", "gone", "r", 1)),
                                ("someone-else", t4[1], ti_key("d", "theirs", "r", 1))):
        share = DeviceShare(device.uuid, device.node, device.index, 1000, device.memory_bytes)
        executor.ledger.allocate(key, GPURequest.build(gpus=1), [share], holder=holder)
    executor.ledger.record_queue(ti_key("d", "waited", "r", 1), GPURequest.build(gpus=1), "full", 1.0)
    released = executor.reconcile()  # no task instance is queued or running in the Airflow DB
    assert released == [ti_key("d", "gone", "r", 1)]
    assert [a.key for a in executor.ledger.active()] == [ti_key("d", "theirs", "r", 1)]
    assert executor.ledger.queue() == []


def test_heartbeat_renews_leases_of_running_tasks(executor: Any) -> None:
    w = _workload("long", {"gpus": 1, "models": ["T4"]})
    _submit(executor, w)
    _drain(executor)
    key = _key(w)
    before = executor.ledger.get(key).lease_expires_at
    executor.gpu._last_renew = 0.0
    time.sleep(0.05)
    executor.sync()
    assert executor.ledger.get(key).lease_expires_at > before


def test_fault_chain_override_and_refusal_are_obeyed(executor: Any) -> None:
    from airflow.utils.state import TaskInstanceState

    from gpusched.faults.failures import refuse_retry, set_override

    # The chain asked for more memory on another model after an OOM: the retry gets that request.
    bigger = GPURequest.build(gpus=1, models=["MI300X"], memory="150GiB")
    set_override(executor.ledger, "d", "oom", bigger, reason="CUDA OOM: retry on MI300X", run_id="manual__1")
    oom = _workload("oom", {"gpus": 1, "vendor": "nvidia"})
    # The chain refused the retry of a code error: the try fails without taking a GPU.
    refuse_retry(executor.ledger, "d", "broken", "manual__1", 1, reason="KeyError in user code")
    broken = _workload("broken", {"gpus": 1})
    _submit(executor, oom, broken)

    (pair,) = [i for i in _drain(executor) if isinstance(i, tuple)]
    assert pair[0].key == oom.key
    alloc = executor.ledger.get(_key(oom))
    assert alloc is not None and alloc.request == bigger
    assert {executor.ledger.snapshot().device(s.uuid).model for s in alloc.shares} == {"MI300X"}
    state, info = executor.event_buffer[broken.key]
    assert state == TaskInstanceState.FAILED and "KeyError" in info
    assert executor.ledger.get(_key(broken)) is None


def test_never_fitting_reason_reaches_the_task_log_and_the_fault_chain_does_not_retry(
    executor: Any,
) -> None:
    """The Logs tab of a try the executor failed shows the reason in plain words, and the fault
    chain reading that log classifies it as unschedulable: no retry, no scale-out request."""
    from airflow.configuration import conf

    from gpusched.airflow.fault_listener import read_log_tail
    from gpusched.airflow.task_log import task_log_path
    from gpusched.faults.classify import FailureKind
    from gpusched.faults.failures import FailureRecord
    from gpusched.faults.remediation import handle_failure

    huge = _workload("huge", {"gpus": 64, "vendor": "nvidia", "interconnect": "island"})
    _submit(executor, huge)
    path = task_log_path(huge.key, conf.get("logging", "base_log_folder"))
    assert path is not None and path.is_file()
    shown = read_log_tail(huge.key)
    assert "can never fit this fleet" in shown and "largest" in shown, shown
    events = executor.ledger.events(5, kinds=["unschedulable"])
    assert events and events[0].subject == _key(huge) and "largest" in events[0].detail["reason"]
    from airflow.models.log import Log
    from airflow.utils.session import create_session

    with create_session() as session:  # what /api/v2/eventLogs serves
        rows = session.query(Log).filter(Log.event == "gpusched.unschedulable", Log.task_id == "huge").all()
        assert any("can never fit this fleet: needs 64" in (r.extra or "") for r in rows), rows

    record = FailureRecord(key=_key(huge), devices=(), log_tail=shown, at=time.time(), dag_id="d",
                           task_id="huge", run_id="manual__1", try_number=1,
                           request=GPURequest.build(gpus=64, vendor="nvidia", interconnect="island"))
    handled = handle_failure(executor.ledger, record)
    assert handled.classification.kind is FailureKind.UNSCHEDULABLE
    assert handled.remedy.retry is False and handled.remedy.scale_out is None
    assert not executor.ledger.events(5, kinds=["scale_out_request"])


# ---- quotas (issue 12) --------------------------------------------------------------------------


@pytest.fixture
def small_fleet(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """One node of 8 A100s and a quota file (set up before ``executor``); returns the file to fill."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("racks:\n  - name: r\n    nodes:\n      - name: n1\n        cpu: 64\n"
                     "        memory: 512GiB\n        devices: {model: A100-SXM-80GB, count: 8}\n")
    monkeypatch.setenv("GPUSCHED_FLEET", str(fleet))
    quota = tmp_path / "quota.yaml"
    monkeypatch.setenv("GPUSCHED_QUOTA_FILE", str(quota))
    return quota


def test_tenant_over_budget_waits_with_the_reason_while_another_tenant_runs(
    small_fleet: Any, executor: Any
) -> None:
    from gpusched.airflow.api_views import queue_view
    from gpusched.airflow.fault_listener import read_log_tail

    ex = executor
    now = time.time()
    period_s, period = budget_period_around(now, 2701, 600)
    small_fleet.write_text(f"budgets: {{vision: 1}}\nperiod_s: {period_s}\ndefault_duration_s: 60\n")
    # vision already used 1.5 A100-h this week (2 A100s for the last 45 minutes).
    used = GPURequest.build(gpus=2, tenant="vision")
    shares = [DeviceShare(f"GPU-sim-n1-{i}", "n1", i, 1000, 0) for i in range(2)]
    ex.ledger.allocate("earlier", used, shares, holder="old", now=now - 2701)
    ex.ledger.release("earlier", reason="done", now=now - 1)
    vision = _workload("vis", {"gpus": 1, "tenant": "vision"})
    nlp = _workload("nlp", {"gpus": 1, "tenant": "nlp"})
    _submit(ex, vision, nlp)
    assert [item[0].key for item in _drain(ex)] == [nlp.key]
    assert vision.key in ex.queued_tasks
    (entry,) = queue_view(ex.ledger.queue(), time.time())
    assert entry["key"] == _key(vision)
    assert entry["reason"].startswith(f"tenant vision used 1.5 of 1.0 A100-h {period}")
    assert "resets Monday" in entry["reason"] and "00:00 UTC" in entry["reason"]
    assert f"waiting for GPUs: {entry['reason']}" in read_log_tail(vision.key)


def test_dev_beyond_its_share_waits_for_waiting_training_then_borrows_idle_capacity(
    small_fleet: Any, executor: Any
) -> None:
    from airflow.utils.state import TaskInstanceState

    small_fleet.write_text("shares: {training: 70, burst: 20, dev: 10}\nborrowing: true\n")
    ex = executor
    busy = _workload("busy", {"gpus": 4, "partition": "training"})
    _submit(ex, busy)
    assert len(_drain(ex)) == 1
    # 4 of 8 free; dev (share 0.8) asks 3 and comes first, but training waits for 2 of its share.
    dev = _workload("dev", {"gpus": 3, "partition": "dev", "priority": "high"})
    train = _workload("train", {"gpus": 2, "partition": "training"})
    _submit(ex, dev, train)
    assert [item[0].key for item in _drain(ex)] == [train.key]
    (entry,) = ex.ledger.queue()
    assert entry.key == _key(dev) and entry.reason.startswith("partition 'dev' uses 0 of its 10% share")
    assert "kept for other partitions' waiting tasks" in entry.reason
    for done in (busy, train):
        ex.change_state(done.key, TaskInstanceState.SUCCESS)
    ex.trigger_tasks(ex.parallelism)  # the fleet is idle: dev borrows beyond its share
    assert [item[0].key for item in _drain(ex)] == [dev.key]


@pytest.mark.parametrize("action", ["finish", "stop"])
def test_running_work_over_its_hard_budget_finishes_or_stops(
    action: str, small_fleet: Any, executor: Any
) -> None:
    from gpusched.airflow.fault_listener import read_log_tail
    from gpusched.airflow.gpu_over_budget import check_running

    period_s, period = budget_period_around(time.time(), 60, 3 * 3600)
    small_fleet.write_text(f"budgets: {{vision: 1}}\nperiod_s: {period_s}\ndefault_duration_s: 60\n")
    ex = executor
    ex.gpu.over_budget = action  # [gpusched] over_budget
    run = _workload(f"long_{action}", {"gpus": 1, "tenant": "vision"})
    _submit(ex, run)
    assert len(_drain(ex)) == 1
    later = time.time() + 2 * 3600  # two A100-hours in: over the 1-hour budget
    assert check_running(ex.gpu, later) == [run.key]
    assert check_running(ex.gpu, later) == []  # acted on once
    shown = read_log_tail(run.key)
    assert f"tenant vision used 2.0 of 1.0 A100-h {period}" in shown
    if action == "finish":
        assert "let finish ([gpusched] over_budget = finish)" in shown
        assert ex.ledger.get(_key(run)).released_at is None and run.key in ex.gpu_running
    else:
        assert "stopping this task ([gpusched] over_budget = stop)" in shown
        assert ex.ledger.get(_key(run)).released_at is not None and run.key not in ex.gpu_running
        assert str(ex.event_buffer[run.key][0]) == "failed"


# ---- durations learnt from history (issue 12) ---------------------------------------------------


@pytest.mark.parametrize("history_days", [30.0, 0.0])
def test_durations_predicted_from_finished_runs_change_the_order(
    history_days: float, small_fleet: Any, executor: Any
) -> None:
    from gpusched.airflow.api_views import queue_view
    from gpusched.airflow.fault_listener import read_log_tail
    from gpusched.scheduler.durations import DurationHistory

    ex = executor
    ex.gpu.durations = DurationHistory(history_days, 60.0)  # [gpusched] duration_history_days
    now = time.time()
    one = GPURequest.build(gpus=1)
    device = [DeviceShare("GPU-sim-n1-0", "n1", 0, 1000, 0)]
    # Past days: d/short ran 1 minute, d/long 10 hours, three times each (and one failed try
    # of d/short that hung for two days, which says nothing of its run time).
    runs = [("short", 60.0, "task succeeded"), ("long", 36000.0, "task process ended (task success)")] * 3
    for i, (task, run, reason) in enumerate([*runs, ("short", 172800.0, "task failed")]):
        key, start = ti_key("d", task, f"scheduled__{i}", 1, -1), now - 86400.0 * (i + 3)
        ex.ledger.allocate(key, one, device, holder="old", now=start)
        ex.ledger.release(key, reason=reason, now=start + run, succeeded="fail" not in reason)
    busy = _workload("busy", {"gpus": 7})
    _submit(ex, busy)
    assert len(_drain(ex)) == 1
    # One A100 left; the long task was queued first.
    long, short = _workload("long", {"gpus": 1}), _workload("short", {"gpus": 1})
    _submit(ex, long, short)
    (sent,) = _drain(ex)
    if history_days == 0:  # no prediction: FIFO
        assert sent[0].key == long.key and short.key in ex.queued_tasks
        assert "predicted" not in ex.ledger.queue()[0].reason
        return
    assert sent[0].key == short.key and long.key in ex.queued_tasks  # shortest predicted first
    (entry,) = queue_view(ex.ledger.queue(), time.time())
    assert entry["key"] == _key(long)
    assert entry["reason"].endswith("(expected 10.0 h, predicted from 3 past runs of d/long)")
    assert "expected 10.0 h, predicted from 3 past runs of d/long" in read_log_tail(long.key)
    assert "gpusched: expected 60 s, predicted from 3 past runs of d/short" in read_log_tail(short.key)
    # The ledger keeps the author's request (no estimate); the prediction is made each cycle.
    assert ex.ledger.get(_key(short)).request.expected_duration_s == 0


def test_a_wrong_policy_part_stops_the_executor_at_start_with_one_line(
    executor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpusched.airflow.executor import GPUExecutor
    from gpusched.errors import ConfigurationError

    executor.gpu.start_process()  # the default policy: starts
    monkeypatch.setenv("AIRFLOW__GPUSCHED__POLICY_PARTS", "score.local=0.5")
    wrong = GPUExecutor(parallelism=2)
    with pytest.raises(ConfigurationError) as err:
        wrong.gpu.start_process()
    message = str(err.value)
    assert message.startswith("[gpusched] policy_parts: ") and "\n" not in message, message
    assert "score 'local' is not a part" in message
