"""The task-side listener: export from the ledger when no executor did, place a test run (or show it
no GPU), log, release idempotently."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import pytest

from gpusched.airflow import listener
from gpusched.hardware.envexport import devices_env
from gpusched.hardware.simulated import SimulatedBackend, default_fleet_path
from gpusched.ledger import Ledger
from gpusched.model import MILLI, DeviceShare
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key


def _ti(task_id: str, gpu: dict[str, Any] | None) -> Any:
    config = {"gpusched": GPURequest.build(**gpu).to_dict()} if gpu is not None else None
    return SimpleNamespace(dag_id="d", task_id=task_id, run_id="r1", try_number=1, map_index=-1,
                           task=SimpleNamespace(executor_config=config))


@pytest.fixture
def ledger() -> Any:
    led = Ledger()
    led.migrate()
    led.sync_inventory(SimulatedBackend(default_fleet_path()).discover(), source="simulated")
    yield led
    led.close()


def _allocate(ledger: Ledger, task_id: str, model: str, count: int) -> tuple[DeviceShare, ...]:
    devices = [d for d in ledger.snapshot().devices() if d.model == model][:count]
    shares = tuple(DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes) for d in devices)
    ledger.allocate(ti_key("d", task_id, "r1", 1), GPURequest.build(gpus=count), shares, holder="other")
    return shares


def test_exports_the_ledger_allocation_when_the_executor_did_not(ledger: Ledger) -> None:
    _allocate(ledger, "train", "A100-SXM-80GB", 2)
    environ: dict[str, str] = {}
    allocation = listener.export_devices(_ti("train", {"gpus": 2}), environ)
    assert allocation is not None and allocation["key"] == ti_key("d", "train", "r1", 1)
    assert environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert json.loads(environ["GPUSCHED_ALLOCATION"])["models"] == ["A100-SXM-80GB"] * 2


def test_keeps_what_the_executor_exported(ledger: Ledger) -> None:
    shares = _allocate(ledger, "smoke", "T4", 1)
    key = ti_key("d", "smoke", "r1", 1)
    environ = devices_env(shares, ledger.snapshot(), key=key)
    before = dict(environ)
    assert listener.export_devices(_ti("smoke", {"gpus": 1}), environ)["uuids"] == [shares[0].uuid]
    assert environ == before


def test_ignores_a_stale_allocation_of_another_task_and_plain_tasks(ledger: Ledger) -> None:
    shares = _allocate(ledger, "other", "T4", 1)
    environ = devices_env(shares, ledger.snapshot(), key=ti_key("d", "other", "r1", 1))
    assert listener.export_devices(_ti("cpu_only", None), environ) is None


def test_a_gpu_task_no_executor_placed_is_a_test_run_the_scheduler_places(ledger: Ledger) -> None:
    """``airflow dags test`` / ``tasks test``: placed by the cycle, allocated to the test-run
    holder, exported, released and the process's variables restored when it ends."""
    ti = _ti("unallocated", {"gpus": 2, "models": ["A100-SXM-80GB"]})
    key = ti_key("d", "unallocated", "r1", 1)
    environ = {"CUDA_VISIBLE_DEVICES": "before"}
    allocation = listener.export_devices(ti, environ)
    assert allocation is not None and allocation["key"] == key and listener.is_test_run(key)
    held = ledger.get(key)
    assert held is not None and held.holder.startswith(f"{listener.TEST_RUN_HOLDER}@")
    assert len(held.shares) == 2 and {ledger.snapshot().device(s.uuid).model for s in held.shares} == {
        "A100-SXM-80GB"}
    assert environ["CUDA_VISIBLE_DEVICES"] == ",".join(str(s.index) for s in held.shares)
    assert [e.subject for e in ledger.events(5, kinds=["test_run"])] == [key]
    listener.on_task_instance_success(None, ti)  # its end: released, the variables it set restored
    assert ledger.get(key).released_at is not None  # type: ignore[union-attr]
    assert environ == {"CUDA_VISIBLE_DEVICES": "before"}


