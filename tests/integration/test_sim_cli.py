"""`gpusched bench …` and `gpusched simulate` through a real subprocess, on tiny inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str | Path) -> dict:  # type: ignore[type-arg]
    proc = subprocess.run(
        [sys.executable, "-m", "gpusched.cli", *map(str, args), "--json", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def tiny(tmp_path: Path) -> dict[str, Path]:
    files = {
        "nodes": "sn,cpu_milli,memory_mib,gpu,model\na,16000,65536,2,T4\nb,16000,65536,2,T4\n",
        "pods": "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
        "deletion_time,scheduled_time\np0,2000,4096,1,500,,LS,Running,0,100,0\n"
        "p1,4000,8192,1,1000,,LS,Running,10,50,10\np2,8000,8192,2,1000,,BE,Running,20,90,20\n",
        "gavel": "job_id,arrival_time_s,job_type,scale_factor,total_steps,duration_s_v100,"
        "duration_s_p100,duration_s_k80\n"
        + "".join(f"{i},{i * 100.0},A3C,1,10,{3600 + i},{5400 + i},{9000 + i}\n" for i in range(6)),
        "philly": "timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-09 00:00:00,600,1,600,a\n"
        "2017-10-09 00:01:00,600,8,4800,a\n2017-10-09 00:02:00,60,2,120,b\n",
    }
    out = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.csv"
        path.write_text(text, encoding="utf-8")
        out[name] = path
    tp = tmp_path / "throughputs.json"
    tp.write_text(json.dumps({"v100": {"('A3C', 1)": {"null": 3.0}}, "k80": {"('A3C', 1)": {"null": 1.0}}}))
    out["throughputs"] = tp
    return out


def test_bench_openb_json(tiny: dict[str, Path]) -> None:
    data = _cli(
        "bench",
        "openb",
        "--pods",
        tiny["pods"],
        "--nodes",
        tiny["nodes"],
        "--policy",
        "random",
        "--seeds",
        "2",
    )
    assert set(data) >= {"unallocated_gpu_pct_median", "unallocated_gpu_pct", "seeds", "policy"}
    assert len(data["unallocated_gpu_pct"]) == 2 and data["capacity_milli"] == 4000


def test_bench_gavel_fifo_calibration_replay(tiny: dict[str, Path], tmp_path: Path) -> None:
    three = tmp_path / "three.json"
    three.write_text(json.dumps({t: {"('A3C', 1)": {"null": v}} for t, v in (("v100", 3.0), ("p100", 2.0),
                                                                                ("k80", 1.0))}))
    out = _cli("bench", "gavel", "--jobs", tiny["gavel"], "--throughputs", three, "--measure", "0-5",
               "--policy", "gavel-fifo", "--per-type", "1")
    assert out["policy"] == "gavel-fifo" and out["jobs_finished"] == 6
    assert sum(out["measured_by_model"].values()) == 6 and out["allocation_updates"] >= 1
    # Steps are the V100 duration × its speed; no job can finish faster than on a V100 alone.
    assert out["jct_mean_h"] >= 1.0 and out["fifo_ablation"] == "none"
    plain = _cli("bench", "gavel", "--jobs", tiny["gavel"], "--throughputs", three, "--measure", "0-5",
                 "--policy", "gavel-fifo", "--per-type", "1", "--fifo-ablation", "both")
    assert plain["fifo_ablation"] == "both" and plain["oversubscribed_updates"] == 0
    # A table without every GPU type is a one-line error naming the file.
    proc = subprocess.run(
        [sys.executable, "-m", "gpusched.cli", "bench", "gavel", "--jobs", str(tiny["gavel"]),
         "--throughputs", str(tiny["throughputs"]), "--measure", "0-5", "--policy", "gavel-fifo", "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode != 0 and "throughput" in proc.stderr and str(tiny["throughputs"]) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bench_gavel_and_philly_json(tiny: dict[str, Path], tmp_path: Path) -> None:
    gavel = _cli(
        "bench",
        "gavel",
        "--jobs",
        tiny["gavel"],
        "--throughputs",
        tiny["throughputs"],
        "--measure",
        "1-3",
        "--policy",
        "gpusched",
        "--out",
        tmp_path / "g.json",
    )
    assert gavel["jobs_finished"] == 3 and gavel["jct_mean_h"] >= 1.0
    assert json.loads((tmp_path / "g.json").read_text()) == gavel
    moved = _cli("bench", "gavel", "--jobs", tiny["gavel"], "--throughputs", tiny["throughputs"], "--measure",
                 "0-5", "--policy", "gpusched", "--per-type", "1", "--gpus-per-server", "1",
                 "--preemption", "migrate", "--restart-seconds", "30")
    assert moved["jobs_finished"] == 6 and moved["gpus_per_type"] == 1 and moved["cpu_s"] >= 0
    assert moved["preemption"]["mode"] == "migrate" and moved["preemption"]["restart_s"] == 30.0
    # every job alone on its fastest type (V100 here) from its arrival: the floor of any policy
    assert moved["jct_bound_h"] == round(sum(3600 + i for i in range(6)) / 6 / 3600, 4)
    assert moved["jct_mean_h"] >= moved["jct_bound_h"]
    ranked = _cli("bench", "gavel", "--jobs", tiny["gavel"], "--throughputs", tiny["throughputs"],
                  "--measure", "0-5", "--policy", "gpusched", "--per-type", "1", "--gpus-per-server", "1",
                  "--preemption", "service", "--durations", "predicted")
    assert ranked["jobs_finished"] == 6 and ranked["durations"] == "predicted"
    assert ranked["preemption"]["mode"] == "service" and ranked["prediction"]["learned_runs"] >= 1
    philly = _cli(
        "bench",
        "philly",
        "--jobs",
        tiny["philly"],
        "--nodes",
        "1",
        "--start",
        "2017-10-09",
        "--end",
        "2017-10-10",
        "--policy",
        "first-fit",
    )
    assert philly["jobs_finished"] == 3
    assert {"queue_delay_mean_s", "queue_delay_p95_s", "utilisation_pct", "fragmentation_pct"} <= set(philly)
    assert philly["queue_delay_mean_s"] > 0  # the 8-GPU job waits for the 1-GPU one on one node
    # Issue 12's interface: the FIFO first-fit baseline of the same run, and the ratios against it.
    assert philly["fifo_mean_delay_s"] == philly["mean_delay_s"] == philly["queue_delay_mean_s"]
    assert philly["delay_ratio_vs_fifo"] == philly["utilisation_ratio_vs_fifo"] == 1.0
    assert philly["durations"] == "none" and philly["prediction"] is None
    assert philly["cpu_s"] >= 0 and philly["fifo_cpu_s"] >= 0 and philly["wall_s"] >= 0
    for mode in ("predicted", "oracle"):
        run = _cli("bench", "philly", "--jobs", tiny["philly"], "--nodes", "1", "--start", "2017-10-09",
                   "--end", "2017-10-10", "--durations", mode, "--preemption", "off")
        assert run["durations"] == mode and run["jobs_finished"] == 3
        assert run["fifo_mean_delay_s"] == philly["fifo_mean_delay_s"]
        assert run["delay_ratio_vs_fifo"] == round(run["mean_delay_s"] / run["fifo_mean_delay_s"], 3)
        assert run["preemption"] == "off" and run["preemption_report"] is None
        if mode == "predicted":  # nothing finished before the window: learnt during the replay only
            assert run["prediction"]["warm_up_runs"] == 0 and run["prediction"]["learned_runs"] == 3
            assert run["prediction"]["jobs_without_estimate"] == 3  # none had finished when they started
    # --preemption on = by expected remaining service (too little history here: every job is in
    # the first least-attained-service queue, equal indices, nothing to preempt).
    pre = _cli("bench", "philly", "--jobs", tiny["philly"], "--nodes", "1", "--start", "2017-10-09",
               "--end", "2017-10-10", "--durations", "predicted", "--preemption", "on")
    assert pre["preemption"] == "on" and pre["preemption_mode"] == "service"
    assert pre["preemption_report"]["mode"] == "service"
    assert pre["preemption_report"]["preemptions"] == 0 and pre["jobs_finished"] == 3
    # 600 s × 1 GPU + 600 s × 8 + 60 s × 2 = 5,520 GPU-s; nothing lost
    assert pre["preemption_report"]["submitted_gpu_hours"] == 1.5
    assert pre["preemption_report"]["lost_gpu_pct_of_submitted"] == 0.0


def test_bench_latency_and_simulate_json(tiny: dict[str, Path]) -> None:
    lat = _cli("bench", "latency", "--nodes", "20", "--samples", "10")
    assert lat["nodes"] == 20 and 0 < lat["p50_ms"] <= lat["p99_ms"]
    assert not lat["resident"] and "release_p50_ms" not in lat["sweep"][0]
    assert "cold_cpu_p99_ms" not in lat["sweep"][0]
    kept = _cli("bench", "latency", "--nodes", "20", "--samples", "10", "--resident")
    row = kept["sweep"][0]
    assert kept["resident"] and 0 < row["cpu_p50_ms"] <= row["cpu_p99_ms"]
    assert 0 <= row["release_p50_ms"] <= row["release_p99_ms"]
    # the first pass over the stream (caches filled as shapes appear) is reported beside it
    assert 0 < row["cold_cpu_p50_ms"] <= row["cold_cpu_p99_ms"] <= row["cold_cpu_max_ms"]
    sim = _cli("simulate", "--trace", tiny["gavel"], "--fleet", "uniform:1x2:V100", "--policy", "best-fit")
    assert sim["jobs_finished"] == 6 and sim["capacity_gpus"] == 2
    learnt = _cli("simulate", "--trace", tiny["gavel"], "--fleet", "uniform:1x2:V100",
                  "--durations", "predicted")
    made = learnt["prediction"]
    assert learnt["durations"] == "predicted" and made["learned_runs"] == 6
    # Two GPUs, six hour-long jobs 100 s apart: the last two start after three have finished.
    assert made["jobs_predicted"] == 2 and made["jobs_without_estimate"] == 4
    assert made["errors"]["by_basis"]["task"]["count"] == 2
    pods = _cli("simulate", "--trace", tiny["pods"], "--fleet", tiny["nodes"], "--policy", "gpusched")
    assert pods["jobs_finished"] == 3


def test_bench_policy_parts(tiny: dict[str, Path]) -> None:
    """``--policy-parts`` changes the harnesses' preset as ``[gpusched] policy_parts`` does."""
    run = _cli("bench", "philly", "--jobs", tiny["philly"], "--nodes", "1", "--start", "2017-10-09",
               "--end", "2017-10-10", "--policy-parts", "tiebreak=earliest")
    assert run["policy_parts"] == "tiebreak=earliest" and run["jobs_finished"] == 3
    plain = _cli("bench", "philly", "--jobs", tiny["philly"], "--nodes", "1", "--start", "2017-10-09",
                 "--end", "2017-10-10")
    assert "policy_parts" not in plain


def test_bench_latency_prints_its_result_once() -> None:
    argv = [sys.executable, "-m", "gpusched.cli", "bench", "latency", "--nodes", "20", "--samples", "5"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout + proc.stderr).count("p50") == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("latency 20 nodes: p50 ")
