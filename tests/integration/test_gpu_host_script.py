"""scripts/gpu_host.sh: one line per missing or invalid setting, and the exact agent and worker
command lines (run with ``bash`` against fake ``gpusched``, ``airflow`` and ``hostname``
executables that record their arguments)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_host.sh"
EXECUTOR = "gpusched.airflow.celery_executor.GPUCeleryExecutor"

SETTINGS = {
    "AIRFLOW__CORE__EXECUTOR": EXECUTOR,
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql+psycopg://airflow:pw@control-host/airflow",
    "AIRFLOW__CELERY__BROKER_URL": "redis://control-host:6379/0",
    "AIRFLOW__CELERY__RESULT_BACKEND": "db+postgresql+psycopg://airflow:pw@control-host/airflow",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://control-host:8080/execution/",
    "GPUSCHED_DB_URL": "postgresql+psycopg://airflow:pw@control-host/gpusched",
}

# Records its arguments one per line; then, once both fakes have started, exits with
# $FAKE_<NAME>_EXIT when that is set, else runs until SIGTERM (recorded as a last line "TERM").
_FAKE = """#!/usr/bin/env bash
name=$(basename "$0")
trap 'echo TERM >> "$FAKE_OUT/$name.argv"; kill "$pid" 2>/dev/null; exit 0' TERM
printf '%s\\n' "$@" > "$FAKE_OUT/$name.argv"
var="FAKE_${name^^}_EXIT"
if [ -n "${!var:-}" ]; then
    for _ in $(seq 100); do
        if [ -e "$FAKE_OUT/gpusched.argv" ] && [ -e "$FAKE_OUT/airflow.argv" ]; then break; fi
        sleep 0.05
    done
    exit "${!var}"
fi
sleep 30 &
pid=$!
wait
"""

_HOSTNAME = """#!/usr/bin/env bash
if [ "${1:-}" = -I ]; then echo "$FAKE_ADDRESSES"; else echo "$FAKE_HOSTNAME"; fi
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the script in a tree without .venv (the script puts a .venv/bin first on PATH)."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tmp_path / "repo" / "scripts" / "gpu_host.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("gpusched", _FAKE), ("airflow", _FAKE), ("hostname", _HOSTNAME)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "out").mkdir()
    return tmp_path


def _path_without_real_commands(bin_dir: Path) -> str:
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not any((Path(d) / c).exists() for c in ("gpusched", "airflow"))]
    return os.pathsep.join([str(bin_dir), *keep])


def _run(base: Path, env: dict[str, str], *args: str, fakes: bool = True) -> subprocess.CompletedProcess[str]:
    path = _path_without_real_commands(base / "bin") if fakes else _path_without_real_commands(base / "none")
    full = {"PATH": path, "HOME": str(base), "FAKE_OUT": str(base / "out"), "FAKE_HOSTNAME": "gpu-node-7",
            "FAKE_ADDRESSES": "10.1.2.7 172.17.0.1", **env}
    return subprocess.run(["bash", str(base / "repo" / "scripts" / "gpu_host.sh"), *args], env=full,
                          capture_output=True, text=True, timeout=60)


def _argv(base: Path, name: str) -> list[str]:
    return (base / "out" / f"{name}.argv").read_text().splitlines()


def _lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return result.stderr.splitlines()


def test_every_missing_setting_is_one_line_and_nothing_starts(repo: Path) -> None:
    result = _run(repo, {})
    assert result.returncode == 2
    lines = _lines(result)
    assert len(lines) == len(SETTINGS)
    for line, name in zip(lines, SETTINGS, strict=True):
        assert line.startswith(f"gpu_host.sh: {name} is not set; ") and "README" in line, line
    assert list((repo / "out").iterdir()) == []  # neither the agent nor the worker ran


@pytest.mark.parametrize(("setting", "value", "says"), [
    ("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor", f"not name the GPU Celery executor; set it to {EXECUTOR}"),
    ("GPUSCHED_DB_URL", "sqlite:///ledger.db", "is a file on this host"),
    ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "sqlite:///airflow.db", "point it at the control host's"),
    ("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "control-host:8080", "is not an http(s) URL"),
    ("GPUSCHED_HOST", "gpu node 7", "is not a host name"),
    ("GPUSCHED_HOST_ADDRESS", "0.0.0.0", "is a bind address"),
    ("GPUSCHED_METRICS_PORT", "70000", "is not a port; set it to 0-65535"),
    ("GPUSCHED_METRICS_PORT", "http", "is not a port"),
    ("GPUSCHED_METRICS_HOST", "10.0.0.5 0.0.0.0", "is not an address"),
])
def test_an_invalid_setting_is_one_line_naming_it_and_the_fix(
    repo: Path, setting: str, value: str, says: str
) -> None:
    result = _run(repo, {**SETTINGS, setting: value})
    assert result.returncode == 2
    (line,) = _lines(result)
    assert line.startswith(f"gpu_host.sh: {setting}") and says in line, line
    assert list((repo / "out").iterdir()) == []


