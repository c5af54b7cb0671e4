"""docker-compose.yaml: structure (always) and `docker compose config` (when Compose is installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpusched.deploy.multihost_cluster import LOCATION_VARS, compose_environments
from gpusched.gang import is_loopback

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _nvidia(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if d.get("driver") == "nvidia" and ["gpu"] in [d.get("capabilities")]]


def test_official_airflow_shape(compose: dict[str, Any]) -> None:
    services = compose["services"]
    always = ("postgres", "airflow-init", "airflow-apiserver", "airflow-dag-processor", "airflow-triggerer")
    for name in always:
        assert name in services and "profiles" not in services[name], name
    assert services["airflow-apiserver"]["command"] == "api-server"
    assert services["airflow-apiserver"]["ports"] == ["8080:8080"]
    assert services["airflow-init"]["environment"]["_AIRFLOW_DB_MIGRATE"] == "true"
    assert "python -m gpusched.cli ledger migrate" in services["airflow-init"]["command"][1]


def test_gpusched_installed_and_ledger_on_postgres(compose: dict[str, Any]) -> None:
    env = compose["services"]["airflow-apiserver"]["environment"]
    ledger_url = env["GPUSCHED_DB_URL"]
    assert ledger_url.startswith("postgresql+psycopg2://") and ledger_url.endswith("/gpusched")
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
    assert "gpusched.airflow.executor.GPUExecutor" in env["AIRFLOW__CORE__EXECUTOR"]
    init_sql = compose["services"]["postgres"]["volumes"][1].split(":")[0]
    assert "CREATE DATABASE gpusched" in (REPO / init_sql).read_text()
    dockerfile = (REPO / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "FROM apache/airflow:3.3.2" in dockerfile
    assert "-c /tmp/dist/constraints.txt" in dockerfile  # the wheel is installed pinned
    assert compose["x-airflow-common"]["build"] == "."


def test_one_scheduler_per_profile_and_gpu_reservations(compose: dict[str, Any]) -> None:
    services = compose["services"]
    schedulers = {n: s for n, s in services.items() if s.get("command") == "scheduler"}
    by_profile: dict[str, list[str]] = {}
    for name, svc in schedulers.items():
        for profile in svc["profiles"]:
            by_profile.setdefault(profile, []).append(name)
    assert by_profile == {"simulated": ["airflow-scheduler-simulated"], "gpu": ["airflow-scheduler"],
                          "celery": ["airflow-scheduler-celery"]}
    assert _nvidia(services["airflow-scheduler"])  # LocalExecutor-based: tasks run here
    assert not _nvidia(services["airflow-scheduler-simulated"])
    assert services["airflow-scheduler-simulated"]["environment"]["GPUSCHED_BACKEND"] == "simulated"
    assert _nvidia(services["gpusched-agent"])


def test_celery_variant_one_worker_and_agent_per_gpu_host(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["redis"]["profiles"] == ["celery"]
    executor = "gpusched.airflow.celery_executor.GPUCeleryExecutor"
    assert services["airflow-scheduler-celery"]["environment"]["AIRFLOW__CORE__EXECUTOR"] == executor
    workers = {n: s for n, s in services.items() if str(s.get("command", "")).startswith("celery worker")}
    assert len(workers) >= 2
    hosts, gpus = set(), []
    for svc in workers.values():
        assert svc["profiles"] == ["celery"] and svc["environment"]["AIRFLOW__CORE__EXECUTOR"] == executor
        host = svc["environment"]["GPUSCHED_HOST"]
        queues = svc["command"].split("--queues ")[1].split()[0].split(",")
        assert f"gpusched@{host}" in queues  # the queue the executor routes the host's tasks to
        hosts.add(host)
        (reservation,) = _nvidia(svc)
        gpus.extend(reservation["device_ids"])
        agent = services[f"gpusched-agent-{host}"]
        assert agent["command"][:3] == ["agent", "--host-name", host]
        assert _nvidia(agent)[0]["device_ids"] == reservation["device_ids"]  # the same GPUs
    assert len(hosts) == len(workers)
    assert len(gpus) == len(set(gpus))  # no GPU reserved by two hosts


def test_a_gpu_hosts_worker_and_agent_share_the_rendezvous_address_of_the_worker(
    compose: dict[str, Any]
) -> None:
    services = compose["services"]
    workers = {n: s for n, s in services.items() if str(s.get("command", "")).startswith("celery worker")}
    addresses = set()
    for name, worker in workers.items():
        host = worker["environment"]["GPUSCHED_HOST"]
        agent = services[f"gpusched-agent-{host}"]
        address = worker["environment"]["GPUSCHED_HOST_ADDRESS"]
        # rank 0 of a gang runs in the worker: its service name resolves to that container
        assert address == name and agent["environment"]["GPUSCHED_HOST_ADDRESS"] == address
        assert not is_loopback(address) and "network_mode" not in agent
        addresses.add(address)
    assert len(addresses) == len(workers)
    # the one-machine test cluster keeps its own (loopback) address instead of the compose name
    assert "GPUSCHED_HOST_ADDRESS" in LOCATION_VARS
    assert all("GPUSCHED_HOST_ADDRESS" not in env for env in compose_environments().values())


def test_no_hand_written_queue_anywhere() -> None:
    for path in [*REPO.glob("dags/*.py"), COMPOSE, REPO / "README.md", *REPO.glob("docs/*.md")]:
        text = path.read_text()
        assert 'queue="gpu-host' not in text and "queue='gpu-host" not in text, path


def test_compose_config_validates() -> None:
    if shutil.which("docker-compose"):
        command = ["docker-compose", "-f", str(COMPOSE), "config", "-q"]
    elif shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                   capture_output=True).returncode == 0:
        command = ["docker", "compose", "-f", str(COMPOSE), "config", "-q"]
    else:
        pytest.skip("Docker Compose is not installed (apt-get install -y docker-compose)")
    env = {**os.environ, "AIRFLOW_UID": "50000"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr


def test_monitoring_profile_scrapes_every_scheduler_and_agent(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prometheus = services["prometheus"]
    assert prometheus["profiles"] == ["monitoring"] and prometheus["ports"] == ["9090:9090"]
    assert "/etc/prometheus:ro" in prometheus["volumes"][0]
    config_name = prometheus["command"][0].removeprefix("--config.file=/etc/prometheus/")
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / config_name).read_text())
    targets = {job["job_name"]: set(job["static_configs"][0]["targets"]) for job in config["scrape_configs"]}
    schedulers = {name for name, s in services.items() if s.get("command") == "scheduler"}
    agents = {name for name, s in services.items() if "agent" in (s.get("command") or [])}
    assert len(schedulers) == 3 and len(agents) == 3
    for name in schedulers:  # each serves its metrics to the compose network
        env = services[name]["environment"]
        served = env["AIRFLOW__GPUSCHED__METRICS_PORT"], env["AIRFLOW__GPUSCHED__METRICS_HOST"]
        assert served == ("9401", "0.0.0.0")
    assert targets["gpusched-scheduler"] == {f"{name}:9401" for name in schedulers}
    assert targets["gpusched-agent"] == {f"{name}:9400" for name in agents}
    assert config["rule_files"] == ["gpusched.rules.yml"]
