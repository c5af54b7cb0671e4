"""``gpusched ledger``: the operator's view of the ledger, run through the real argument parser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from _ledger_support import database_url, fleet, share

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
