"""Shared by the tests that run real Airflow: the api-server's plugin-route checks, and a
``GPUExecutor`` whose worker queue the test reads itself."""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import pytest

from gpusched.deploy.airflow_instance import http_get
from gpusched.errors import AirflowBootError

SIMULATED_DEVICES = 51
"""Physical devices of the packaged simulated fleet (a GPU in MIG mode or a CPX card counts once)."""


def check_plugin_routes(base: str, token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Assert the plugin's routes in the api-server at ``base``; return (fleet JSON, plugin entry).

    Unauthenticated ``/gpusched/fleet`` → 401; with ``token`` as Bearer → 200 and the simulated
    fleet's devices; ``/gpusched/ui`` is the "GPU fleet" page; ``/api/v2/plugins`` lists the
    plugin with its FastAPI app at ``/gpusched`` and its "GPU fleet" nav view.
    """
    auth = {"Authorization": f"Bearer {token}"}
    assert http_get(base + "/gpusched/fleet")[0] == 401
    status, body = http_get(base + "/gpusched/fleet", auth)
    assert status == 200, body[-2000:]
    fleet = json.loads(body)
    assert fleet["simulated"] is True and fleet["summary"]["devices"] == SIMULATED_DEVICES
    status, body = http_get(base + "/gpusched/ui", auth)
    assert status == 200 and b"GPU fleet" in body
    status, body = http_get(base + "/api/v2/plugins", auth)
    assert status == 200, body[-2000:]
    (plugin,) = [p for p in json.loads(body)["plugins"] if p["name"] == "gpusched"]
    assert plugin["fastapi_apps"][0]["url_prefix"] == "/gpusched"
    view = plugin["external_views"][0]
    assert (view["name"], view["href"], view["destination"], view["url_route"]) == (
        "GPU fleet", "/gpusched/ui", "nav", "gpusched")
    return fleet, plugin


def queue_reading_executor(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A ``GPUExecutor`` on the simulated fleet, its ledger migrated and synced, started the way
    ``LocalExecutor.start()`` does but without forking workers: the test reads
    ``activity_queue`` itself. Use as the body of a fixture (``yield from``); needs the
    ``airflow_db`` fixture and any ``[gpusched]`` settings in the environment first.
    """
    monkeypatch.setenv("GPUSCHED_BACKEND", "simulated")
    from gpusched.airflow.executor import GPUExecutor
    from gpusched.hardware.detect import detect_backend

    ex = GPUExecutor(parallelism=8)
    ex.activity_queue = SimpleQueue()
    ex.result_queue = SimpleQueue()
    ex.workers = {}
    ex._unread_messages = multiprocessing.Value(ctypes.c_uint)
    monkeypatch.setattr(ex, "_check_workers", lambda: None)
    ex.ledger.migrate()
    backend = detect_backend()
    ex.ledger.sync_inventory(backend.discover(), source=backend.name)
    yield ex
    ex.ledger.close()


def gpu_workload(
    task_id: str, config: dict[str, Any] | None, *, dag_id: str = "d", try_number: int = 1
) -> Any:
    """An ``ExecuteTask`` workload of run ``manual__1`` with ``config`` as its executor_config
    (``{"gpusched": GPURequest.to_dict()}`` for a GPU task; None for a plain one)."""
    import uuid

    from airflow.executors.workloads import BundleInfo, ExecuteTask
    from airflow.executors.workloads.task import TaskInstanceDTO

    ti = TaskInstanceDTO(
        id=uuid.uuid4(), task_id=task_id, dag_id=dag_id, run_id="manual__1", try_number=try_number,
        dag_version_id=uuid.uuid4(), pool_slots=1, priority_weight=1, executor_config=config,
    )
    return ExecuteTask(ti=ti, token="minted-at-queue-time", dag_rel_path=f"{dag_id}.py",
                       bundle_info=BundleInfo(name="dags-folder"), log_path=None)


def run_cycle(executor: Any, *workloads: Any) -> list[Any]:
    """Queue ``workloads`` on a :func:`queue_reading_executor`, run one scheduling cycle and
    return the keys of the workloads it sent to the workers' queue."""
    for w in workloads:
        executor.queue_workload(w, session=None)
    executor.trigger_tasks(executor.parallelism)
    started = []
    while not executor.activity_queue.empty():
        started.append(executor.activity_queue.get()[0].key)
    return started


def wait_on_cluster(cluster: Any, what: str, check: Any, timeout: float, interval: float = 1.0) -> Any:
    """``LocalCluster.wait`` that fails the test (with the cluster's logs) instead of raising."""
    try:
        return cluster.wait(what, check, timeout, interval)
    except AirflowBootError as exc:
        pytest.fail(str(exc))


def most_at_once(spans: list[tuple[float, int]]) -> int:
    """The most intervals open at one instant; ``spans``: (time, +1) at each start, (time, -1) at
    each end (at one instant an end comes before a start)."""
    held = peak = 0
    for _, step in sorted(spans):
        held += step
        peak = max(peak, held)
    return peak


def recording_celery_executor(
    monkeypatch: pytest.MonkeyPatch, url: str, fleet: Any, *, stale_after_s: float = 10.0, record: bool = True
) -> Iterator[Any]:
    """A ``GPUCeleryExecutor`` on the ledger at ``url`` with GPU hosts ``host-a`` and ``host-b``
    (the nodes of those names in the simulated ``fleet`` file) registered; what it would send to
    Celery is appended to ``executor.sent`` instead (the multihost tests send through Redis), or,
    with ``record=False``, really sent to the broker ``[celery] broker_url`` names.
    Use as the body of a fixture (``yield from``); needs the ``airflow_db`` fixture first."""
    monkeypatch.setenv("GPUSCHED_DB_URL", url)
    from gpusched.airflow import celery_executor
    from gpusched.hardware.detect import detect_backend
    from gpusched.hardware.host_slice import HostSlice

    sent: list[Any] = []

    def record_send(ex: Any, workloads: Any, **kwargs: Any) -> dict[Any, BaseException]:
        for workload in workloads:  # what CeleryExecutor's sending does, minus Celery
            sent.append(workload)
            ex.queued_tasks.pop(workload.key, None)
        return {}

    if record:
        monkeypatch.setattr(celery_executor, "celery_send", record_send)
    ex = celery_executor.GPUCeleryExecutor(parallelism=8)
    ex.sent = sent
    ex.ledger.migrate()
    for host in ("host-a", "host-b"):
        nodes = HostSlice(detect_backend("simulated", fleet=fleet), host).discover()
        ex.ledger.register_host(host, nodes, stale_after_s=stale_after_s, address=f"10.0.0.{len(host)}")
    yield ex
    ex.ledger.close()



class RedisServer:
    """A throwaway ``redis-server`` on 127.0.0.1 (no persistence unless ``appendonly``) that a test
    can stop and start again on the same port, as a broker outage or restart."""

    def __init__(self, folder: Path, *, appendonly: bool = False) -> None:
        from gpusched.deploy.multihost_cluster import free_port

        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed; run scripts/setup.sh (apt redis-server)")
        self.folder, self.appendonly, self.port = folder, appendonly, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait until it answers PING."""
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir",
             str(self.folder), "--appendonly", "yes" if self.appendonly else "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """SIGKILL it (what it held in memory is gone unless ``appendonly``)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
