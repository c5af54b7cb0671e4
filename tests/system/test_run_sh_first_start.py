"""What a new user meets on the first ``scripts/run.sh`` of a fresh clone (real Airflow processes,
on run.sh's defaults: no quota file of their own, no log-server ports chosen for it).

- The gpusched plugin is registered once (the plugins-folder shim and the installed package's entry
  point no longer both register it): no "Plugin Import Error" on the Home page. The same holds
  without run.sh, where docker-compose.yaml mounts plugins/ into an image with the entry point.
- Airflow's log servers take free ports when Airflow's defaults (8793, 8794) are taken, so a second
  instance starts beside the first. Airflow 3.3 binds them to all interfaces with no setting for
  the address (airflow/utils/serve_logs/core.py: ``host=""``): every other listening socket of the
  instance is on loopback.
- A DAG file added while Airflow runs appears within run.sh's 30 s refresh interval (Airflow's
  default: 300 s).
- No "HMAC key is 24 bytes long" warning from every process: the first start writes airflow.cfg
  with a JWT secret of 64 random bytes (Airflow's own is 16).
- The example quota file is in force: the 70/20/10 partitions and the example tenants' weekly
  budgets are enforced, and an example DAG still runs.
"""

from __future__ import annotations

import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _run_sh_support import REPO, Airflow, finished_ti, healthy, login, run_sh_airflow, trigger, wait_for

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

AIRFLOW_LOG_PORTS = (8793, 8794)
LATE_DAG = "first_start_late_dag"
LATE_DAG_SOURCE = """
from datetime import datetime

from airflow.sdk import dag, task


@dag(dag_id="first_start_late_dag", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def first_start_late_dag():
    @task
    def hello() -> None:
        print("hello")

    hello()


first_start_late_dag()
"""