def test_a_test_run_that_cannot_be_placed_sees_no_gpu_and_says_why(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ti = _ti("huge", {"gpus": 64})
    environ: dict[str, str] = {}
    with caplog.at_level("WARNING", logger="gpusched.listener"):
        assert listener.export_devices(ti, environ) is None
    assert {k: environ[k] for k in listener.HIDDEN} == dict.fromkeys(listener.HIDDEN, "")
    (line,) = [r.getMessage() for r in caplog.records if "test run" in r.getMessage()]
    assert "cannot place it now" in line and "runs with no GPU visible" in line
    assert ledger.get(ti_key("d", "huge", "r1", 1)) is None


def test_a_test_run_without_a_ledger_sees_no_gpu_and_no_traceback(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GPUSCHED_DB_URL", f"sqlite:///{tmp_path / 'never-migrated.db'}")
    environ: dict[str, str] = {}
    with caplog.at_level("WARNING"):
        assert listener.export_devices(_ti("fresh", {"gpus": 1}), environ) is None
    assert environ["CUDA_VISIBLE_DEVICES"] == "" and environ["HIP_VISIBLE_DEVICES"] == ""
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]
    (line,) = [r.getMessage() for r in caplog.records if "test run" in r.getMessage()]
    assert "ledger cannot be read" in line and "scripts/run.sh" in line


def test_release_is_idempotent_and_skips_plain_tasks(ledger: Ledger) -> None:
    _allocate(ledger, "train", "H100-SXM-80GB", 4)
    ti = _ti("train", {"gpus": 4})
    assert listener.release_devices(ti, "task succeeded") is True
    assert listener.release_devices(ti, "task succeeded") is False
    assert ledger.active() == []
    assert listener.release_devices(_ti("cpu_only", None), "task succeeded") is False


def test_the_task_process_closes_its_ledger_connection_once_released(ledger: Ledger) -> None:
    # A connection left for the process's exit keeps the Celery slot busy for Airflow's
    # supervisor heartbeat (5 s) in a share of the tries (listener.close_ledgers).
    _allocate(ledger, "train", "L40S", 1)
    ti = _ti("train", {"gpus": 1})
    listener.record_task_process(ti)
    task_side = listener._ledger()
    assert task_side.engine.pool.checkedin() == 1  # the pool kept the export's connection
    listener.on_task_instance_success(None, ti)
    assert ledger.active() == []
    assert listener._LEDGERS == {} and task_side.engine.pool.checkedin() == 0


def test_hooks_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("ledger down")

    monkeypatch.setattr(listener, "export_devices", boom)
    monkeypatch.setattr(listener, "release_devices", boom)
    ti = _ti("train", {"gpus": 1})
    listener.on_task_instance_running(None, ti)
    listener.on_task_instance_success(None, ti)
    listener.on_task_instance_failed(None, ti, RuntimeError("x"))


def test_on_a_gpu_host_the_recorded_launch_is_exported_and_another_host_refuses(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    shares = _allocate(ledger, "routed", "L40S", 1)
    key = ti_key("d", "routed", "r1", 1)
    env = {**devices_env(shares, ledger.snapshot(), key=key), "NODE_RANK": "1"}
    ledger.record_event("launch", key, env=env, host="host-b")
    monkeypatch.setenv("GPUSCHED_HOST", "host-b")
    environ: dict[str, str] = {}
    listener.export_devices(_ti("routed", {"gpus": 1}), environ)
    assert environ["CUDA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] and environ["NODE_RANK"] == "1"
    assert [(p.role, p.pid) for p in ledger.get(key).processes] == [("task", os.getpid())]  # type: ignore[union-attr]
    monkeypatch.setenv("GPUSCHED_HOST", "host-a")  # a stale queue delivered it to the wrong host
    with pytest.raises(SystemExit, match=r"landed on GPU host host-a.*refusing to run"):
        listener.on_task_instance_running(None, _ti("routed", {"gpus": 1}))
    monkeypatch.setenv("GPUSCHED_HOST", "host-b")
    before = dict(os.environ)
    try:
        listener.on_task_instance_running(None, _ti("routed", {"gpus": 1}))  # recorded with its read, once
    finally:  # the hook exports into this process's environment
        os.environ.clear()
        os.environ.update(before)
    held = ledger.get(key).processes  # type: ignore[union-attr]
    assert [(p.role, p.host, p.pid) for p in held] == [("task", held[0].host, os.getpid())]
    ledger.release(key, reason="host lost")
    with pytest.raises(SystemExit, match="no active GPU allocation"):
        listener.on_task_instance_running(None, _ti("routed", {"gpus": 1}))


def test_on_a_gpu_host_a_task_waits_for_its_launch_recorded_after_the_send(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    shares = _allocate(ledger, "early", "L40S", 1)
    key = ti_key("d", "early", "r1", 1)
    env = {**devices_env(shares, ledger.snapshot(), key=key), "NODE_RANK": "1"}
    monkeypatch.setenv("GPUSCHED_HOST", "host-b")
    # The executor records the launch only once the broker took the message: a fast worker may
    # start the task first.
    late = threading.Timer(1.0, lambda: ledger.record_event("launch", key, env=env, host="host-b"))
    late.start()
    environ: dict[str, str] = {}
    try:
        listener.export_devices(_ti("early", {"gpus": 1}), environ)
    finally:
        late.join()
    assert environ["NODE_RANK"] == "1"  # from the launch (the rendezvous of a gang), not rebuilt


def test_the_fault_chain_ignores_a_failed_test_run(ledger: Ledger) -> None:
    from gpusched.airflow import fault_listener

    ti = _ti("broken", {"gpus": 1})
    assert listener.export_devices(ti, {}) is not None  # a test run, placed
    fault_listener.on_task_instance_failed(None, ti, RuntimeError("user code failed"))
    assert ledger.events(10, kinds=["task_failed"]) == []
    listener.on_task_instance_failed(None, ti, RuntimeError("user code failed"))
    assert ledger.active() == []
