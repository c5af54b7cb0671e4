"""Property-based tests (hypothesis) for every parser of outside input.

Property, for GPURequest (kwargs / dict / YAML), fleet files, every trace loader and the CLI
arguments: every input ends as a valid object or as the project's error naming the field (or
file, line and field) in one line — never another exception. No per-example deadline: a timed
check fails on a loaded machine, not on a slow parser (parsing speed belongs to benchmarks).
Example counts are kept moderate so the suite stays within the CI budget.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.cli import _parser, main
from gpusched.errors import FleetFileError, GPURequestError, TraceError
from gpusched.fields import MAX_DEVICES, MAX_DURATION_S, MAX_SIZE_BYTES
from gpusched.fleetfile import load_fleet, parse_fleet
from gpusched.model import MILLI
from gpusched.request import REQUEST_KEYS, GPURequest
from gpusched.sim.jobs import load_any_trace
from gpusched.sim.traces import (
    load_gavel_jobs,
    load_gavel_throughputs,
    load_openb_lifetimes,
    load_openb_nodes,
    load_openb_pods,
    load_philly_jobs,
)

FAST = settings(
    max_examples=60, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

EDGE_TEXT = [
    "", " ", "0", "1", "-1", "2", "8", "0.5", "0.25", "0.9999", "1e400", "nan", "inf", "-inf", "4096", "5000",
    "40GiB", "16GB", "512M", "0B", "9" * 40 + "GiB", "2h", "0.1s", "1h30m", "-5m", "90", "366d", "999999d",
    "sm_80", "sm_999", "gfx942", "gfx9999", "8.0", "9.9", "nvidia", "AMD", "ascend", "H100", "A100", "T4",
    "MI300X", "V100M16", "island", "same_rack", "any", "nvlnk", "training", "dev", "high", "critical",
    "abc\n", "team-a", "x" * 300, "true", "yes", "null", "a,b", "\x00", "é", "P100", "2017-10-09 00:00:00",
]


def _huge(_: object) -> int:
    return 10**5000  # str() of it raises ValueError: error messages must still form


DUMPABLE_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from([10**12, -(10**12), 2**80]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(EDGE_TEXT),
)
SCALARS = st.one_of(DUMPABLE_SCALARS, st.just(0).map(_huge))


def _nested(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=6,
    )


VALUES = _nested(SCALARS)
DUMPABLE = _nested(DUMPABLE_SCALARS)  # YAML and JSON cannot write a 5,000-digit integer
ONE_LINE = re.compile(r"[^\n]*")


# ---- GPURequest ---------------------------------------------------------------------------------


def _check_request(request: GPURequest) -> None:
    assert 1 <= request.count <= MAX_DEVICES
    assert 1 <= request.milli_per_gpu <= MILLI
    assert request.milli_per_gpu == MILLI or request.count == 1
    assert 0 <= request.memory_per_gpu <= MAX_SIZE_BYTES
    assert 0 <= request.expected_duration_s <= MAX_DURATION_S
    assert 0 <= request.priority <= 100
    assert re.fullmatch(r"[a-z0-9][a-z0-9_.-]{0,62}", request.tenant)
    assert all(len(k) <= 63 and len(v) <= 63 for k, v in request.labels)
    data = request.to_dict()
    json.dumps(data, allow_nan=False)  # nothing non-finite can travel in executor_config
    assert GPURequest.from_dict(data) == request


def _check_request_error(exc: GPURequestError) -> None:
    message = str(exc)
    assert exc.field in REQUEST_KEYS or exc.field == "<request>" or "unknown field" in message, exc.field
    assert message.startswith(f"GPURequest.{exc.field}: ") and "accepted:" in message
    assert ONE_LINE.fullmatch(message) and len(message) < 1000


def _build(**kwargs: Any) -> None:
    try:
        request = GPURequest.build(**kwargs)
    except GPURequestError as exc:
        _check_request_error(exc)
    else:
        _check_request(request)


REQUEST_KWARGS = st.dictionaries(
    st.sampled_from(sorted(REQUEST_KEYS)), st.one_of(VALUES, st.sampled_from(EDGE_TEXT)), max_size=6
)


@FAST
@given(REQUEST_KWARGS)
def test_request_from_kwargs(kwargs: dict[str, Any]) -> None:
    _build(**kwargs)


@FAST
@given(st.dictionaries(st.one_of(st.sampled_from(sorted(REQUEST_KEYS)), SCALARS), VALUES, max_size=5))
def test_request_from_dict(data: dict[Any, Any]) -> None:
    try:
        request = GPURequest.from_dict(data)
    except GPURequestError as exc:
        _check_request_error(exc)
    else:
        _check_request(request)


@FAST
@given(st.one_of(
    st.text(max_size=80),
    st.dictionaries(st.sampled_from(sorted(REQUEST_KEYS)), DUMPABLE, max_size=6).map(
        lambda d: yaml.safe_dump(d, allow_unicode=True)
    ),
    st.lists(st.sampled_from(["gpus: 1\n", "gpus: .inf\n", "memory: 40GiB\n", "count: 2\n", "tenant: a\n",
                              "labels: {a: b}\n", "labels: {a: 1, a: 2}\n", "- 1\n", "priority: high\n",
                              "expected_duration: .nan\n", "min_arch: sm_999\n", "vendor: {nvidia: 1}\n"]),
             max_size=5).map("".join),
))
def test_request_from_yaml(text: str) -> None:
    try:
        request = GPURequest.from_yaml(text)
    except GPURequestError as exc:
        _check_request_error(exc)
    else:
        _check_request(request)


# ---- fleet files --------------------------------------------------------------------------------

def _fleet(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    names = ["T4", "H100", "A100", "MI300X", "Ascend-910B", "L40S", "nope"]
    models = st.one_of(st.sampled_from(names), values)
    group = st.fixed_dictionaries(
        {"model": models},
        optional={"count": st.one_of(st.integers(-2, 200), values), "numa": values, "memory": values,
                  "pcie_switches": values, "islands": st.one_of(st.just([[0, 1]]), values)},
    )
    node = st.fixed_dictionaries(
        {"name": st.one_of(st.sampled_from(["n1", "n2"]), values),
         "devices": st.one_of(group, st.lists(group, max_size=3))},
        optional={"cpu": values, "memory": st.one_of(st.sampled_from(EDGE_TEXT), values),
                  "numa_nodes": values, "labels": values, "standby": values, "extra": values},
    )
    rack = st.fixed_dictionaries(
        {"name": st.one_of(st.just("r"), values), "nodes": st.lists(node, max_size=3)},
        optional={"labels": values},
    )
    return st.one_of(st.fixed_dictionaries({"racks": st.lists(rack, max_size=2)}), values)


FLEET = _fleet(VALUES)
DUMPABLE_FLEET = _fleet(DUMPABLE)


def _check_fleet_error(exc: FleetFileError, source: str) -> None:
    message = str(exc)
    assert message.startswith(f"fleet file {source}") and "field" in message and "fix:" in message
    assert ONE_LINE.fullmatch(message)


@FAST
@given(FLEET)
def test_fleet_documents(document: Any) -> None:
    try:
        nodes = parse_fleet(document, source="probe.yaml")
    except FleetFileError as exc:
        _check_fleet_error(exc, "probe.yaml")
    else:
        for node in nodes:
            assert 1 <= len(node.devices) <= 128
            assert len({d.uuid for d in node.devices}) == len(node.devices)


@FAST
@given(st.one_of(DUMPABLE_FLEET.map(lambda d: yaml.safe_dump(d).encode()), st.binary(max_size=200)))
def test_fleet_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_bytes(content)
    try:
        load_fleet(path)
    except FleetFileError as exc:
        _check_fleet_error(exc, str(path))


# ---- trace loaders ------------------------------------------------------------------------------

CELL = st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=10), st.integers(-5, 3000).map(str),
                 st.floats(allow_nan=True, allow_infinity=True).map(repr))
LAYOUTS = {
    "openb_nodes": (["sn", "cpu_milli", "memory_mib", "gpu", "model"], load_openb_nodes),
    "openb_pods": (["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "creation_time",
                    "deletion_time"], load_openb_pods),
    "openb_times": (["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "creation_time",
                     "deletion_time"], load_openb_lifetimes),
    "gavel": (["job_id", "arrival_time_s", "job_type", "scale_factor", "duration_s_v100", "duration_s_p100",
               "duration_s_k80"], load_gavel_jobs),
    "philly": (["timestamp", "duration", "num_gpus", "gpu_time", "cluster"], load_philly_jobs),
    "any_gavel": (["job_id", "arrival_time_s", "scale_factor", "duration_s_v100"], load_any_trace),
    "any_openb": (
        ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "creation_time", "deletion_time"],
        load_any_trace,
    ),
}


def _csv(columns: list[str], rows: list[list[str]]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    writer.writerows(rows)
    return out.getvalue().encode("utf-8", "surrogatepass")


def _check_trace(result: Any) -> None:
    for item in result if isinstance(result, list) else ():
        for name in ("arrival_s", "duration_s"):
            value = getattr(item, name, 0.0)
            assert not math.isnan(value) and value >= 0
        num = getattr(item, "num_gpus", getattr(item, "num_gpu", getattr(item, "gpus", 1)))
        assert 0 <= num <= MAX_DEVICES


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_trace_loaders(tmp_path: Path, layout: str) -> None:
    columns, loader = LAYOUTS[layout]
    contents = st.one_of(
        st.lists(st.lists(CELL, min_size=len(columns), max_size=len(columns)), max_size=4).map(
            lambda rows: _csv(columns, rows)
        ),
        st.lists(st.lists(CELL, max_size=len(columns) + 1), max_size=3).map(lambda rows: _csv(columns, rows)),
        st.binary(max_size=120),
    )

    @FAST
    @given(contents)
    def check(content: bytes) -> None:
        path = tmp_path / f"{layout}.csv"
        path.write_bytes(content)
        try:
            _check_trace(loader(path))
        except TraceError as exc:
            message = str(exc)
            assert message.startswith(f"trace file {path}") and "fix:" in message
            assert ONE_LINE.fullmatch(message)
            if exc.line is not None and exc.field is not None:
                assert f"line {exc.line}" in message and repr(exc.field) in message

    check()


@FAST
@given(st.one_of(DUMPABLE.map(lambda v: json.dumps(v).encode()), st.binary(max_size=60),
                 st.dictionaries(st.sampled_from(["v100", "k80"]), st.dictionaries(
                     st.text(max_size=6), st.fixed_dictionaries({"null": DUMPABLE}), max_size=2), max_size=2)
                 .map(lambda v: json.dumps(v).encode())))
def test_gavel_throughputs(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "tp.json"
    path.write_bytes(content)
    try:
        table = load_gavel_throughputs(path)
    except TraceError as exc:
        assert str(exc).startswith(f"trace file {path}") and ONE_LINE.fullmatch(str(exc))
    else:
        assert all(math.isfinite(v) and v >= 0 for row in table.values() for v in row.values())


# ---- CLI arguments ------------------------------------------------------------------------------

TOKENS = st.one_of(
    st.sampled_from([
        "simulate", "bench", "ledger", "inventory", "agent", "openb", "gavel", "philly", "latency", "status",
        "events", "--trace", "--fleet", "--policy", "--round", "--limit", "--max-pending", "--seed", "--json",
        "--quiet", "--seeds", "--factor", "--rate", "--measure", "--nodes", "--gpus-per-node", "--clusters",
        "--samples", "--busy", "--port", "--interval", "--window", "--start", "--end", "-5", "0", "nan",
        "inf", "1e9", "4000-4999", "5-1", "gpusched", "fgd", "random", "best-fit", "uniform:2x2", "a,b",
    ]),
    st.text(max_size=8),
)


@FAST
@given(st.lists(TOKENS, max_size=7))
def test_cli_argument_parsing(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    if "-h" in argv or "--help" in argv:
        return
    try:
        args = _parser(argv).parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err.strip()
        assert "error:" in err and ONE_LINE.fullmatch(err), err
        return
    for name, value in vars(args).items():
        if isinstance(value, float):
            assert math.isfinite(value), name
        if name in ("limit", "max_pending", "samples", "seeds", "nodes") and isinstance(value, int):
            assert value >= 1, name


@FAST
@given(
    fleet=st.one_of(st.builds("uniform:{}x{}".format, st.integers(-1, 3), st.integers(-1, 3)),
                    st.sampled_from(["gavel", "gavel:0", "gavel:5", "uniform:", "x.yaml"]),
                    st.text(max_size=8)),
    extra=st.lists(st.sampled_from(["--policy", "fgd", "nope", "--round", "nan", "60", "--limit", "1", "-1",
                                    "--max-pending", "0", "--seed", "3"]), max_size=4),
)
def test_cli_simulate_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str], fleet: str,
                                 extra: list[str]) -> None:
    trace = tmp_path / "philly.csv"
    trace.write_text("timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-09 00:00:00,60,1,60,a\n"
                     "2017-10-09 00:00:30,60,2,120,b\n", encoding="utf-8")
    code = main(["simulate", "--trace", str(trace), "--fleet", fleet, "--quiet", "--json", *extra])
    captured = capsys.readouterr()
    assert code in (0, 2)
    if code == 2:
        assert ONE_LINE.fullmatch(captured.err.strip()) and "error:" in captured.err
    else:
        assert isinstance(json.loads(captured.out), dict)


@FAST
@given(
    name=st.text(alphabet=st.characters(blacklist_characters="/\x00"), min_size=1, max_size=10),
    action=st.lists(st.sampled_from(["status", "events", "--limit", "-5", "3", "allocations", "--all",
                                     "release", "k", "cordon", "--reason", "x", "expire", "--json"]),
                    min_size=1, max_size=4),
)
def test_cli_ledger_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                               action: list[str]) -> None:
    before = sorted(tmp_path.iterdir())
    code = main(["ledger", "--url", f"sqlite:///{tmp_path / name}.db", *action])
    captured = capsys.readouterr()
    assert code == 2  # no ledger exists there: refused in one line …
    assert ONE_LINE.fullmatch(captured.err.strip()) and "error:" in captured.err
    assert sorted(tmp_path.iterdir()) == before  # … and nothing was created by a read command
