"""End to end on Airflow's distributed engine: GPUCeleryExecutor, Redis, PostgreSQL, two GPU hosts.

Boots real processes on 127.0.0.1: ``redis-server``, a throwaway PostgreSQL (Airflow's metadata,
the Celery result backend and the gpusched ledger), ``airflow scheduler`` with
``GPUCeleryExecutor``, ``airflow api-server``, ``airflow dag-processor``, and per GPU host
(``host-a``: 2 A100, ``host-b``: 2 L40S of ``include/fleets/multihost.yaml``) one
``airflow celery worker --queues gpusched@<host>`` plus one ``gpusched agent --host-name <host>``,
each host in its own process group.

Shows: every GPU task ran in the worker of the host that owns its devices, with exactly those
devices visible; SIGKILL of one host mid-task marks it lost, releases its allocation, and the
task succeeds on a retry on the other host; at the end no allocation is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpusched.airflow.keys import ti_key

pytestmark = [pytest.mark.multihost, pytest.mark.airflow, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
HOSTS = ("host-a", "host-b")
DAG_SOURCE = '''
from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, get_current_context, task

from gpusched.airflow.authoring import gpu
from gpusched.airflow.gang import gang_task

OUT = Path(os.environ["GPUSCHED_TEST_OUT"])


def _record(name: str) -> None:
    ctx = get_current_context()
    ti = ctx["ti"]
    names = ("GPUSCHED_HOST", "CUDA_VISIBLE_DEVICES", "GPUSCHED_ALLOCATION", "MASTER_ADDR", "MASTER_PORT",
             "WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_WORLD_SIZE")
    seen = {k: os.environ.get(k) for k in names}
    seen["try_number"] = ti.try_number
    seen["pid"] = os.getpid()
    seen["started"] = time.time()
    (OUT / f"{name}-{ti.try_number}.json").write_text(json.dumps(seen))


@dag(dag_id="mh_models", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def mh_models():
    @task(task_id="on_a100", **gpu(gpus=1, models=["A100-SXM-80GB"]))
    def on_a100() -> None:
        _record("on_a100")

    @task(task_id="on_l40s", **gpu(gpus=2, models=["L40S"]))
    def on_l40s() -> None:
        _record("on_l40s")

    @task(task_id="plain")
    def plain() -> None:
        pass

    on_a100()
    on_l40s()
    plain()


@dag(dag_id="mh_victim", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def mh_victim():
    @task(task_id="victim", retries=2, retry_delay=timedelta(seconds=1),
          **gpu(gpus=1, vendor="nvidia"))
    def victim() -> None:
        _record("victim")
        if get_current_context()["ti"].try_number == 1:
            time.sleep(120)  # the test kills this host meanwhile

    victim()


@dag(dag_id="mh_gang", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def mh_gang():
    @gang_task(nodes=2, gpus_per_node=1, vendor="nvidia", interconnect="same_rack", retries=1,
               retry_delay=timedelta(seconds=1))
    def train() -> None:
        ti = get_current_context()["ti"]
        _record(ti.task_id)
        if ti.try_number == 1:
            if os.environ["NODE_RANK"] == "1":
                time.sleep(3)
                raise RuntimeError("rank 1 fails on its first try")
            time.sleep(120)  # rank 0 is stopped when rank 1 fails

    train()


mh_models()
mh_victim()
mh_gang()
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    home: Path
    out: Path
    url: str
    db_url: str
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        response = httpx.request(method, f"{self.url}/api/v2{path}", timeout=30, **kwargs)
        assert response.status_code < 300, f"{method} {path}: {response.status_code} {response.text}"
        return response.json()

    def tail(self) -> str:
        parts = []
        for name in self.procs:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
            parts.append(f"----- {name} -----\n{text[-2500:]}")
        return "\n".join(parts)

    def wait(self, what: str, check: Any, timeout: float, interval: float = 1.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and not name.startswith(HOSTS):
                    pytest.fail(f"{name} exited ({proc.returncode}) while waiting for {what}:\n{self.tail()}")
            try:
                result = check()
            except Exception:  # not up yet
                result = None
            if result:
                return result
            time.sleep(interval)
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{self.tail()}")


def _stop_all(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group: celery's pool children too
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; run scripts/setup.sh (apt-get install redis-server)")
    base = tmp_path_factory.mktemp("multihost")
    pgdir = Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True, check=True).stdout.strip())
    os.chmod(pgdir, 0o755)
    started = subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), str(pgdir)],
                             capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        pytest.fail(f"PostgreSQL did not start: {started.stderr}")
    db_url = started.stdout.strip()
    home, dags, out, logs = (base / n for n in ("home", "dags", "out", "logs"))
    for folder in (home, dags, out, logs):
        folder.mkdir()
    os.chmod(out, 0o777)
    (dags / "multihost_dags.py").write_text(DAG_SOURCE)
    api_port, redis_port = _free_port(), _free_port()
    broker = f"redis://127.0.0.1:{redis_port}/0"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
    env.update({
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__EXECUTOR": "gpusched.airflow.celery_executor.GPUCeleryExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": db_url,
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": db_url,  # psycopg 3 is async too (no asyncpg)
        "AIRFLOW__DATABASE__SQL_ALCHEMY_POOL_SIZE": "2",
        "AIRFLOW__CELERY__BROKER_URL": broker,
        "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + db_url,
        "AIRFLOW__CELERY__SYNC_PARALLELISM": "1",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API_AUTH__JWT_SECRET": "gpusched-multihost-test",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{api_port}/execution/",
        "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "600",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__GPUSCHED__HOST_TIMEOUT_SECONDS": "10",
        "GPUSCHED_DB_URL": db_url,
        "GPUSCHED_BACKEND": "simulated",
        "GPUSCHED_FLEET": str(REPO / "include" / "fleets" / "multihost.yaml"),
        "GPUSCHED_TEST_OUT": str(out),
    })
    cluster = Cluster(home, out, f"http://127.0.0.1:{api_port}", db_url, logs)

    def spawn(name: str, argv: list[str], extra: dict[str, str] | None = None) -> None:
        with (logs / f"{name}.log").open("wb") as sink:
            cluster.procs[name] = subprocess.Popen(argv, cwd=REPO, env={**env, **(extra or {})}, stdout=sink,
                                                   stderr=subprocess.STDOUT, start_new_session=True)

    airflow = [sys.executable, "-m", "airflow"]
    try:
        spawn("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no"])
        migrated = subprocess.run([*airflow, "db", "migrate"], env=env, cwd=REPO, capture_output=True,
                                  text=True, timeout=600)
        assert migrated.returncode == 0, migrated.stderr[-3000:]
        spawn("api-server", [*airflow, "api-server", "--port", str(api_port)])
        spawn("dag-processor", [*airflow, "dag-processor"])
        for host in HOSTS:
            host_env = {"GPUSCHED_HOST": host, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(_free_port())}
            spawn(f"{host}-agent", [sys.executable, "-m", "gpusched.cli", "agent", "--host-name", host,
                                    "--port", "0", "--interval", "30", "--heartbeat", "2",
                                    "--host-timeout", "10"], host_env)
            spawn(f"{host}-worker", [*airflow, "celery", "worker", "--queues", f"gpusched@{host},default",
                                     "--celery-hostname", f"{host}@%h", "--concurrency", "2",
                                     "--without-mingle", "--without-gossip"], host_env)
        spawn("scheduler", [*airflow, "scheduler"])
        yield cluster
    finally:
        _stop_all(cluster.procs)
        subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), "--stop", str(pgdir)],
                       capture_output=True, timeout=120)


def _healthy(cluster: Cluster) -> bool:
    import httpx

    health = httpx.get(f"{cluster.url}/api/v2/monitor/health", timeout=5).json()
    return bool(health["scheduler"]["status"] == "healthy" and health["dag_processor"]["status"] == "healthy")


def _run_dag(cluster: Cluster, dag_id: str) -> str:
    run = cluster.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None})
    return str(run["dag_run_id"])


def _run_state(cluster: Cluster, dag_id: str, run_id: str) -> str:
    return str(cluster.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"])


def _tis(cluster: Cluster, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
    body = cluster.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
    return {ti["task_id"]: ti for ti in body["task_instances"]}


def _seen(cluster: Cluster, name: str, try_number: int) -> dict[str, Any]:
    return dict(json.loads((cluster.out / f"{name}-{try_number}.json").read_text()))


def test_gpu_tasks_run_on_the_host_that_owns_their_devices_and_survive_a_host_death(cluster: Cluster) -> None:
    from gpusched.ledger import Ledger

    cluster.wait("scheduler and dag-processor to be healthy", lambda: _healthy(cluster), 300, 2)
    ledger = Ledger(cluster.db_url)
    try:
        cluster.wait("both GPU hosts to register", lambda: len(ledger.hosts()) == 2, 120)
        cluster.wait("the DAGs to be parsed", lambda: cluster.api("GET", "/dags/mh_victim"), 180, 2)
        cluster.wait("the DAGs to be parsed", lambda: cluster.api("GET", "/dags/mh_models"), 60, 2)
        started = time.time()

        # 1. Each task needs one host's model: it runs in that host's worker, with its devices.
        run_id = _run_dag(cluster, "mh_models")
        cluster.wait("mh_models to finish",
                     lambda: _run_state(cluster, "mh_models", run_id) in ("success", "failed"), 240, 2)
        tis = _tis(cluster, "mh_models", run_id)
        assert {t: ti["state"] for t, ti in tis.items()} == dict.fromkeys(tis, "success"), cluster.tail()
        history = {a.key: a for a in ledger.history(since=started - 5)}
        for task_id, host in (("on_a100", "host-a"), ("on_l40s", "host-b")):
            alloc = history[ti_key("mh_models", task_id, run_id, 1)]
            assert {s.node for s in alloc.shares} == {host}
            seen = _seen(cluster, task_id, 1)
            assert seen["GPUSCHED_HOST"] == host  # ran in that host's worker
            indices = ",".join(str(s.index) for s in sorted(alloc.shares, key=lambda s: s.index))
            assert seen["CUDA_VISIBLE_DEVICES"] == indices
            assert json.loads(seen["GPUSCHED_ALLOCATION"])["uuids"] == sorted(s.uuid for s in alloc.shares)
            assert alloc.released_at is not None

        # 2. A two-host gang: members start together on distinct hosts with one rendezvous; when
        #    rank 1 fails, rank 0 is stopped and the gang is retried as a whole.
        run_id = _run_dag(cluster, "mh_gang")
        cluster.wait("mh_gang to finish",
                     lambda: _run_state(cluster, "mh_gang", run_id) in ("success", "failed"), 240, 2)
        tis = _tis(cluster, "mh_gang", run_id)
        assert {t: (ti["state"], ti["try_number"]) for t, ti in tis.items()} == {
            "train__node0": ("success", 2), "train__node1": ("success", 2)}, cluster.tail()
        history = ledger.history(since=started - 5)
        for try_number in (1, 2):
            members = [_seen(cluster, f"train__node{rank}", try_number) for rank in (0, 1)]
            assert {m["GPUSCHED_HOST"] for m in members} == set(HOSTS)
            assert [m["NODE_RANK"] for m in members] == ["0", "1"]
            for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NNODES", "LOCAL_WORLD_SIZE"):
                assert len({m[name] for m in members}) == 1, name
            assert (members[0]["WORLD_SIZE"], members[0]["NNODES"]) == ("2", "2")
            allocs = [a for a in history if a.key in {ti_key("mh_gang", f"train__node{r}", run_id, try_number)
                                                      for r in (0, 1)}]
            assert len(allocs) == 2 and len({a.created_at for a in allocs}) == 1  # placed in one cycle
        stopped = {e.subject for e in ledger.events(kinds=["gang_stopped"], limit=50)}
        assert ti_key("mh_gang", "train__node0", run_id, 1) in stopped

        # 3. Kill the host running the victim mid-task: host lost, allocation released, retry elsewhere.
        run_id = _run_dag(cluster, "mh_victim")
        first_key = ti_key("mh_victim", "victim", run_id, 1)
        cluster.wait("the victim to start", lambda: (cluster.out / "victim-1.json").exists(), 180)
        first = ledger.get(first_key)
        assert first is not None and first.released_at is None
        doomed = first.shares[0].node
        survivor = next(h for h in HOSTS if h != doomed)
        assert _seen(cluster, "victim", 1)["GPUSCHED_HOST"] == doomed
        killed_at = time.time()
        for role in ("worker", "agent"):
            os.killpg(cluster.procs[f"{doomed}-{role}"].pid, signal.SIGKILL)
        cluster.wait("the victim to run again on the other host",
                     lambda: (cluster.out / "victim-2.json").exists(), 180)
        recovered_s = _seen(cluster, "victim", 2)["started"] - killed_at
        cluster.wait("mh_victim to finish",
                     lambda: _run_state(cluster, "mh_victim", run_id) in ("success", "failed"), 120, 2)
        victim = _tis(cluster, "mh_victim", run_id)["victim"]
        assert victim["state"] == "success" and victim["try_number"] == 2, cluster.tail()
        assert _seen(cluster, "victim", 2)["GPUSCHED_HOST"] == survivor
        lost = ledger.host(doomed)
        assert lost is not None and lost.state == "lost" and "no heartbeat" in (lost.reason or "")
        released = ledger.get(first_key)
        assert released is not None and released.released_at is not None
        assert "node lost" in (released.release_reason or "")
        second = ledger.history(since=started - 5)
        retry = [a for a in second if a.key == ti_key("mh_victim", "victim", run_id, 2)]
        assert len(retry) == 1 and {s.node for s in retry[0].shares} == {survivor}
        assert doomed not in {n.name for n in ledger.snapshot().nodes}
        print(f"host death -> task running on {survivor}: {recovered_s:.1f} s")

        # 4. Nothing is left allocated.
        cluster.wait("every allocation to be released", lambda: not ledger.active(), 60)
    finally:
        ledger.close()
