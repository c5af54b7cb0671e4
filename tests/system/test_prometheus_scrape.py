"""A real Prometheus scrapes a running ``gpusched agent``, and the scheduler of the main job
(``scripts/run.sh``) while its GPUExecutor runs GPU tasks, with the shipped configuration.

Needs Debian's ``prometheus`` package (``prometheus`` and ``promtool``; scripts/setup.sh installs
it). The agent runs on the simulated fleet against a SQLite ledger that holds one waiting task;
Prometheus runs the shipped ``deploy/prometheus/prometheus.yml`` (only the targets and the scrape
interval changed for the test) and its rules, and the test reads metrics back through
Prometheus' HTTP query API.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from _run_sh_support import healthy, login, run_sh_airflow, trigger, wait_for
from prometheus_client.parser import text_string_to_metric_families

from gpusched.airflow.scheduler_metrics import reason_kind
from gpusched.deploy.airflow_instance import free_port
from gpusched.hardware.detect import detect_backend
from gpusched.ledger import Ledger
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import Hold

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "prometheus"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed; install Debian's prometheus package (scripts/setup.sh)")
    return path


def _wait_http(url: str, deadline_s: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} did not answer in {deadline_s} s:\n{log.read_text()[-3000:]}")


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _query_until(base: str, expr: str, deadline_s: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + deadline_s
    while True:
        result = _query(base, expr)
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(0.5)


def _start_prometheus(prometheus: str, job_name: str, target: str, tmp_path: Path,
                      processes: list[subprocess.Popen[bytes]]) -> tuple[str, Path]:
    """Start Prometheus on the shipped configuration and rules, with only job ``job_name``,
    scraping ``target`` every second; once it is ready, its base URL and its log."""
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == job_name]
    job["static_configs"][0]["targets"] = [target]
    config["scrape_configs"] = [job]
    config["rule_files"] = [str(DEPLOY / name) for name in config["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    base, prom_log = f"127.0.0.1:{free_port()}", tmp_path / "prometheus.log"
    with prom_log.open("wb") as out:
        processes.append(subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address={base}"],
            stdout=out, stderr=subprocess.STDOUT,
        ))
    _wait_http(f"http://{base}/-/ready", 60, processes[-1], prom_log)
    return f"http://{base}", prom_log


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_shipped_config_and_rules_pass_promtool() -> None:
    promtool = _tool("promtool")
    for args in (["check", "config", "prometheus.yml"], ["check", "config", "prometheus.compose.yml"],
                 ["check", "rules", "gpusched.rules.yml"], ["test", "rules", "gpusched.rules.test.yml"]):
        done = subprocess.run([promtool, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"


def test_prometheus_scrapes_dcgm_and_gpusched_metrics_from_the_agent(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    prometheus = _tool("prometheus")
    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    backend = detect_backend("simulated")
    try:
        nodes = backend.discover()
    finally:
        backend.close()
    fleet_uuids = {device.uuid for node in nodes for device in node.devices}
    with Ledger(db_url) as ledger:
        ledger.migrate()
        waiting_since = time.time() - 120
        ledger.record_queue("dag/train/run/0", GPURequest.build(count=64, partition="training"),
                            "no node has 64 free GPUs", now=waiting_since)

    agent_port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "GPUSCHED_BACKEND": "simulated"}
    agent_log = tmp_path / "agent.log"
    with agent_log.open("wb") as out:
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "gpusched.cli", "agent", "--backend", "simulated", "--interval", "1",
             "--port", str(agent_port), "--db-url", db_url], env=env, stdout=out, stderr=subprocess.STDOUT,
        ))
    _wait_http(f"http://127.0.0.1:{agent_port}/metrics", 60, processes[0], agent_log)

    base, prom_log = _start_prometheus(prometheus, "gpusched-agent", f"127.0.0.1:{agent_port}", tmp_path,
                                       processes)

    with urllib.request.urlopen(f"http://127.0.0.1:{agent_port}/metrics", timeout=5) as response:
        served = {family.name: family for family in text_string_to_metric_families(response.read().decode())}
    sampled = {sample.labels["UUID"] for sample in served["DCGM_FI_DEV_GPU_TEMP"].samples}
    assert sampled and sampled <= fleet_uuids  # powered devices (standby nodes are not sampled)

    temps = _query_until(base, "DCGM_FI_DEV_GPU_TEMP")
    assert temps, f"Prometheus has no DCGM_FI_DEV_GPU_TEMP:\n{prom_log.read_text()[-3000:]}"
    assert {row["metric"]["UUID"] for row in temps} == sampled
    assert all(row["metric"]["job"] == "gpusched-agent" and row["metric"]["cluster"] == "gpusched"
               for row in temps)
    assert {"gpu", "device", "modelName", "Hostname"} <= set(temps[0]["metric"])
    assert all(float(row["value"][1]) > 0 for row in temps)

    healthy = _query_until(base, 'gpusched_device_health{state="healthy"} == 1')
    assert {row["metric"]["UUID"] for row in healthy} == fleet_uuids
    wait = _query_until(base, 'gpusched_queue_oldest_wait_seconds{partition="training"}')
    assert len(wait) == 1 and float(wait[0]["value"][1]) >= 120

    with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=5) as response:
        groups = json.load(response)["data"]["groups"]
    names = {rule["name"] for group in groups for rule in group["rules"]}
    assert names == {"GpuschedDeviceUnhealthy", "GpuschedDeviceMemoryLeak", "GpuschedQueueWaitTooLong",
                     "GpuschedTenantNearBudget", "GpuschedTasksWaitingForCapacity", "GpuschedHostLost"}


SCHEDULER_DAG = """
from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu

