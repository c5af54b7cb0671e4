"""gpusched installs into a plain Airflow like a provider: wheel → fresh virtualenv → Airflow finds it.

Builds the sdist and, from it, the wheel (``python -m build``), checks both carry the package data,
installs the wheel with the pinned dependencies (constraints.txt) into a NEW virtual environment,
and runs everything from a folder outside the repository with no ``PYTHONPATH`` and no plugins
folder of ours: ``airflow providers list`` shows gpusched, ``airflow config list --section
gpusched`` its options with their defaults, the executor loads by its import path, ``gpusched
--version`` answers, and a real ``airflow api-server`` serves the plugin's routes and lists its
"GPU fleet" nav view. The wheel is installed without extras: the lean provider install, with no
``lab`` extra (matplotlib), still loads the executors and the plugin and parses every bundled DAG,
and a lab command says in one line how to get the extra.

One virtualenv for the whole module; installing Airflow's dependency tree takes minutes, hence
the ``wheel`` marker (``pytest -m wheel``).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import check_plugin_routes

from gpusched import __version__
from gpusched.deploy.airflow_instance import api_server as api_server_process
from gpusched.deploy.airflow_instance import free_port, login_token
from gpusched.settings import OPTIONS

pytestmark = [pytest.mark.wheel, pytest.mark.airflow, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DATA = ("gpusched/include/catalog/accelerators.json", "gpusched/include/fleets/default.yaml",
        "gpusched/include/expectations/demand_history.json", "gpusched/ledger/migrations/script.py.mako",
        "gpusched/ledger/migrations/versions/0001_initial.py")


def _run(args: list[str], *, env: dict[str, str], cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done.stdout



@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist + wheel built by ``python -m build`` from a copy of the sources (the repo stays clean)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "gpusched", src / "gpusched",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(src)], env=dict(os.environ), cwd=src)
    return out


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A fresh virtualenv with the wheel and its pinned dependencies, and an environment to run in."""
    root = tmp_path_factory.mktemp("venv")
    home = tmp_path_factory.mktemp("airflow_home")
    outside = tmp_path_factory.mktemp("cwd")
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(root)], check=True, timeout=300)
    (wheel,) = dist.glob("gpusched-*.whl")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "GPUSCHED_", "PYTHON", "VIRTUAL_ENV"))}
    env |= {"PATH": f"{root / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__AUTH_MANAGER":
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "GPUSCHED_BACKEND": "simulated"}
    _run([str(root / "bin" / "pip"), "install", "-q", "-c", str(REPO / "constraints.txt"), str(wheel)],
         env=env, cwd=outside, timeout=1800)
    return {"python": str(root / "bin" / "python"), "bin": root / "bin", "env": env, "cwd": outside,
            "home": home, "root": root}


def test_sdist_and_wheel_carry_the_package_data(dist: Path) -> None:
    (wheel,) = dist.glob("gpusched-*.whl")
    (sdist,) = dist.glob("gpusched-*.tar.gz")
    assert wheel.name == f"gpusched-{__version__}-py3-none-any.whl"
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for path in DATA:
        assert path in in_wheel, f"{path} missing from the wheel"
        assert path in in_sdist, f"{path} missing from the sdist"
    entry_points = zipfile.ZipFile(wheel).read(f"gpusched-{__version__}.dist-info/entry_points.txt").decode()
    assert "[apache_airflow_provider]" in entry_points and "[airflow.plugins]" in entry_points


def test_installed_package_is_used_not_the_repository(venv: dict[str, Any]) -> None:
    where = _run([venv["python"], "-c", "import gpusched, sys; print(gpusched.__file__); print(sys.path)"],
                 env=venv["env"], cwd=venv["cwd"])
    module_file, path = where.splitlines()
    assert module_file.startswith(str(venv["root"])), module_file
    # Entries, not a substring: a temporary folder named like the checkout (/x/ci_pt beside /x/ci) is not it.
    assert str(REPO) not in ast.literal_eval(path), path
    assert _run([str(venv["bin"] / "gpusched"), "--version"], env=venv["env"], cwd=venv["cwd"]).strip() \
        == f"gpusched {__version__}"
    # Package data is found from site-packages: the shipped fleet, the catalog, the migrations.
    inventory = json.loads(_run([str(venv["bin"] / "gpusched"), "inventory", "--json"],
                                env=venv["env"], cwd=venv["cwd"]))
    assert inventory["simulated"] is True and sum(len(n["devices"]) for n in inventory["nodes"]) == 62


