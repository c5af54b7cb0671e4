"""Shared by the system tests that boot the main job (``scripts/run.sh`` → ``airflow standalone``
on the PostgreSQL run.sh starts itself, SQLite without the server binaries; the simulated fleet):
start and stop it, wait on it, read its API and task logs."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpusched.deploy.airflow_instance import (
    free_port,
    login_token,
    scheduler_healthy,
    stop_run_sh,
    wait_until,
)
from gpusched.errors import AirflowBootError

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Airflow:
    """One running main job: its home, API base URL, the run.sh process and its output file."""

    home: Path
    url: str
    proc: subprocess.Popen[bytes]
    output: Path
    started_at: float
    token: str = ""
    pgdata: Path | None = None
    """Where run.sh keeps Airflow's PostgreSQL (None when it runs on SQLite)."""

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """``/api/v2{path}`` with the token; asserts a 2xx answer and returns its JSON."""
        import httpx

        response = httpx.request(method, f"{self.url}/api/v2{path}", headers=self.headers(), timeout=30,
                                 **kwargs)
        # The main job's output (the API server's log among it) says why a request failed.
        assert response.status_code < 300, (
            f"{method} {path}: {response.status_code} {response.text}\n--- run.sh output ---\n{self.tail()}")
        return response.json()

    def tail(self) -> str:
        return self.output.read_text(errors="replace")[-6000:]


def postgres_installed() -> bool:
    """Whether the PostgreSQL server binaries are there, so that run.sh runs Airflow on PostgreSQL
    (``scripts/start_postgres.sh`` looks in ``PATH``, then ``/usr/lib/postgresql/*/bin``)."""
    return shutil.which("initdb") is not None or bool(glob.glob("/usr/lib/postgresql/*/bin/initdb"))


def run_sh_airflow(home: Path, dags: Path, env_extra: Mapping[str, str], *,
                   log_server_ports: bool = True) -> Iterator[Airflow]:
    """Boot ``scripts/run.sh`` on a free port with ``dags`` as the DAG folder, the simulated
    backend and ``env_extra`` on top of a clean environment (no inherited AIRFLOW*/GPUSCHED*);
    stop it afterwards. Use as the body of a fixture (``yield from``). ``log_server_ports=False``
    leaves the ports of Airflow's log servers to run.sh, as for users (else free ones are set).

    Airflow's database is what run.sh picks, as for users: its own PostgreSQL when the server
    binaries are installed. Its data goes to a folder of its own under the system's temporary
    folder (``GPUSCHED_PGDATA``), which the server's user can reach when the tests run as root
    (pytest's folders are closed to it), and which is removed afterwards."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
    pgdata = Path(tempfile.mkdtemp(prefix="gpusched-pg-"))  # in /tmp: reachable by the server user
    env.update({
        "GPUSCHED_AIRFLOW_HOME": str(home), "GPUSCHED_DAGS_FOLDER": str(dags), "GPUSCHED_PORT": str(port),
        "GPUSCHED_BACKEND": "simulated", "GPUSCHED_PGDATA": str(pgdata),
    })
    if log_server_ports:
        env.update({"AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
                    "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port())})
    env.update(env_extra)
    output = home / "run.log"
    started = time.time()
    with output.open("wb") as sink:
        proc = subprocess.Popen([str(REPO / "scripts" / "run.sh")], cwd=REPO, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    uses_postgres = postgres_installed() and env.get("GPUSCHED_METADB", "postgres") == "postgres"
    try:
        yield Airflow(home, f"http://localhost:{port}", proc, output, started,
                      pgdata=pgdata if uses_postgres else None)
    finally:
        stop_run_sh(proc)
        if (pgdata / "data" / "postmaster.pid").exists():  # run.sh did not get to stop it
            subprocess.run(["bash", str(REPO / "scripts" / "start_postgres.sh"), "--halt", str(pgdata)],
                           check=False, timeout=120)
        shutil.rmtree(pgdata, ignore_errors=True)


def wait_for(what: str, check: Any, timeout: float, airflow: Airflow, interval: float = 1.0) -> Any:
    """``check()``'s first truthy value; fails the test (with run.sh's log) on timeout or exit."""
    try:
        return wait_until(what, check, timeout, proc=airflow.proc, log=airflow.output, interval=interval)
    except AirflowBootError as exc:
        pytest.fail(str(exc))


def login(airflow: Airflow) -> str:
    return login_token(airflow.home, airflow.url)


def healthy(airflow: Airflow) -> bool:
    return scheduler_healthy(airflow.url)


def log_text(airflow: Airflow, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
    """The whole log of one try, as the log API returns it (JSON text)."""
    body = airflow.api(
        "GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
        params={"full_content": "true"},
    )
    return json.dumps(body)


def trigger(airflow: Airflow, dag_id: str) -> str:
    """Unpause ``dag_id``, start a manual run and return its run id."""
    airflow.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
    return str(airflow.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None})["dag_run_id"])


def finished_ti(airflow: Airflow, dag_id: str, run_id: str, task_id: str) -> dict[str, Any] | None:
    """The task instance once it succeeded or failed, else None."""
    found = dict(airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"))
    return found if found["state"] in ("success", "failed") else None