def test_a_derived_loopback_address_is_refused_and_an_explicit_one_is_taken(repo: Path) -> None:
    result = _run(repo, {**SETTINGS, "FAKE_ADDRESSES": "127.0.1.1"})
    assert result.returncode == 2
    (line,) = _lines(result)
    assert "GPUSCHED_HOST_ADDRESS is not set" in line and "127.0.1.1 is loopback" in line, line
    result = _run(repo, {**SETTINGS, "FAKE_ADDRESSES": ""})
    assert result.returncode == 2 and "shows no address" in result.stderr
    # one machine on purpose (every GPU host here): taken as given
    result = _run(repo, {**SETTINGS, "GPUSCHED_HOST_ADDRESS": "127.0.0.1", "FAKE_AIRFLOW_EXIT": "0"})
    assert result.returncode == 0, result.stderr
    assert _argv(repo, "gpusched")[:5] == ["agent", "--host-name", "gpu-node-7", "--address", "127.0.0.1"]


def test_missing_commands_are_named(repo: Path) -> None:
    result = _run(repo, SETTINGS, fakes=False)
    assert result.returncode == 2
    assert [line.split("`")[1] for line in _lines(result)] == ["gpusched", "airflow"]


def test_the_agent_and_worker_start_with_the_hosts_name_address_and_metrics_bind(repo: Path) -> None:
    env = {**SETTINGS, "GPUSCHED_HOST": "gpu-a", "GPUSCHED_HOST_ADDRESS": "10.0.0.5",
           "GPUSCHED_METRICS_HOST": "10.0.0.5", "GPUSCHED_METRICS_PORT": "9500", "FAKE_AIRFLOW_EXIT": "0"}
    result = _run(repo, env, "--concurrency", "8")
    assert result.returncode == 0, result.stderr
    assert _argv(repo, "gpusched") == ["agent", "--host-name", "gpu-a", "--address", "10.0.0.5",
                                       "--host", "10.0.0.5", "--port", "9500", "TERM"]  # stopped with it
    assert _argv(repo, "airflow") == ["celery", "worker", "--queues", "gpusched@gpu-a,default",
                                      "--concurrency", "8"]
    assert "the Celery worker ended (exit 0); stopping the agent" in result.stderr


def test_defaults_name_the_host_after_hostname_and_bind_metrics_to_loopback(repo: Path) -> None:
    result = _run(repo, {**SETTINGS, "FAKE_AIRFLOW_EXIT": "0"})
    assert result.returncode == 0, result.stderr
    assert _argv(repo, "gpusched")[:-1] == ["agent", "--host-name", "gpu-node-7", "--address", "10.1.2.7",
                                            "--host", "127.0.0.1", "--port", "9400"]
    assert _argv(repo, "airflow")[:3] == ["celery", "worker", "--queues"]
    assert _argv(repo, "airflow")[3] == "gpusched@gpu-node-7,default"


def test_an_agent_that_ends_stops_the_worker_with_its_exit_code(repo: Path) -> None:
    result = _run(repo, {**SETTINGS, "FAKE_GPUSCHED_EXIT": "2"})
    assert result.returncode == 2
    assert "gpu_host.sh: the agent ended (exit 2); stopping the Celery worker" in result.stderr
    assert _argv(repo, "airflow")[-1] == "TERM"  # warm shutdown asked for


def test_sigterm_stops_both(repo: Path) -> None:
    env = {**os.environ, **SETTINGS, "PATH": _path_without_real_commands(repo / "bin"),
           "FAKE_OUT": str(repo / "out"), "FAKE_HOSTNAME": "gpu-node-7", "FAKE_ADDRESSES": "10.1.2.7"}
    proc = subprocess.Popen(["bash", str(repo / "repo" / "scripts" / "gpu_host.sh")], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(100):
            if all((repo / "out" / f"{n}.argv").exists() for n in ("gpusched", "airflow")):
                break
            time.sleep(0.1)
        proc.terminate()
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + 15
    assert _argv(repo, "gpusched")[-1] == "TERM" and _argv(repo, "airflow")[-1] == "TERM"
