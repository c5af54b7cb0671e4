"""``[gpusched] preemption = migrate`` through GPUExecutor's own cycle, in-process, against a
real SQLite ledger and a migrated Airflow DB (no worker processes; the workers' queue is read).

A task of job type ``resnet`` (10x faster on the A100 than on the K80, by the throughput file)
runs on the K80 because the A100 is busy; the A100 frees; the executor's next migration round
moves it: ``migrated`` event, notice, the A100 held in the ledger under the key of its next try,
that try pinned to the A100 model; the old try is cleared (requeued, not failed) and releases the
K80; the next try, queued by Airflow, is launched on the held A100 without being placed anew.
No device is ever held by two allocations at once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import gpu_workload, queue_reading_executor
from _ledger_support import assert_whole_devices_never_shared

from gpusched.airflow import gpu_preemption
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

pytestmark = pytest.mark.airflow

RUN = "manual__1"
FLEET = """
racks:
  - name: r
    nodes:
      - name: fast
        cpu: 16
        memory: 64GiB
        devices: {model: A100-SXM-80GB, count: 1}
      - name: slow
        cpu: 16
        memory: 64GiB
        devices: {model: K80, count: 1}
"""


@pytest.fixture
def executor(airflow_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    (tmp_path / "fleet.yaml").write_text(FLEET)
    (tmp_path / "tp.json").write_text(json.dumps({"resnet": {"A100": 10.0, "K80": 1.0}}))
    monkeypatch.setenv("GPUSCHED_FLEET", str(tmp_path / "fleet.yaml"))
    for name, value in {"PREEMPTION": "migrate", "THROUGHPUT_FILE": str(tmp_path / "tp.json"),
                        "PREEMPTION_MIN_RUNTIME_SECONDS": "0", "PREEMPTION_GRACE_SECONDS": "20",
                        "MIGRATION_INTERVAL_SECONDS": "360", "MIGRATION_RESTART_SECONDS": "60",
                        "DURATION_HISTORY_DAYS": "0"}.items():
        monkeypatch.setenv(f"AIRFLOW__GPUSCHED__{name}", value)
    yield from queue_reading_executor(monkeypatch)


def _workload(task_id: str, request: dict[str, Any], try_number: int = 1) -> Any:
    return gpu_workload(task_id, {"gpusched": GPURequest.build(**request).to_dict()}, try_number=try_number)


def _sent(ex: Any) -> list[tuple[Any, dict[str, str]]]:
    items = []
    while not ex.activity_queue.empty():
        items.append(ex.activity_queue.get())
    return [i for i in items if isinstance(i, tuple)]


def _model(ex: Any, key: str) -> str:
    alloc = ex.ledger.get(key)
    assert alloc is not None and len(alloc.shares) == 1
    return str(ex.ledger.snapshot().device(alloc.shares[0].uuid).model)


def test_a_task_on_a_slow_model_moves_to_the_freed_fast_one_and_its_next_try_runs_there(
    executor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.utils.state import TaskInstanceState

    from gpusched.faults.failures import load_overrides

    ex = executor
    cleared: list[Any] = []

    def requeue(key: Any, reason: str) -> str:
        cleared.append((key, reason))
        return "cleared"

    monkeypatch.setattr(gpu_preemption, "requeue", requeue)
    blocker = _workload("blocker", {"gpus": 1, "models": ["A100-SXM-80GB"]})
    train = _workload("train", {"gpus": 1, "job_type": "resnet"})
    for w in (blocker, train):
        ex.queue_workload(w, session=None)
    ex.trigger_tasks(ex.parallelism)
    assert len(_sent(ex)) == 2
    old_key, next_key = ti_key("d", "train", RUN, 1, -1), ti_key("d", "train", RUN, 2, -1)
    assert _model(ex, old_key) == "K80"  # the A100 was taken

    ex.gpu.periodic()  # a migration round with the A100 busy: nothing moves
    assert ex.ledger.events(10, kinds=["migrated"]) == [] and ex.gpu.migration.moving == {}

    ex.change_state(blocker.key, TaskInstanceState.SUCCESS)  # the fast model frees
    now = ex.gpu.migration._last + 361  # the next round
    ex.gpu.periodic(now)
    (event,) = ex.ledger.events(10, kinds=["migrated"])
    assert event.subject == old_key and event.detail["next_try"] == next_key
    assert (event.detail["from_model"], event.detail["to_model"]) == ("K80", "A100-SXM-80GB")
    assert event.detail["held"] is True and event.detail["gain_gpu_s"] > 0
    # The A100 is held for try 2 (the snapshot counts it: nothing else can be placed there) ...
    held = ex.ledger.get(next_key)
    assert held is not None and held.active and _model(ex, next_key) == "A100-SXM-80GB"
    assert held.request.models == frozenset()  # the ledger keeps the author's request: it may move again
    # ... try 2 is pinned to the A100 model, try 1 got its notice (checkpoint.preempted() reads it)
    pinned = load_overrides(ex.ledger).pinned("d", "train", RUN, 2)
    assert pinned is not None and pinned.models == frozenset({"A100-SXM-80GB"})
    assert pinned.job_type == "resnet"
    assert load_overrides(ex.ledger).pinned("d", "train", RUN, 3) is None  # only that try
    notice = ex.ledger.checkpoint(old_key)
    assert notice is not None and "moving to A100-SXM-80GB" in str(notice.notice_reason)
    # A task queued now cannot take the held A100.
    other = _workload("other", {"gpus": 1, "models": ["A100-SXM-80GB"]})
    ex.queue_workload(other, session=None)
    ex.trigger_tasks(ex.parallelism)
    assert _sent(ex) == [] and other.key in ex.queued_tasks

    # Grace over: the try is cleared (Airflow requeues it without using a retry); once its
    # process ended, its K80 is released with the reason.
    ex.gpu.periodic(now + 21)
    assert [k.task_id for k, _ in cleared] == ["train"] and "moving to A100" in cleared[0][1]
    ex.change_state(train.key, TaskInstanceState.SUCCESS)
    released = ex.ledger.get(old_key)
    assert released is not None and released.release_reason.startswith("moving to A100-SXM-80GB")
    assert released.release_reason.endswith("requeued")

    # Airflow queues try 2: it is launched on the held A100 (the same allocation, not placed anew).
    retry = _workload("train", {"gpus": 1, "job_type": "resnet"}, try_number=2)
    ex.queue_workload(retry, session=None)
    ex.trigger_tasks(ex.parallelism)
    (pair,) = _sent(ex)
    assert pair[0].key == retry.key and pair[1]["CUDA_VISIBLE_DEVICES"] == "0"
    assert ex.ledger.get(next_key).created_at == held.created_at and _model(ex, next_key) == "A100-SXM-80GB"
    assert ex.gpu_running[retry.key] == next_key
    ex.gpu.periodic(now + 22)
    assert ex.gpu.migration.moving == {}  # done; the spent pin is removed
    assert load_overrides(ex.ledger).pinned("d", "train", RUN, 2) is None
    assert other.key in ex.queued_tasks  # still waiting: the A100 went to the mover
    assert_whole_devices_never_shared(ex.ledger.history(0, 4e9))


def _restart(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A new GPUExecutor over the same ledger, as the scheduler starts one after a crash: its
    process recorded, then the first reconcile (``GPUExecutor.start`` does both)."""
    ex = next(queue_reading_executor(monkeypatch))
    ex.gpu.start_process()
    ex.reconcile()
    return ex