def _hold(port: int) -> socket.socket | None:
    """A socket bound to ``port`` on loopback, as another instance's log server would hold it
    (None when something else holds the port already: it is taken either way)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    sock.listen()
    return sock


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")
    shutil.copy(REPO / "dags" / "example_dev_smoke_test.py", dags)
    held = [sock for sock in map(_hold, AIRFLOW_LOG_PORTS) if sock is not None]
    try:
        yield from run_sh_airflow(
            home, dags, {"GPUSCHED_EXAMPLE_STEPS": "2", "GPUSCHED_EXAMPLE_STEP_SECONDS": "0.5"},
            log_server_ports=False)
    finally:
        for sock in held:
            sock.close()


@pytest.fixture(scope="module")
def ready(airflow: Airflow) -> Airflow:
    wait_for("api-server, scheduler and dag-processor to be healthy", lambda: healthy(airflow), 240, airflow)
    airflow.token = wait_for("a login token", lambda: login(airflow), 60, airflow)
    return airflow


def _gpusched(airflow: Airflow, path: str) -> Any:
    import httpx

    response = httpx.get(f"{airflow.url}/gpusched{path}", headers=airflow.headers(), timeout=30)
    assert response.status_code == 200, f"{path}: {response.status_code} {response.text}\n{airflow.tail()}"
    return response.json()


def test_the_plugin_is_registered_once_without_an_import_error(ready: Airflow) -> None:
    """Before: the plugins folder's shim and the entry point both registered "gpusched"; Airflow
    skipped the second and listed it as a plugin import error."""
    errors = ready.api("GET", "/plugins/importErrors")
    assert errors["total_entries"] == 0, errors
    names = [p["name"] for p in ready.api("GET", "/plugins", params={"limit": 100})["plugins"]]
    assert names.count("gpusched") == 1, names
    fleet = _gpusched(ready, "/fleet")
    assert fleet, "the fleet page's API answered nothing"


PLUGINS_PROBE = """
import json
from airflow import plugins_manager
plugins, errors = plugins_manager._get_plugins()
print(json.dumps({"names": [p.name for p in plugins], "errors": errors}))
"""


def test_the_plugins_folder_and_the_entry_point_register_the_plugin_once(tmp_path: Path) -> None:
    """As docker-compose.yaml deploys it (plugins/ mounted as the plugins folder of an image whose
    gpusched wheel has the entry point), without run.sh: one registration, no import error."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
    env.update({"AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False"})
    done = subprocess.run([sys.executable, "-c", PLUGINS_PROBE], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["errors"] == {} and found["names"].count("gpusched") == 1, found


def _listening(airflow: Airflow) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """(address, port) of the TCP sockets that run.sh's processes listen on: Airflow's log servers'
    (processes titled "airflow serve-logs"), and all others'."""
    import psutil

    root = psutil.Process(airflow.proc.pid)
    log_servers: set[tuple[str, int]] = set()
    others: set[tuple[str, int]] = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            title = " ".join(proc.cmdline())
            found = {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        (log_servers if "serve-logs" in title else others).update(found)
    return log_servers, others


def test_the_log_servers_take_free_ports_and_all_else_listens_on_loopback(ready: Airflow) -> None:
    """Before: with 8793 and 8794 taken (as by a first instance), both log servers failed to bind
    ("address already in use") and the logs of running tasks could not be served."""

    def both_log_servers() -> tuple[set[tuple[str, int]], set[tuple[str, int]]] | None:
        log_servers, others = _listening(ready)
        return (log_servers, others) if len({port for _, port in log_servers}) == 2 else None

    log_servers, others = wait_for("both log servers to listen", both_log_servers, 90, ready)
    log_ports = {port for _, port in log_servers}
    assert not log_ports & set(AIRFLOW_LOG_PORTS), log_servers
    said = re.search(r"Airflow's log servers on ports (\d+) and (\d+)",
                     ready.output.read_text(errors="replace"))
    assert said and {int(said[1]), int(said[2])} == log_ports, (log_servers, ready.tail())
    # Airflow 3.3 binds its log servers to all interfaces and offers no setting for the address.
    assert {addr for addr, _ in log_servers} <= {"0.0.0.0", "::"}, log_servers
    api_port = int(ready.url.rsplit(":", 1)[1])
    assert api_port in {port for _, port in others}, others
    assert {addr for addr, _ in others} <= {"127.0.0.1", "::1"}, others


def test_a_new_dag_file_appears_within_the_refresh_interval(ready: Airflow) -> None:
    """Before: the dag-processor looked for new files every 300 s (Airflow's default)."""
    wait_for("the example DAG to be parsed",
             lambda: ready.api("GET", "/dags", params={"dag_id_pattern": "example_dev_smoke_test"})["dags"],
             120, ready)
    dags_folder = next(line.split("DAGs from ", 1)[1].strip()
                       for line in ready.output.read_text().splitlines() if "DAGs from " in line)
    added = time.monotonic()
    (Path(dags_folder) / f"{LATE_DAG}.py").write_text(LATE_DAG_SOURCE)
    wait_for("the new DAG file to appear",
             lambda: ready.api("GET", "/dags", params={"dag_id_pattern": LATE_DAG})["dags"], 120, ready,
             interval=2)
    assert time.monotonic() - added < 90  # refresh interval 30 s, plus parsing on a busy machine


def test_the_example_quotas_are_enforced_and_an_example_dag_still_runs(ready: Airflow) -> None:
    """Before: no quota file shipped; the fleet page said "not enforced" (no partitions, no budgets)."""
    quotas = _gpusched(ready, "/quotas")
    assert quotas["enforced"] is True, quotas
    assert "quotas (tenant budgets, partition shares) from " in ready.output.read_text()
    shares = {p["partition"]: p["share_pct"] for p in quotas["partitions"]}
    assert shares == {"training": 70, "burst": 20, "dev": 10}, shares
    assert quotas["period_s"] == 7 * 86400 and quotas["borrowing"] is True
    budgets = {t["tenant"]: t["budget_hours"] for t in quotas["tenants"]}
    assert all(budgets.get(tenant) for tenant in ("vision", "nlp", "dev")), budgets

    wait_for("the example DAG to be parsed",
             lambda: ready.api("GET", "/dags", params={"dag_id_pattern": "example_dev_smoke_test"})["dags"],
             120, ready)
    run_id = trigger(ready, "example_dev_smoke_test")
    ti = wait_for("the smoke test to finish",
                  lambda: finished_ti(ready, "example_dev_smoke_test", run_id, "smoke_test"), 240, ready,
                  interval=2)
    assert ti["state"] == "success", f"{ti}\n{ready.tail()}"
    after = {t["tenant"]: t for t in _gpusched(ready, "/quotas")["tenants"]}
    assert after["dev"]["budget_hours"] == budgets["dev"], after


def test_the_scheduler_serves_its_metrics_on_the_port_it_prints(ready: Airflow) -> None:
    import httpx

    said = wait_for("run.sh to print the scheduler's metrics port", lambda: re.search(
        r"scheduler metrics on (http://127\.0\.0\.1:\d+/metrics)", ready.output.read_text(errors="replace")),
        30, ready)
    def metrics() -> str | None:
        try:
            response = httpx.get(said[1], timeout=10)
        except httpx.HTTPError:  # the scheduler's executor has not started yet
            return None
        return response.text if response.status_code == 200 else None

    text = wait_for("the scheduler's /metrics", metrics, 120, ready)
    assert "gpusched_scheduler_decision_seconds" in text, text[:2000]


def test_the_jwt_secret_is_long_enough_for_hs512(ready: Airflow) -> None:
    """Before: Airflow's generated 16-byte secret (24 characters) made PyJWT warn in every process."""
    import base64

    cfg = (ready.home / "airflow.cfg").read_text()
    secret = re.search(r"(?m)^jwt_secret\s*=\s*(\S+)\s*$", cfg)
    assert secret is not None, "no [api_auth] jwt_secret in airflow.cfg"
    assert len(base64.b64decode(secret.group(1))) == 64
    assert "HMAC key" not in ready.output.read_text(errors="replace"), ready.tail()
