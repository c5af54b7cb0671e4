"""GPUCeleryExecutor in-process against a real Redis broker: an outage is not a task failure, and
what was dispatched is watched until it starts.

A real ledger, a migrated Airflow DB and a real ``redis-server`` (stopped and started by the test);
CeleryExecutor's own sending code runs, so a down broker raises kombu's real OperationalError.
No Celery worker runs: whether a try started is read from the Celery result backend (a
SQLite file), the ledger and Airflow's state of the try — the last is given by the test, as no
DAG run backs these workloads.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import RedisServer, recording_celery_executor

from gpusched.airflow.dispatch_watch import ABSENT, QUEUED, RESERVED, find_message
from gpusched.gang import GANG_KEY
from gpusched.ledger.hosts import LAUNCH_EVENT
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

pytestmark = pytest.mark.airflow

FLEET = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets" / "multihost.yaml"


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def executor(
    airflow_db: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis: RedisServer
) -> Iterator[Any]:
    from airflow.providers.celery.executors import celery_executor_utils

    monkeypatch.setenv("AIRFLOW__CELERY__BROKER_URL", redis.url)
    monkeypatch.setenv("AIRFLOW__CELERY__RESULT_BACKEND", f"db+sqlite:///{tmp_path / 'results.db'}")
    monkeypatch.setenv("AIRFLOW__CELERY__SYNC_PARALLELISM", "1")
    monkeypatch.setenv("AIRFLOW__GPUSCHED__DISPATCH_START_TIMEOUT_SECONDS", "3")
    celery_executor_utils._get_celery_app_for_workload.cache_clear()  # the publishing app: this broker
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    yield from recording_celery_executor(monkeypatch, ledger, FLEET, record=False)
    celery_executor_utils._get_celery_app_for_workload.cache_clear()


def _workload(task_id: str, config: dict[str, Any] | None = None, **gpu: Any) -> Any:
    from airflow.executors.workloads import BundleInfo, ExecuteTask
    from airflow.executors.workloads.task import TaskInstanceDTO

    ti = TaskInstanceDTO(
        id=uuid.uuid4(), task_id=task_id, dag_id="d", run_id="manual__1", try_number=1,
        dag_version_id=uuid.uuid4(), pool_slots=1, priority_weight=1, queue="default",
        executor_config={"gpusched": GPURequest.build(**gpu).to_dict(), **(config or {})},
        external_executor_id=str(uuid.uuid4()),  # pre-assigned by the scheduler at queueing
    )
    return ExecuteTask(ti=ti, token="t", dag_rel_path="d.py", bundle_info=BundleInfo(name="dags-folder"),
                       log_path=None)


def _submit(ex: Any, *workloads: Any) -> None:
    for w in workloads:
        ex.queue_workload(w, session=None)
    ex.trigger_tasks(ex.parallelism)


def _launches(ex: Any, key: str) -> list[Any]:
    return list(ex.ledger.events(10, kinds=[LAUNCH_EVENT], subject=key))


def test_a_down_broker_keeps_gpu_tasks_queued_and_pauses_dispatch(
    executor: Any, redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from airflow.utils.state import TaskInstanceState

    first = _workload("first", gpus=1, models=["A100-SXM-80GB"])
    second = _workload("second", gpus=2, models=["L40S"])
    key = ti_key("d", "first", "manual__1", 1)
    redis.stop()
    _submit(executor, first, second)
    _submit(executor)  # the next heartbeat: paused, nothing tried
    logged = capsys.readouterr().out.splitlines()  # the executor's log
    # Not failed, still queued, nothing recorded as launched, the devices it was given released.
    assert first.key in executor.queued_tasks and second.key in executor.queued_tasks
    assert all(state != TaskInstanceState.FAILED for state, _ in executor.event_buffer.values())
    assert not executor.running and not executor.gpu.gpu_running
    assert _launches(executor, key) == [] and executor.ledger.active() == []
    released = executor.ledger.get(key)
    assert released is not None and "not sent" in (released.release_reason or "")
    # kombu's refused connection, or on a loaded machine Airflow's send timeout first: both mean
    # the broker did not take it.
    refused = ("OperationalError", "AirflowTaskTimeout")
    assert any(why in (executor.gpu.dispatch_down or "") for why in refused), executor.gpu.dispatch_down
    paused = [line for line in logged if "GPU dispatch paused" in line]
    assert len(paused) == 1, logged
    assert "stay queued (not failed, no retry spent)" in paused[0]
    assert any(why in paused[0] for why in refused), paused[0]
    assert not [line for line in logged if "dispatched on" in line]

    # The broker answers again: dispatch resumes, both are sent and their launches recorded.
    redis.start()
    executor.gpu._dispatch_probe_at = 0.0  # do not wait out the probe interval
    _submit(executor)
    logged = capsys.readouterr().out.splitlines()
    assert executor.gpu.dispatch_down is None
    assert not executor.queued_tasks and executor.running == {first.key, second.key}
    assert [line for line in logged if "GPU dispatch resumed" in line], logged
    assert len([line for line in logged if "dispatched on" in line]) == 2
    (launch,) = _launches(executor, key)
    assert launch.detail["host"] == "host-a"
    assert executor.event_buffer[first.key] == (TaskInstanceState.QUEUED, first.ti.external_executor_id)
    assert find_message(executor.celery_app, "gpusched@host-a", first.ti.external_executor_id) == QUEUED
    assert {a.key for a in executor.ledger.active()} == {key, ti_key("d", "second", "manual__1", 1)}


def test_a_dispatch_lost_in_a_broker_restart_is_placed_again(executor: Any, redis: RedisServer) -> None:
    from airflow.utils.state import TaskInstanceState

    w = _workload("lost", gpus=1, models=["A100-SXM-80GB"])
    key = ti_key("d", "lost", "manual__1", 1)
    old_id = w.ti.external_executor_id
    executor.watch.airflow_state = lambda k: "queued"  # Airflow's view of the try: never started
    _submit(executor, w)
    sent_at = executor.watch.sent_tries[w.key].sent_at
    # Within the bound, or with its message waiting for the host's worker, it is left alone.
    assert executor.watch.check(now=sent_at + 1) == []
    assert executor.watch.check(now=sent_at + 10) == [] and executor.watch.check(now=sent_at + 20) == []
    assert w.key in executor.running

    redis.stop()
    redis.start()  # no persistence: the message is gone
    assert find_message(executor.celery_app, "gpusched@host-a", old_id) == ABSENT
    assert executor.watch.check(now=sent_at + 30) == []  # found lost once: confirmed at the next check
    assert executor.watch.check(now=sent_at + 40) == [w.key]
    assert w.key in executor.queued_tasks and w.key not in executor.running
    assert executor.ledger.active() == []
    (lost,) = executor.ledger.events(5, kinds=["dispatch_lost"], subject=key)
    assert lost.detail["task_id"] == old_id and "gone from the Celery broker" in lost.detail["reason"]
    requeued = executor.queued_tasks[w.key]
    assert requeued.ti.try_number == 1 and requeued.ti.external_executor_id != old_id

    _submit(executor)  # placed and sent again, under its new Celery task id
    new_id = requeued.ti.external_executor_id
    assert executor.event_buffer[w.key] == (TaskInstanceState.QUEUED, new_id)
    assert find_message(executor.celery_app, "gpusched@host-a", new_id) == QUEUED
    assert len(_launches(executor, key)) == 2 and [a.key for a in executor.ledger.active()] == [key]
    assert all(state != TaskInstanceState.FAILED for state, _ in executor.event_buffer.values())


def test_a_restarted_executor_watches_the_dispatches_it_adopts(executor: Any, redis: RedisServer) -> None:
    from types import SimpleNamespace

    w = _workload("adopted", gpus=1, models=["A100-SXM-80GB"])
    key = ti_key("d", "adopted", "manual__1", 1)
    executor.watch.airflow_state = lambda k: "queued"
    _submit(executor, w)
    sent_at = executor.watch.sent_tries[w.key].sent_at
    # A new executor after a scheduler restart knows nothing it did not adopt.
    executor.watch.sent_tries.clear()
    ti = SimpleNamespace(dag_id="d", task_id="adopted", run_id="manual__1", try_number=1, map_index=-1,
                         state="queued", external_executor_id=w.ti.external_executor_id, key=w.key)
    running = SimpleNamespace(**{**vars(ti), "state": "running"})
    assert not executor.watch.adopt(running, lambda t: w)  # a started try is left alone
    assert executor.watch.adopt(ti, lambda t: w)
    adopted = executor.watch.sent_tries[w.key]
    assert (adopted.ledger_key, adopted.queue, adopted.host) == (key, "gpusched@host-a", "host-a")
    assert abs(adopted.sent_at - sent_at) < 5  # timed from its original send, not the adoption

    redis.stop()
    redis.start()  # its message is gone: placed again as any lost dispatch
    assert executor.watch.check(now=sent_at + 30) == []
    assert executor.watch.check(now=sent_at + 40) == [w.key]
    assert w.key in executor.queued_tasks and executor.ledger.active() == []


def test_a_started_try_is_never_placed_again(executor: Any, redis: RedisServer) -> None:
    w = _workload("running", gpus=1, models=["L40S"])
    _submit(executor, w)
    sent_at = executor.watch.sent_tries[w.key].sent_at
    executor.watch.airflow_state = lambda k: "queued"
    executor.watch.celery_state = lambda task_id: "STARTED"  # the worker took it (task_track_started)
    redis.stop()
    redis.start()
    assert executor.watch.check(now=sent_at + 30) == [] and executor.watch.check(now=sent_at + 40) == []
    assert w.key not in executor.watch.sent_tries  # started: not watched any more
    assert w.key in executor.running and [a.key for a in executor.ledger.active()] == [
        ti_key("d", "running", "manual__1", 1)]


def test_a_try_waiting_in_a_lost_hosts_queue_is_placed_again_not_failed(executor: Any) -> None:
    w = _workload("stranded", gpus=1, models=["A100-SXM-80GB"])
    executor.watch.airflow_state = lambda k: "queued"
    _submit(executor, w)
    entry = executor.watch.sent_tries[w.key]
    assert find_message(executor.celery_app, entry.queue, entry.task_id) == QUEUED
    later = entry.sent_at + 100
    executor.ledger.heartbeat_host("host-b", now=later)
    executor.gpu.handle_lost_hosts(now=later + 5)  # host-a silent since registration
    assert w.key in executor.queued_tasks and w.key not in executor.running
    assert str(executor.event_buffer[w.key][0]) == "queued"  # only its first send's event: not failed
    assert find_message(executor.celery_app, entry.queue, entry.task_id) == ABSENT  # taken out of its queue
    key = ti_key("d", "stranded", "manual__1", 1)
    (lost,) = executor.ledger.events(5, kinds=["dispatch_lost"], subject=key)
    assert "GPU host host-a lost" in lost.detail["reason"]


def test_find_message_sees_reserved_messages(executor: Any) -> None:
    w = _workload("reserved", gpus=1, models=["L40S"])
    _submit(executor, w)
    entry = executor.watch.sent_tries[w.key]
    with executor.celery_app.connection_for_write() as connection:  # a worker's prefetch, acks_late
        queue = connection.SimpleQueue(entry.queue, no_ack=False)
        message = queue.get(timeout=5)
        assert message.headers["id"] == entry.task_id
        assert find_message(executor.celery_app, entry.queue, entry.task_id) == RESERVED
        message.ack()
        queue.close()
    assert find_message(executor.celery_app, entry.queue, entry.task_id) == ABSENT


def _gang(executor: Any) -> list[Any]:
    members = [_workload(f"train__node{rank}", {GANG_KEY: {"name": "train", "size": 2, "rank": rank,
                                                            "scope": "same_rack"}},
                         gpus=1, vendor="nvidia", interconnect="same_node") for rank in (0, 1)]
    _submit(executor, *members)
    assert {executor.watch.sent_tries[m.key].host for m in members} == {"host-a", "host-b"}
    return members


def test_a_gang_whose_dispatches_are_all_lost_is_placed_again_whole(
    executor: Any, redis: RedisServer
) -> None:
    members = _gang(executor)
    executor.watch.airflow_state = lambda k: "queued"
    sent_at = max(executor.watch.sent_tries[m.key].sent_at for m in members)
    redis.stop()
    redis.start()
    executor.watch.check(now=sent_at + 30)
    replaced = executor.watch.check(now=sent_at + 40)
    assert sorted(replaced, key=str) == sorted((m.key for m in members), key=str)
    assert all(m.key in executor.queued_tasks for m in members) and not executor.gpu.gangs
    _submit(executor)  # placed again together, one rendezvous
    assert all(m.key in executor.running for m in members) and len(executor.gpu.gangs) == 1


def test_a_lost_gang_member_whose_peer_started_fails_so_the_gang_is_retried_whole(
    executor: Any, redis: RedisServer
) -> None:
    from airflow.utils.state import TaskInstanceState

    members = _gang(executor)
    started = executor.watch.sent_tries[members[0].key].task_id
    executor.watch.airflow_state = lambda k: "running" if k == members[0].key else "queued"
    executor.watch.celery_state = lambda task_id: "STARTED" if task_id == started else "PENDING"
    sent_at = max(executor.watch.sent_tries[m.key].sent_at for m in members)
    redis.stop()
    redis.start()
    executor.watch.check(now=sent_at + 30)
    assert executor.watch.check(now=sent_at + 40) == []
    state, info = executor.event_buffer[members[1].key]
    assert state == TaskInstanceState.FAILED and "gang is retried as a whole" in info
    assert members[1].key not in executor.queued_tasks
    active = {a.key for a in executor.ledger.active()}
    assert active == {ti_key("d", "train__node0", "manual__1", 1)}  # the started member keeps its devices