RELEASE = Path({release!r})


@dag(dag_id="metrics_scrape", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def metrics_scrape():
    for name in ("first", "second"):  # one H100 node is in service: one runs, the other waits
        @task(task_id=name, **gpu(gpus=8, models=["H100-SXM-80GB"]))
        def whole_node() -> None:
            deadline = time.monotonic() + 600
            while not RELEASE.exists() and time.monotonic() < deadline:
                time.sleep(1)

        whole_node()


metrics_scrape()
"""


@pytest.mark.airflow
def test_prometheus_scrapes_the_schedulers_decisions_while_the_gpu_executor_runs_work(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """run.sh's scheduler serves ``[gpusched] metrics_port``; Prometheus (the shipped config's
    scheduler job) reads the decision histogram and a task waiting for capacity back, and the
    wait ends once the devices are free."""
    prometheus = _tool("prometheus")
    home, dags = tmp_path / "home", tmp_path / "dags"
    home.mkdir()
    dags.mkdir()
    release = tmp_path / "release"
    (dags / "metrics_scrape.py").write_text(SCHEDULER_DAG.replace("{release!r}", repr(str(release))))
    metrics_port = free_port()
    env = {"AIRFLOW__GPUSCHED__METRICS_PORT": str(metrics_port),
           "GPUSCHED_AGENT": "0",  # no standby scale-out: the second task waits for the first
           "GPUSCHED_QUOTA_FILE": str(home / "no-quota.yaml")}  # no quota: it waits for devices only
    boot = run_sh_airflow(home, dags, env)
    airflow = next(boot)
    try:
        wait_for("the api-server, scheduler and dag-processor", lambda: healthy(airflow), 300, airflow)
        airflow.token = wait_for("a login token", lambda: login(airflow), 60, airflow)
        wait_for("the DAG to be parsed", lambda: "metrics_scrape" in {
            d["dag_id"] for d in airflow.api("GET", "/dags")["dags"]}, 180, airflow)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            assert "gpusched_scheduler_decision_seconds" in response.read().decode()

        base, prom_log = _start_prometheus(prometheus, "gpusched-scheduler", f"127.0.0.1:{metrics_port}",
                                           tmp_path, processes)

        run_id = trigger(airflow, "metrics_scrape")
        ledger = Ledger(f"sqlite:///{home / 'gpusched' / 'ledger.db'}")
        try:
            entry = wait_for("one task to wait for the other's GPUs", lambda: ledger.queue(), 180, airflow)[0]
            assert reason_kind(Hold(entry.key, entry.reason)) == "capacity", entry.reason
            assert len(ledger.active()) == 1
            waiting = _query_until(base, 'gpusched_scheduler_pending_tasks{reason="capacity"} == 1')
            assert waiting, f"no waiting task counted under capacity:\n{prom_log.read_text()[-3000:]}"
            assert waiting[0]["metric"]["job"] == "gpusched-scheduler"
            assert waiting[0]["metric"]["cluster"] == "gpusched"
            others = _query(base, 'sum(gpusched_scheduler_pending_tasks{reason!="capacity"})')
            assert float(others[0]["value"][1]) == 0
            decided = _query_until(base, "gpusched_scheduler_decision_seconds_count > 0")
            assert decided and float(decided[0]["value"][1]) >= 2  # the cycle that placed, those that held
            assert _query_until(base, 'gpusched_scheduler_decision_seconds_bucket{le="+Inf"} > 0')
            assert _query_until(base, "gpusched_scheduler_placements_total >= 1")
            assert _query_until(base, 'gpusched_scheduler_holds_total{reason="capacity"} >= 1')
            assert _query_until(base, 'gpusched_scheduler_oldest_wait_seconds{reason="capacity"} > 0')
            assert _query_until(base, 'gpusched_scheduler_partition_gpu_hours{partition="training"}')

            release.write_text("done")
            wait_for("both tasks to finish", lambda: all(
                airflow.api("GET", f"/dags/metrics_scrape/dagRuns/{run_id}/taskInstances/{t}")["state"]
                == "success" for t in ("first", "second")), 300, airflow, interval=2)
            assert _query_until(base, "gpusched_scheduler_placements_total >= 2")
            assert _query_until(base, 'gpusched_scheduler_pending_tasks{reason="capacity"} == 0')
        finally:
            ledger.close()
        with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=5) as response:
            groups = json.load(response)["data"]["groups"]
        names = {rule["name"] for group in groups for rule in group["rules"]}
        assert {"GpuschedTasksWaitingForCapacity", "GpuschedHostLost"} <= names
    finally:
        boot.close()  # stops run.sh (the generator's finally)
