"""Migration in the simulator (``--preemption migrate``): a job moves to a faster free GPU type at a
round, keeps its work, pays the restart cost; no device is ever over-committed; Gavel's generator
reproduces the shared stream."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pytest

from gpusched.bench.gavel_stream import GAVEL_JOB_TYPES, gavel_stream
from gpusched.model import MILLI, FleetSnapshot
from gpusched.node_builder import SIM_LAYOUT, make_node
from gpusched.placement import Policy, RunningTask
from gpusched.placement.migration import Move
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.sim.engine import SimJob, simulate
from gpusched.sim.fleets import gavel_fleet
from gpusched.sim.preempt import SimPreemption

V100, P100, K80 = "V100-SXM2-16GB", "P100-PCIE-16GB", "K80"
POLICY = Policy.named("gpusched", throughput={"cnn": {V100: 3.0, P100: 2.0, K80: 1.0},
                                              "rec": {V100: 1.0, P100: 0.95, K80: 0.9}})
RUNS = {"cnn": {V100: 10_000.0, P100: 15_000.0, K80: 30_000.0},
        "rec": {V100: 9_000.0, P100: 9_474.0, K80: 10_000.0}}


def _job(key: str, kind: str, arrival: float, scale: float = 1.0) -> SimJob:
    runs = {m: s * scale for m, s in RUNS[kind].items()}
    return SimJob(key, GPURequest.build(gpus=1), arrival, min(runs.values()), runs, kind)


def test_a_job_moves_to_the_v100_another_job_frees_and_keeps_its_work() -> None:
    fleet = FleetSnapshot(tuple(make_node(name, model, 1, layout=SIM_LAYOUT, cpu_milli=0, memory_bytes=0)
                                for name, model in (("v", V100), ("k", K80))))
    jobs = [_job("short", "cnn", 0.0, 0.36), _job("long", "cnn", 10.0)]
    plain = {r.key: r for r in simulate(jobs, fleet, POLICY, round_s=360.0).records}
    assert plain["long"].models == (K80,) and plain["long"].end_s == 360.0 + 30_000.0
    moves = SimPreemption("migrate", restart_s=60.0, horizon_s=360.0, min_runtime_s=0.0)
    result = simulate(jobs, fleet, POLICY, round_s=360.0, preemption=moves)
    long = {r.key: r for r in result.records}["long"]
    # "long" starts on the K80 at the 360 s round; "short" leaves the V100 at 3600 s; by then "long"
    # has done 3240/30000 of its work; it moves at that round, restores for 60 s and runs the
    # remaining 89.2 % at V100 speed (8920 s).
    assert (long.models, long.start_s, long.preemptions) == ((V100,), 360.0, 1)
    assert long.end_s == pytest.approx(3600.0 + 60.0 + 8920.0)
    assert result.preemption == {"mode": "migrate", "min_runtime_s": 0.0, "restart_s": 60.0,
                                 "horizon_s": 360.0, "horizon": "round", "preemptions": 1,
                                 "jobs_preempted": 1, "lost_gpu_hours": round(60.0 / 3600, 3)}


class _Checked(SimPreemption):
    """Checks, before every migration decision, that the snapshot holds exactly the running jobs."""

    passes = 0

    def migrations(self, snapshot: FleetSnapshot, running: Mapping[str, RunningTask],  # type: ignore[override]
                   policy: Policy, now: float, quota: QuotaState, job_types: Mapping[str, str | None],
                   ) -> list[Move]:
        held: Counter[str] = Counter()
        for task in running.values():
            for share in task.shares:
                held[share.uuid] += share.milli
        for device in snapshot.devices():
            assert snapshot.used(device.uuid).used_milli == held[device.uuid] <= MILLI
        out = super().migrations(snapshot, running, policy, now, quota, job_types)
        after = snapshot.with_usage([s for m in out for s in m.shares], release=True)
        for move in out:  # the targets are free once the movers left
            after = after.with_usage(move.placement)
        assert all(after.used(d.uuid).used_milli <= MILLI for d in after.devices())
        type(self).passes += 1
        return out


def test_migration_never_over_commits_and_every_job_finishes() -> None:
    rng = random.Random(7)
    jobs = [_job(str(i), rng.choice(("cnn", "rec")), i * 900.0, rng.uniform(0.05, 1.0)) for i in range(80)]
    fleet = gavel_fleet(per_type=4, gpus_per_server=2)
    moves = _Checked("migrate", restart_s=60.0, horizon_s=360.0, min_runtime_s=0.0)
    result = simulate(jobs, fleet, POLICY, round_s=360.0, preemption=moves)
    assert _Checked.passes > 0 and moves.count > 0
    assert {r.key for r in result.records} == {j.key for j in jobs} and not result.unstarted
    assert all(r.end_s <= result.end_time for r in result.records)
    plain = simulate(jobs, fleet, POLICY, round_s=360.0)
    mean = lambda res: sum(r.jct_s for r in res.records) / len(res.records)  # noqa: E731
    assert mean(result) < mean(plain)


def test_gavel_generator_reproduces_the_shared_seed0_stream(tmp_path: Path) -> None:
    row = {str((t, 1)): {"null": 1.0} for t in GAVEL_JOB_TYPES}
    table = {short: row for short in ("v100", "p100", "k80")}
    path = tmp_path / "throughputs.json"
    path.write_text(json.dumps(table))
    jobs = gavel_stream(4.0, 0, 3, path)
    # job_id, arrival_time_s, job_type, duration_s_v100 of gavel_continuous_single_rate4.0_seed0_n15000.csv
    expected = [(0.0, "ResNet-18 (batch size 64)", 68344.35010595087),
                (244.5860729103015, "Transformer (batch size 16)", 31016.609145932227),
                (951.7748275290958, "Recommendation (batch size 1024)", 2146.6088374387864)]
    for job, (arrival, job_type, v100) in zip(jobs, expected, strict=True):
        assert job.arrival_s == pytest.approx(arrival, rel=1e-12)
        assert job.job_type == job_type
        assert job.durations[V100] == pytest.approx(v100, rel=1e-12)
    assert [j.arrival_s for j in gavel_stream(4.0, 1, 3, path)] != [j.arrival_s for j in jobs]
