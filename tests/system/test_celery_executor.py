"""GPUCeleryExecutor in-process: routing to the owning host's queue, holds, lost hosts, gangs, bad config.

A real ledger and a migrated Airflow DB; Celery sending is replaced by a recorder (the multihost
end-to-end test sends through a real Redis).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import recording_celery_executor

from gpusched.errors import ConfigurationError
from gpusched.gang import GANG_KEY
from gpusched.hardware.detect import detect_backend
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

pytestmark = pytest.mark.airflow

FLEET = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets" / "multihost.yaml"


@pytest.fixture
def executor(airflow_db: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    yield from recording_celery_executor(monkeypatch, f"sqlite:///{tmp_path / 'ledger.db'}", FLEET)


def _workload(task_id: str, gpu: dict[str, Any] | None, config: dict[str, Any] | None = None) -> Any:
    from airflow.executors.workloads import BundleInfo, ExecuteTask
    from airflow.executors.workloads.task import TaskInstanceDTO

    executor_config = {"gpusched": GPURequest.build(**gpu).to_dict()} if gpu is not None else None
    if config:
        executor_config = {**(executor_config or {}), **config}
    ti = TaskInstanceDTO(
        id=uuid.uuid4(), task_id=task_id, dag_id="d", run_id="manual__1", try_number=1,
        dag_version_id=uuid.uuid4(), pool_slots=1, priority_weight=1, queue="default",
        executor_config=executor_config,
    )
    return ExecuteTask(ti=ti, token="t", dag_rel_path="d.py", bundle_info=BundleInfo(name="dags-folder"),
                       log_path=None)


def _submit(ex: Any, *workloads: Any) -> None:
    for w in workloads:
        ex.queue_workload(w, session=None)
    ex.trigger_tasks(ex.parallelism)


def test_gpu_tasks_go_to_the_queue_of_the_host_owning_their_devices(executor: Any) -> None:
    a100 = _workload("a100", {"gpus": 1, "models": ["A100-SXM-80GB"]})
    l40s = _workload("l40s", {"gpus": 2, "models": ["L40S"]})
    plain = _workload("plain", None)
    _submit(executor, a100, l40s, plain)
    queues = {w.ti.task_id: w.ti.queue for w in executor.sent}
    assert queues == {"a100": "gpusched@host-a", "l40s": "gpusched@host-b", "plain": "default"}
    assert {w.token for w in executor.sent if w.ti.task_id != "plain"} != {"t"}  # fresh tokens
    alloc = executor.ledger.get(ti_key("d", "l40s", "manual__1", 1))
    assert alloc is not None and {s.node for s in alloc.shares} == {"host-b"}  # written before sending
    assert not executor.queued_tasks


def test_lost_host_quarantines_allocations_and_fails_its_tasks(executor: Any) -> None:
    from airflow.utils.state import TaskInstanceState

    w = _workload("victim", {"gpus": 1, "models": ["A100-SXM-80GB"]})
    _submit(executor, w)
    later = time.time() + 100
    executor.ledger.heartbeat_host("host-b", now=later)
    lost = executor.gpu.handle_lost_hosts(now=later + 5)  # host-a silent since registration
    key = ti_key("d", "victim", "manual__1", 1)
    assert lost == [key]
    # Its fate is unknown: the devices wait, quarantined, for host-a's agent to confirm it stopped.
    (fenced,) = executor.ledger.active()
    assert (fenced.key, fenced.status, fenced.holder) == (key, "quarantined", "fence@host-a")
    assert "host host-a: waiting for its agent to confirm try 1 stopped" in (fenced.release_reason or "")
    state, info = executor.event_buffer[w.key]
    assert state == TaskInstanceState.FAILED and "node lost: no heartbeat from host host-a" in info
    # nothing runs on the lost host any more: an A100 task now waits with a reason
    again = _workload("again", {"gpus": 1, "models": ["A100-SXM-80GB"]})
    _submit(executor, again)
    assert again.key in executor.queued_tasks
    (entry,) = executor.ledger.queue()
    assert "GPU host(s) host-a lost: waiting for them to come back" in entry.reason
    # The scheduler's metrics (the core both executors share): one host lost, the task waiting for it.
    metrics = executor.gpu.metrics
    assert (metrics.hosts_lost, metrics.hosts) == (1, {"live": 1, "lost": 1, "unconfirmed": 0, "standby": 0})
    assert [kind for kind, _ in metrics.waiting.values()] == ["host_unavailable"]
    assert metrics.decisions >= 2 and metrics.holds["host_unavailable"] == 1


def test_a_node_without_a_host_agent_is_not_dispatched(executor: Any) -> None:
    backend = detect_backend("simulated")
    executor.ledger.sync_inventory(backend.discover(), source=backend.name)  # nodes with no agent
    w = _workload("h100", {"gpus": 1, "models": ["H100-SXM-80GB"]})
    _submit(executor, w)
    assert not executor.sent and w.key in executor.queued_tasks
    (entry,) = executor.ledger.queue()
    assert "has no GPU host agent" in entry.reason and "gpusched agent --host-name" in entry.reason
    assert executor.ledger.active() == []


def test_gang_members_go_to_their_hosts_with_one_rendezvous(executor: Any) -> None:
    members = [
        _workload(f"train__node{rank}", {"gpus": 1, "vendor": "nvidia", "interconnect": "same_node"},
                  {GANG_KEY: {"name": "train", "size": 2, "rank": rank, "scope": "same_rack"}})
        for rank in (0, 1)
    ]
    _submit(executor, members[0])
    assert not executor.sent  # waits for the other member
    assert "1 of 2 members queued" in executor.ledger.queue()[0].reason
    _submit(executor, members[1])
    assert sorted(w.ti.queue for w in executor.sent) == ["gpusched@host-a", "gpusched@host-b"]
    launches = [executor.ledger.events(1, kinds=["launch"], subject=ti_key("d", f"train__node{r}",
                                                                          "manual__1", 1))[0].detail
                for r in (0, 1)]
    assert sorted(d["host"] for d in launches) == ["host-a", "host-b"]
    envs = [d["env"] for d in launches]
    assert [e["NODE_RANK"] for e in envs] == ["0", "1"]
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        assert envs[0][name] == envs[1][name], name


def test_unreachable_broker_is_one_clear_error(executor: Any) -> None:
    from gpusched.deploy.multihost_cluster import free_port

    executor.celery_app.conf.broker_url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ConfigurationError, match=r"cannot reach the Celery broker .*broker_url"):
        executor.check_broker()


def test_unreachable_ledger_is_one_clear_error(executor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusched.deploy.multihost_cluster import free_port
    from gpusched.ledger import Ledger

    executor.gpu._ledger = Ledger(f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none")
    with pytest.raises(ConfigurationError, match=r"cannot open the gpusched ledger .*GPUSCHED_DB_URL"):
        executor.check_ledger()


def test_adopted_gpu_tasks_keep_their_allocations(executor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from airflow.models.taskinstancekey import TaskInstanceKey
    from airflow.providers.celery.executors.celery_executor import CeleryExecutor

    w = _workload("long", {"gpus": 1, "models": ["L40S"]})
    _submit(executor, w)
    executor.gpu.gpu_running.clear()  # a new scheduler process knows nothing of it
    monkeypatch.setattr(CeleryExecutor, "try_adopt_task_instances", lambda self, tis: [])  # all adopted
    key = TaskInstanceKey("d", "long", "manual__1", 1, -1)
    config = {"gpusched": GPURequest.build(gpus=1).to_dict()}
    ti = SimpleNamespace(key=key, dag_id="d", task_id="long", run_id="manual__1", try_number=1, map_index=-1,
                         executor_config=config)
    # A GPU task still waiting for devices was never sent to Celery (Airflow pre-assigned its
    # Celery id at queueing): not adopted, so Airflow resets it and queues it again.
    waiting = SimpleNamespace(key=TaskInstanceKey("d", "waiting", "manual__1", 1, -1), dag_id="d",
                              task_id="waiting", run_id="manual__1", try_number=1, map_index=-1,
                              executor_config=config)
    assert executor.try_adopt_task_instances([ti, waiting]) == [waiting]
    assert executor.gpu.gpu_running == {key: ti_key("d", "long", "manual__1", 1)}