def test_airflow_lists_the_provider_and_its_config_section(venv: dict[str, Any]) -> None:
    providers = json.loads(_run([str(venv["bin"] / "airflow"), "providers", "list", "-o", "json"],
                                env=venv["env"], cwd=venv["cwd"]))
    (ours,) = [p for p in providers if p["package_name"] == "gpusched"]
    assert ours["version"] == __version__
    listed = _run([str(venv["bin"] / "airflow"), "config", "list", "--section", "gpusched", "--defaults",
                   "--show-values"],
                  env=venv["env"], cwd=venv["cwd"])
    assert "[gpusched]" in listed
    for option in OPTIONS:
        assert f"{option.name} = {option.default}".rstrip() in listed, option.name
        assert option.description.split(";")[0][:40] in " ".join(listed.split()), option.name
    value = _run([str(venv["bin"] / "airflow"), "config", "get-value", "gpusched", "lease_seconds"],
                 env=venv["env"], cwd=venv["cwd"])
    assert value.strip() == "600"
    executors = _run([str(venv["bin"] / "airflow"), "providers", "executors", "-o", "json"],
                     env=venv["env"], cwd=venv["cwd"])
    assert "gpusched.airflow.executor.GPUExecutor" in executors


def test_executor_loads_by_its_import_path(venv: dict[str, Any]) -> None:
    env = {**venv["env"], "AIRFLOW__CORE__EXECUTOR": "gpusched.airflow.executor.GPUExecutor",
           "AIRFLOW__GPUSCHED__LEASE_SECONDS": "321"}
    code = ("from airflow.executors.executor_loader import ExecutorLoader\n"
            "cls = ExecutorLoader.import_default_executor_cls()[0]\n"
            "ex = cls()\n"
            "print(cls.__module__, cls.__name__, ex.gpu.lease_s, ex.gpu.policy.name)\n")
    out = _run([venv["python"], "-c", code], env=env, cwd=venv["cwd"]).split()
    assert out[-4:] == ["gpusched.airflow.executor", "GPUExecutor", "321", "gpusched"]


def test_the_lean_install_runs_the_product_without_the_lab(venv: dict[str, Any], tmp_path: Path) -> None:
    code = ("import importlib.util, json, os, sys\n"
            "assert importlib.util.find_spec('matplotlib') is None, 'the plain wheel pulled in matplotlib'\n"
            "import gpusched.airflow.celery_executor, gpusched.airflow.executor, gpusched.airflow.plugin\n"
            "from airflow.dag_processing.dagbag import DagBag\n"
            "bag = DagBag(dag_folder=sys.argv[1], safe_mode=False)\n"
            "assert not bag.import_errors, bag.import_errors\n"
            "print(json.dumps({i: os.path.basename(d.fileloc) for i, d in bag.dags.items()}))\n")
    dags = json.loads(_run([venv["python"], "-c", code, str(REPO / "dags")], env=venv["env"],
                           cwd=venv["cwd"]).splitlines()[-1])
    assert set(dags.values()) == {p.name for p in (REPO / "dags").glob("*.py")}, dags
    assert "gpusched_capacity_forecast" in dags and "gpusched_fault_recovery" in dags
    # A lab command (report plots need matplotlib) fails with the one line that names the fix.
    (tmp_path / "latency").mkdir()
    (tmp_path / "latency" / "l.json").write_text('{"policy": "gpusched", "sweep": []}', encoding="utf-8")
    done = subprocess.run([str(venv["bin"] / "gpusched"), "bench", "report", "--results", str(tmp_path)],
                          env=venv["env"], cwd=venv["cwd"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("gpusched bench report: error: matplotlib is not installed; it comes with "
                           "gpusched's lab extra: pip install 'gpusched[lab]'\n")


@pytest.fixture(scope="module")
def api_server(venv: dict[str, Any]) -> Iterator[dict[str, Any]]:
    env, cwd, home = venv["env"], venv["cwd"], venv["home"]
    assert not (home / "plugins").exists() or not any((home / "plugins").iterdir())
    _run([str(venv["bin"] / "airflow"), "db", "migrate"], env=env, cwd=cwd)
    # Put the simulated fleet into the ledger (the agent's first cycle syncs the inventory).
    _run([str(venv["bin"] / "gpusched"), "agent", "--once", "--backend", "simulated"], env=env, cwd=cwd)
    with api_server_process([str(venv["bin"] / "airflow")], port=free_port(), env=env,
                            log=home / "api-server.log", cwd=cwd) as base:
        token = login_token(home, base)
        assert token, "the simple auth manager refused its own generated password"
        yield {"base": base, "token": token}


def test_api_server_serves_the_plugin_routes_and_nav_view(api_server: dict[str, Any]) -> None:
    _, plugin = check_plugin_routes(api_server["base"], api_server["token"])
    # Registered by the wheel's entry point ("<dist>==<version>: <entry point>"), not a plugins folder.
    assert plugin["source"].startswith(f"gpusched=={__version__}:"), plugin["source"]
    assert "gpusched.airflow.plugin:GpuschedPlugin" in plugin["source"], plugin["source"]