@pytest.mark.parametrize("next_try_comes", [True, False])
def test_a_move_in_flight_survives_a_scheduler_restart(
    executor: Any, monkeypatch: pytest.MonkeyPatch, next_try_comes: bool
) -> None:
    from airflow.utils.state import TaskInstanceState

    from gpusched.airflow.api_views import preemptions_view
    from gpusched.faults.failures import load_overrides

    monkeypatch.setattr(gpu_preemption, "requeue", lambda key, reason: "cleared")
    ex = executor
    blocker = _workload("blocker", {"gpus": 1, "models": ["A100-SXM-80GB"]})
    train = _workload("train", {"gpus": 1, "job_type": "resnet"})
    for w in (blocker, train):
        ex.queue_workload(w, session=None)
    ex.trigger_tasks(ex.parallelism)
    ex.gpu.periodic()  # a migration round with the A100 busy: nothing moves
    ex.change_state(blocker.key, TaskInstanceState.SUCCESS)
    ex.gpu.migration._last -= 361  # the next round is due (on the real clock: the history is checked)
    ex.gpu.periodic()  # the move: the A100 held for try 2, try 2 pinned, try 1 told
    next_key = ti_key("d", "train", RUN, 2, -1)
    held = ex.ledger.get(next_key)
    assert held is not None and held.active
    (row,) = preemptions_view(ex.ledger.events(10, kinds=["preempted", "migrated"]))  # the fleet page's row
    assert row["kind"] == "move" and row["move"].startswith("K80 (") and "-> A100-SXM-80GB (" in row["move"]
    assert ex.gpu.metrics.migrations == 1  # gpusched_scheduler_migrations_total

    # The scheduler dies (no end(): nothing is released) and a new executor starts over the ledger.
    # Its first reconcile releases the old try (its task instance and process are gone) but not
    # the A100 held for try 2: the move is read back first.
    again = _restart(monkeypatch)
    assert again.gpu.migration.held_keys() == {next_key}
    assert ex.ledger.get(next_key).active  # type: ignore[union-attr]
    assert not ex.ledger.get(ti_key("d", "train", RUN, 1, -1)).active  # type: ignore[union-attr]
    pinned = load_overrides(ex.ledger).pinned("d", "train", RUN, 2)
    assert pinned is not None and pinned.models == frozenset({"A100-SXM-80GB"})
    other = _workload("other", {"gpus": 1, "models": ["A100-SXM-80GB"]})  # cannot take the held A100
    again.queue_workload(other, session=None)
    again.trigger_tasks(again.parallelism)
    assert _sent(again) == [] and other.key in again.queued_tasks
    # From here the clock is the real one: the old try ended, the next try may come for a while.
    again.gpu.periodic()
    if next_try_comes:
        retry = _workload("train", {"gpus": 1, "job_type": "resnet"}, try_number=2)
        again.queue_workload(retry, session=None)
        again.trigger_tasks(again.parallelism)
        (pair,) = _sent(again)
        assert pair[0].key == retry.key and again.gpu_running[retry.key] == next_key
        assert again.ledger.get(next_key).created_at == held.created_at  # type: ignore[union-attr]
        again.gpu.periodic()
        assert again.gpu.migration.moving == {} and again.ledger.moves() == []
        assert load_overrides(again.ledger).pinned("d", "train", RUN, 2) is None
        assert other.key in again.queued_tasks
    else:
        from gpusched.airflow import gpu_migration

        monkeypatch.setattr(gpu_migration, "MIGRATION_REQUEUE_WAIT_S", 0.0)  # not three minutes
        time.sleep(0.01)
        again.gpu.periodic()  # the next try did not come in time: given up, hold and pin gone
        assert again.gpu.migration.moving == {} and again.ledger.moves() == []
        assert not again.ledger.get(next_key).active  # type: ignore[union-attr]
        assert load_overrides(again.ledger).pinned("d", "train", RUN, 2) is None
        again.trigger_tasks(again.parallelism)  # the A100 is free again: the waiting task gets it
        (pair,) = _sent(again)
        assert pair[0].key == other.key and _model(again, ti_key("d", "other", RUN, 1, -1)) == "A100-SXM-80GB"
    assert_whole_devices_never_shared(again.ledger.history(0, 4e9))
    again.ledger.close()
