"""Bad trace and fleet files: each is one GpuschedError naming file, line and field (no traceback or hang)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusched.errors import ConfigurationError, FleetFileError, GpuschedError, TraceError
from gpusched.fleetfile import load_fleet
from gpusched.placement import Policy
from gpusched.request import GPURequest
from gpusched.sim.engine import SimJob, simulate
from gpusched.sim.fleets import fleet_from_spec, uniform_fleet
from gpusched.sim.jobs import load_any_trace
from gpusched.sim.traces import load_gavel_jobs, load_gavel_throughputs, load_openb_nodes, load_philly_jobs

GAVEL_HEAD = (
    "job_id,arrival_time_s,job_type,scale_factor,total_steps,duration_s_v100,duration_s_p100,duration_s_k80\n"
)
PHILLY_HEAD = "timestamp,duration,num_gpus,gpu_time,cluster\n"
OPENB_HEAD = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
)


def _file(tmp_path: Path, text: str | bytes, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


@pytest.mark.parametrize(
    ("text", "line", "field"),
    [
        (GAVEL_HEAD + "0,nan,A3C,1,10,100,100,100\n", 2, "arrival_time_s"),
        (GAVEL_HEAD + "0,0,A3C,1,10,100,100,100\n1,inf,A3C,1,10,100,100,100\n", 3, "arrival_time_s"),
        (GAVEL_HEAD + "0,0,A3C,1,10,fast,100,100\n", 2, "duration_s_v100"),
        (GAVEL_HEAD + "0,0,A3C,1,10,-100,100,100\n", 2, "duration_s_v100"),
        (GAVEL_HEAD + "0,0,A3C,inf,10,100,100,100\n", 2, "scale_factor"),
        (GAVEL_HEAD + "0,0,A3C,-2,10,100,100,100\n", 2, "scale_factor"),
        (GAVEL_HEAD + "0,-5,A3C,1,10,100,100,100\n", 2, "arrival_time_s"),
        (GAVEL_HEAD + "0,0,A3C,1,10,100,100,100\n0,1,A3C,1,10,100,100,100\n", 3, "job_id"),
        (PHILLY_HEAD + "2017-10-09 00:00:00,60,inf,60,a\n", 2, "num_gpus"),
        (PHILLY_HEAD + "2017-10-09 00:00:00,-60,1,60,a\n", 2, "duration"),
        (PHILLY_HEAD + "# a comment\n2017-13-09 00:00:00,60,1,60,a\n", 3, "timestamp"),
        (OPENB_HEAD + "p0,1000,1024,1,500,,LS,Running,soon,100,0\n", 2, "creation_time"),
        (OPENB_HEAD + "p0,1000,1024,1,500,,LS,Running,nan,100,0\n", 2, "creation_time"),
        (OPENB_HEAD + "p0,1000,1024,-1,500,,LS,Running,0,100,0\n", 2, "num_gpu"),
        (OPENB_HEAD + "p0,1000,1024,1,5000,,LS,Running,0,100,0\n", 2, "gpu_milli"),
        (OPENB_HEAD + "p0,1000,1024,1,500,H900,LS,Running,0,100,0\n", 2, "gpu_spec"),
    ],
)
def test_bad_trace_rows_name_file_line_and_field(tmp_path: Path, text: str, line: int, field: str) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(TraceError) as info:
        load_any_trace(path)
    assert (info.value.line, info.value.field) == (line, field)
    message = str(info.value)
    assert str(path) in message and f"line {line}" in message and repr(field) in message and "fix:" in message
    assert "\n" not in message


def test_missing_non_utf8_empty_and_unknown_files(tmp_path: Path) -> None:
    for path, words in [
        (tmp_path / "absent.csv", "does not exist"),
        (_file(tmp_path, b"job_id,arrival_time_s\n0,\xff\xfe\n", "latin.csv"), "not UTF-8"),
        (_file(tmp_path, "", "empty.csv"), "is empty"),
        (_file(tmp_path, "a,b\n1,2\n", "other.csv"), "unknown trace layout"),
        (tmp_path, "not a file"),
    ]:
        with pytest.raises(TraceError, match=words):
            load_any_trace(path)


def test_gavel_throughputs_bad_json(tmp_path: Path) -> None:
    for text in ["[1, 2]", "{", '{"v100": {"x": {"null": NaN}}}', b"\xff"]:
        with pytest.raises(TraceError):
            load_gavel_throughputs(_file(tmp_path, text, "tp.json"))


def test_nan_arrival_in_simulate_is_refused_not_a_hang() -> None:
    job = SimJob("j", GPURequest(count=1), float("nan"), 10.0)
    with pytest.raises(ConfigurationError, match="arrival"):
        simulate([job], uniform_fleet(1, 1), Policy.named("gpusched"))
    with pytest.raises(ConfigurationError, match="appears twice"):
        twice = [SimJob("j", GPURequest(count=1), 0.0, 1.0)] * 2
        simulate(twice, uniform_fleet(1, 1), Policy.named("gpusched"))


def test_philly_bad_window(tmp_path: Path) -> None:
    path = _file(tmp_path, PHILLY_HEAD + "2017-10-09 00:00:00,60,1,60,a\n")
    with pytest.raises(ConfigurationError, match="not a time"):
        load_philly_jobs(path, start="last tuesday")
    with pytest.raises(ConfigurationError, match="not after"):
        load_philly_jobs(path, start="2017-10-10", end="2017-10-09")
    assert [j.group for j in load_philly_jobs(path, clusters=frozenset({"a"}))] == ["a"]


def test_gavel_jobs_valid_rows_still_load(tmp_path: Path) -> None:
    path = _file(tmp_path, GAVEL_HEAD + "0,0,A3C,1,10,100,,\n1,5,A3C,2.0,10,,200,300\n")
    jobs = load_gavel_jobs(path)
    assert [(j.key, j.num_gpus, j.duration_s) for j in jobs] == [("0", 1, 100.0), ("1", 2, 200.0)]


def _fleet_yaml(count: object = 2) -> str:
    return (
        f"racks:\n  - name: r\n    nodes:\n      - name: n\n        devices: {{model: T4, count: {count}}}\n"
    )


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (_fleet_yaml(3_000_000), ["devices[0].count", "128"]),
        (_fleet_yaml(".inf"), ["devices[0].count"]),
        ("racks: []\n# caf\xe9\n".encode("latin-1"), ["not UTF-8"]),
        (_fleet_yaml() + "racks: []\n", ["duplicated key 'racks'", "line 6"]),
        ("racks: [\n", ["not valid YAML", "line"]),
        (_fleet_yaml().replace("name: n", "name: " + "n" * 300), ["not a valid name"]),
    ],
)
def test_bad_fleet_files(tmp_path: Path, content: str | bytes, words: list[str]) -> None:
    path = _file(tmp_path, content, "fleet.yaml")
    with pytest.raises(FleetFileError) as info:
        load_fleet(path)
    message = str(info.value)
    assert str(path) in message and "fix:" in message and "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_fleet_csv_without_sn_and_bad_specs(tmp_path: Path) -> None:
    path = _file(tmp_path, "cpu_milli,memory_mib,gpu,model\n1000,1024,2,T4\n", "nodes.csv")
    with pytest.raises(TraceError, match="'sn'"):
        load_openb_nodes(path)
    with pytest.raises(TraceError, match="'sn'"):
        fleet_from_spec(str(path))
    bad = ["gavel:x", "gavel:0", "gavel:7", "uniform:1000000000x8", "uniform:2x0", "uniform:2x8:V100:x"]
    for spec in bad:
        with pytest.raises(GpuschedError):
            fleet_from_spec(spec)
