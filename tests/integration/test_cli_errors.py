"""Every CLI error is one line naming the problem and the fix, exit code 2; every option has help."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from gpusched.cli import COMMANDS, _parser, main
from gpusched.placement import Policy
from gpusched.request import GPURequest
from gpusched.sim.engine import SimJob, simulate
from gpusched.sim.fleets import uniform_fleet

ROOT = Path(__file__).resolve().parents[2]
PHILLY = (
    "timestamp,duration,num_gpus,gpu_time,cluster\n"
    "2017-10-09 00:00:00,600,1,600,a\n2017-10-09 00:01:00,600,8,4800,a\n2017-10-09 00:02:00,60,2,120,b\n"
)


def _one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "error:" in lines[0] and "Traceback" not in captured.err
    return lines[0]


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found.append(child)
                found.extend(_subparsers(child))
    return found


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_of_every_command_has_help(command: str) -> None:
    parsers = _subparsers(_parser([command]))
    assert parsers
    for parser in parsers:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            assert action.help, f"{parser.prog} {action.option_strings or action.dest} has no help text"


def test_policy_options_list_the_policy_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # no line breaks inside "best-fit"
    for argv in (["simulate", "--help"], ["bench", "philly", "--help"], ["bench", "openb", "--help"]):
        assert main(argv) == 0
        out = " ".join(capsys.readouterr().out.split())
        for name in Policy.names():
            assert name in out, (argv, name)


def test_simulate_missing_trace_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, "simulate", "--trace", "/nonexistent.csv", "--fleet", "gavel")
    assert "/nonexistent.csv" in line and "does not exist" in line and "fix:" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate"],
        ["simulate", "--trace", "t.csv", "--fleet", "gavel", "--policy", "fastest"],
        ["simulate", "--trace", "t.csv", "--fleet", "gavel", "--round", "nan"],
        ["simulate", "--trace", "t.csv", "--fleet", "gavel", "--limit", "-1"],
        ["bench", "latency", "--busy", "2"],
        ["bench", "gavel", "--measure", "5-1"],
        ["bench", "philly", "--clusters", ","],
        ["bench", "openb", "--seeds", "0"],
        ["agent", "--port", "70000"],
        ["nope"],
    ],
)
def test_bad_arguments_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    line = _one_line_error(capsys, *argv)
    assert "--help" in line


def test_bad_fleet_spec_and_unwritable_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "philly.csv"
    trace.write_text(PHILLY, encoding="utf-8")
    line = _one_line_error(capsys, "simulate", "--trace", str(trace), "--fleet", "gavel:0", "--quiet")
    assert "gavel:GPUS_PER_SERVER" in line
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _one_line_error(capsys, "simulate", "--trace", str(trace), "--fleet", "uniform:2x8", "--quiet",
                           "--out", str(blocker / "out.json"))
    assert "cannot use" in line


def test_nan_arrival_trace_stops_at_once_with_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "gavel.csv"
    trace.write_text(
        "job_id,arrival_time_s,job_type,scale_factor,total_steps,duration_s_v100,duration_s_p100,duration_s_k80\n"
        "0,nan,A3C,1,10,100,100,100\n",
        encoding="utf-8",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "gpusched.cli", "simulate", "--trace", str(trace), "--fleet", "gavel"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "line 2" in proc.stderr and "arrival_time_s" in proc.stderr


def test_bench_philly_empty_window_and_clusters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    trace = tmp_path / "philly.csv"
    trace.write_text(PHILLY, encoding="utf-8")
    base = ["bench", "philly", "--jobs", str(trace), "--nodes", "2", "--quiet"]
    line = _one_line_error(capsys, *base, "--start", "2018-01-01", "--end", "2018-01-02")
    assert "no jobs" in line and "2018-01-01" in line
    line = _one_line_error(capsys, *base, "--start", "2017-10-09", "--clusters", "zzz")
    assert "no jobs of clusters zzz" in line
    assert main([*base, "--start", "2017-10-09", "--clusters", "b", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["jobs"] == 1 and data["clusters"] == ["b"]
    line = _one_line_error(capsys, *base, "--start", "2017-10-09", "--oracle", "--durations", "predicted")
    assert "--oracle contradicts --durations predicted" in line


def test_progress_bar_counts_the_measured_window(capsys: pytest.CaptureFixture[str]) -> None:
    jobs = [SimJob(str(i), GPURequest(count=1), 100.0 * i, 10.0) for i in range(40)]
    result = simulate(jobs, uniform_fleet(1, 2), Policy.named("gpusched"), stop_after={"5", "6", "7"},
                      progress=True)
    err = capsys.readouterr().err
    assert result.not_arrived > 0  # the run stopped before every job arrived …
    assert "3/3" in err and "100%" in err  # … and the bar, counting the watched jobs, is full


def test_bench_report_without_results_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line_error(capsys, "bench", "report", "--results", str(tmp_path / "none"))
    assert line.startswith("gpusched bench report: error:") and "no benchmark results" in line


def test_error_naming_an_unprintable_path_is_still_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lone surrogate in a path (undecodable file-system bytes) is shown escaped, not a crash."""
    line = _one_line_error(capsys, "ledger", "--url", f"sqlite:///{tmp_path}/\ud800.db", "status")
    assert "no ledger at" in line and "\\ud800.db" in line
