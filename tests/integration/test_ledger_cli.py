"""``gpusched ledger``: the operator's view of the ledger, run through the real argument parser."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _ledger_support import BACKENDS, database_url, fleet, share

from gpusched.commands import ledger as ledger_command
from gpusched.errors import LedgerError
from gpusched.ledger import Ledger
from gpusched.request import GPURequest


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="gpusched")
    ledger_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["ledger", *argv])
    return int(args.func(args))


def test_ledger_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = next(database_url("sqlite", tmp_path))
    with pytest.raises(LedgerError, match="gpusched ledger migrate"):
        _run("--url", url, "status")
    assert _run("--url", url, "migrate") == 0
    assert _run("--url", url, "migrate") == 0
    with Ledger(url) as led:
        led.sync_inventory(fleet(1, 2), "test")
        d = list(led.snapshot().devices())
        led.allocate("job-1", GPURequest.build(gpus=1), [share(d[0])], holder="s", lease_s=1, now=0.0)
    capsys.readouterr()
    assert _run("--url", url, "status", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status["revision"] == status["head"] and status["devices"] == 2
    assert status["active_allocations"] == 1 and status["used_milli"] == 1000

    assert _run("--url", url, "allocations", "--json") == 0
    assert [a["key"] for a in json.loads(capsys.readouterr().out)] == ["job-1"]
    assert _run("--url", url, "cordon", d[1].uuid, "--reason", "fan") == 0
    assert _run("--url", url, "expire") == 0
    assert "job-1" in capsys.readouterr().out
    assert _run("--url", url, "release", "job-1") == 0
    assert "holds no active allocation" in capsys.readouterr().out
    assert _run("--url", url, "allocations", "--all") == 0
    assert "expired (lease expired)" in capsys.readouterr().out
    assert _run("--url", url, "events", "--json", "--limit", "3") == 0
    assert [e["kind"] for e in json.loads(capsys.readouterr().out)] == ["expire", "cordon", "allocate"]
    assert _run("--url", url, "uncordon", d[1].uuid) == 0
    with Ledger(url) as led:
        assert not led.snapshot().device(d[1].uuid).cordoned


@pytest.mark.parametrize("backend", BACKENDS)
def test_status_counts_like_the_fleet_page(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Degraded devices are not unhealthy; standby devices are not capacity in service."""
    import dataclasses

    from gpusched.airflow.api_views import fleet_view
    from gpusched.model import Health

    urls = database_url(backend, tmp_path)
    url = next(urls)
    nodes = fleet(2, 4)
    nodes[1] = dataclasses.replace(nodes[1], standby=True)
    with Ledger(url) as led:
        led.migrate()
        led.sync_inventory(nodes, "test")
        led.set_health("GPU-n0-0", Health.DEGRADED, "ecc corrected")
        led.set_health("GPU-n0-1", Health.UNHEALTHY, "xid 79")
        page = fleet_view(led.snapshot(), led.active())["summary"]
    capsys.readouterr()
    assert _run("--url", url, "status", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["unhealthy"], status["degraded"], status["standby"]) == (1, 1, 4)
    assert status["in_service"] == page["in_service"] == 3
    assert status["capacity_milli"] == 3000
    urls.close()


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpusched.cli", *argv], capture_output=True, text=True, timeout=120,
        check=False, env=env, cwd=Path(__file__).resolve().parents[2],
    )


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSCHED_DB_URL", "AIRFLOW_HOME")}
    env["HOME"] = str(home)
    return env


def test_read_commands_create_nothing_and_point_at_the_main_job(tmp_path: Path) -> None:
    env = _env(tmp_path)
    proc = _cli("ledger", "status", env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "AIRFLOW_HOME" in proc.stderr and "GPUSCHED_DB_URL" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no ~/airflow/gpusched/ledger.db created
    env["AIRFLOW_HOME"] = str(tmp_path / "home")
    proc = _cli("ledger", "events", env=env)
    assert proc.returncode == 2 and str(tmp_path / "home") in proc.stderr
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ("ledger", "--url", "postgresql+psycopg://nobody@127.0.0.1:1/none", "status"),
        ("ledger", "status", "--url", "sqlite:////nonexistent-dir/ledger.db"),
        ("ledger", "--url", "not a url", "status"),
        ("ledger", "--url", "mysql://x@127.0.0.1/db", "status"),
        ("ledger", "events", "--limit", "-5"),
        ("ledger", "events", "--limit", "many"),
        ("ledger", "cordon", "GPU-x"),
    ],
)
def test_bad_ledger_arguments_are_one_line_exit_2(tmp_path: Path, argv: tuple[str, ...]) -> None:
    proc = _cli(*argv, env=_env(tmp_path))
    assert proc.returncode == 2, proc
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr


def test_url_after_the_action_and_cordon_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = next(database_url("sqlite", tmp_path))
    assert _run("migrate", "--url", url) == 0
    assert _run("status", "--url", url) == 0
    with pytest.raises(LedgerError, match="gpusched inventory"):
        _run("--url", url, "cordon", "nowhere", "--reason", "x")


def test_durations_reports_how_well_finished_runs_were_predicted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import time

    from gpusched.scheduler.keys import ti_key

    url = next(database_url("sqlite", tmp_path))
    assert _run("--url", url, "migrate") == 0
    now = time.time()
    with Ledger(url) as led:
        led.sync_inventory(fleet(1, 2), "test")
        d = list(led.snapshot().devices())
        # d/train ran 100, 100, 100, 200 s; a failed try and a run outside the window do not count.
        for i, (run, reason, ago) in enumerate([(100, "task succeeded", 9000), (100, "task succeeded", 8000),
                                                (100, "task succeeded", 7000), (500, "task failed", 6000),
                                                (200, "task process ended (task success)", 5000),
                                                (100, "task succeeded", 40 * 86400)]):
            key = ti_key("d", "train", f"scheduled__{i}", 1)
            led.allocate(key, GPURequest.build(gpus=1), [share(d[0])], holder="s", now=now - ago)
            led.release(key, reason=reason, now=now - ago + run, succeeded="fail" not in reason)
    capsys.readouterr()
    assert _run("--url", url, "durations", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    # The 4th run is the first with three before it: predicted 100 s, ran 200 s (50 % off).
    assert report["finished_runs"] == 4 and report["without_prediction"] == 3
    assert report["predicted"] == 1 and report["median_ape_pct"] == 50.0
    assert report["by_basis"] == {"task": {"count": 1, "median_ape_pct": 50.0}}
    assert _run("--url", url, "durations", "--days", "60") == 0
    assert "5 finished run(s) in 60 days; 3 had too little history" in capsys.readouterr().out
