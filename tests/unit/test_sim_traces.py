"""Trace loaders and fleet builders on tiny samples written by the tests themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusched.errors import ConfigurationError
from gpusched.sim.fleets import fleet_from_spec, gavel_fleet, openb_fleet, uniform_fleet
from gpusched.sim.traces import (
    load_gavel_jobs,
    load_gavel_throughputs,
    load_openb_nodes,
    load_openb_pods,
    load_philly_jobs,
)


def _write(path: Path, text: str) -> Path:
    path.write_text(text.strip() + "\n", encoding="utf-8")
    return path


def test_openb_nodes_and_pods(tmp_path: Path) -> None:
    nodes = load_openb_nodes(
        _write(
            tmp_path / "n.csv",
            """
sn,cpu_milli,memory_mib,gpu,model
n0,64000,262144,2,P100
n1,96000,393216,8,V100M16
n2,32000,65536,0,
""",
        )
    )
    assert [(n.name, n.gpus, n.model) for n in nodes] == [
        ("n0", 2, "P100"),
        ("n1", 8, "V100M16"),
        ("n2", 0, ""),
    ]
    pods = load_openb_pods(
        _write(
            tmp_path / "p.csv",
            """
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
p0,12000,16384,1,460,,LS,Running,0,10,0
p1,88000,327680,8,1000,V100M16|V100M32,BE,Failed,5,9,5
p2,4000,8192,0,0,,BE,Running,1,2,1
""",
        )
    )
    assert pods[0].total_gpu_milli == 460 and pods[0].gpu_spec == ()
    assert pods[1].total_gpu_milli == 8000 and pods[1].gpu_spec == ("V100M16", "V100M32")
    assert pods[2].total_gpu_milli == 0
    # multigpu* lists have no gpu_spec column
    short = load_openb_pods(
        _write(tmp_path / "m.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\nq,1,1,2,1000")
    )
    assert short[0].num_gpu == 2 and short[0].gpu_spec == ()

    fleet = openb_fleet(nodes)
    assert fleet.total_devices() == 10  # the CPU-only node is left out
    assert {d.model for d in fleet.devices()} == {"P100-PCIE-16GB", "V100-SXM2-16GB"}
    assert fleet.node("n1").cpu_milli == 96000 and fleet.node("n1").memory_bytes == 393216 * 2**20


def test_openb_unknown_model_names_the_fix(tmp_path: Path) -> None:
    nodes = load_openb_nodes(_write(tmp_path / "n.csv", "sn,cpu_milli,memory_mib,gpu,model\nx,1,1,1,Z999"))
    with pytest.raises(ConfigurationError, match=r"accelerators\.json"):
        openb_fleet(nodes)


def test_gavel_both_layouts_and_throughputs(tmp_path: Path) -> None:
    stream = load_gavel_jobs(
        _write(
            tmp_path / "g.csv",
            """
job_id,arrival_time_s,job_type,scale_factor,total_steps,duration_s_v100,duration_s_p100,duration_s_k80
1,500.0,A3C,1,10,100.0,200.0,400.0
0,0.0,LM (batch size 5),1,10,50.0,60.0,70.0
""",
        )
    )
    assert [j.key for j in stream] == ["0", "1"]  # sorted by arrival
    assert stream[1].duration_on("K80") == 400.0 and stream[1].duration_s == 100.0
    msr = load_gavel_jobs(
        _write(
            tmp_path / "m.csv",
            """
vc,job_type,num_gpus(scale_factor),total_steps,arrival_time_s,dur_s_v100,dur_s_p100,dur_s_k80
0e4a51,A3C,2,95121,6.0,17465.9,,96905.7
""",
        )
    )
    assert msr[0].num_gpus == 2 and msr[0].group == "0e4a51"
    assert msr[0].duration_on("P100-PCIE-16GB") == float("inf")
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"v100": {"('A3C', 1)": {"null": 2.5, "('A3C', 1)": [1.0, 1.0]}}}))
    assert load_gavel_throughputs(table) == {"v100": {"('A3C', 1)": 2.5}}


def test_philly_window_and_filters(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "p.csv",
        """
timestamp,duration,num_gpus,gpu_time,cluster
2017-10-09 07:01:55,66.0,1,66.0,a
2017-10-08 23:59:59,10.0,1,10.0,a
2017-10-09 06:13:03,2951.0,16,47216.0,b
2017-10-10 00:00:00,5.0,1,5.0,a
2017-10-09 08:00:00,0.0,1,0.0,a
""",
    )
    jobs = load_philly_jobs(path, start="2017-10-09", end="2017-10-10")
    assert [(j.num_gpus, j.duration_s) for j in jobs] == [(16, 2951.0), (1, 66.0)]
    assert jobs[0].arrival_s == 0.0 and jobs[1].arrival_s == 2932.0  # 07:01:55 - 06:13:03
    assert len(load_philly_jobs(path, max_gpus=8)) == 3
    assert {j.group for j in load_philly_jobs(path, clusters=frozenset({"b"}))} == {"b"}
    with pytest.raises(ConfigurationError, match="does not exist"):
        load_philly_jobs(tmp_path / "missing.csv")


def test_fleet_builders() -> None:
    fleet = gavel_fleet()
    models = [d.model for d in fleet.devices()]
    assert len(models) == 108 and models[0] == "V100-SXM2-16GB" and models[-1] == "K80"
    assert {models.count(m) for m in set(models)} == {36}
    assert len(fleet.nodes) == 27
    with pytest.raises(ConfigurationError):
        gavel_fleet(gpus_per_server=5)
    uni = uniform_fleet(3, 8)
    assert uni.total_devices() == 24 and len({d.uuid for d in uni.devices()}) == 24
    assert fleet_from_spec("uniform:2x4:T4").total_devices() == 8
    assert fleet_from_spec("gavel").total_devices() == 108
    with pytest.raises(ConfigurationError, match="uniform:NODESxGPUS"):
        fleet_from_spec("uniform:bad")
