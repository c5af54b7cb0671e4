"""What is measured is what runs: the simulator and the GPU executors make the same decisions.

Four workloads, each run (a) through the simulator (:func:`gpusched.sim.engine.simulate`) and
(b) through an in-process executor on a migrated Airflow database, both on the same controlled
clock: the :class:`~gpusched.airflow.executor.GPUExecutor` on a SQLite ledger, and the
:class:`~gpusched.airflow.celery_executor.GPUCeleryExecutor` on a PostgreSQL ledger with two
registered GPU hosts (Celery's send recorded, as in ``test_celery_executor``). The executor is
driven the way the simulator replays: at each instant, tasks that end are finished, arrivals are
queued, then one scheduling cycle runs. The two ordered lists of decisions (start with devices,
stop, fail with the reason) must be equal:

- whole-GPU tasks, fractions sharing a device, a two-node gang, two tenants under a quota file (a
  budget and the 70/20/10 partitions), a high-priority task and one that can never fit;
- priority preemption with checkpoints: the victim's notice, its grace, its restart from its
  checkpoint (``[gpusched] preemption = priority``);
- a move between GPU types (``preemption = migrate``): notice, checkpoint, held target, restart cost;
- a GPU host lost and back (GPUCeleryExecutor only: the local executor runs on one host).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import gpu_workload, queue_reading_executor, recording_celery_executor
from _ledger_support import BACKENDS, database_url

from gpusched.gang import GANG_KEY, GangMember
from gpusched.quota.policy import QuotaPolicy
from gpusched.quota.usage import period_start
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key
from gpusched.sim.engine import SimJob, simulate

pytestmark = pytest.mark.airflow

T0 = 604800.0 * 2900
"""The executor's clock at the replay's instant 0: a whole number of weeks after the epoch, so
the budget periods (aligned on Mondays) begin at the same offsets on both clocks."""

RESET = period_start(T0, 604800) + 604800 - T0
"""When the next weekly budget period begins, on the replay's clock."""

DAG, RUN = "parity", "manual__1"
FLEET = """racks:
  - name: r
    nodes:
      - {name: host-a, cpu: 64, memory: 512GiB, devices: {model: A100-SXM-80GB, count: 4}}
      - {name: host-b, cpu: 64, memory: 512GiB, devices: {model: A100-SXM-80GB, count: 4}}
"""
QUOTA = """shares: {training: 70, burst: 20, dev: 10}
borrowing: true
budgets: {vision: 3}
period_s: 604800
"""


@dataclass(frozen=True)
class Job:
    """One task of the workload: its arrival, its true run time and what it asks for."""

    task_id: str
    arrival_s: float
    run_s: float
    fields: dict[str, Any]
    gang: tuple[int, int] | None = None  # (rank, size)

    @property
    def key(self) -> str:
        return ti_key(DAG, self.task_id, RUN, 1, -1)

    @property
    def request(self) -> GPURequest:
        return GPURequest.build(**{"expected_duration": f"{int(self.run_s)}s", **self.fields})

    def member(self) -> GangMember | None:
        if self.gang is None:
            return None
        return GangMember(f"{DAG}/{RUN}/-1/fit", self.gang[1], self.gang[0], "same_rack")


WORKLOAD = (
    Job("vision_a", 0, 3600, {"gpus": 2, "tenant": "vision"}),
    Job("nlp_half", 0, 1800, {"gpus": 0.5, "memory": "20GiB", "tenant": "nlp"}),
    Job("nlp_quarter", 0, 2400, {"gpus": 0.25, "memory": "10GiB", "tenant": "nlp"}),
    Job("dev_probe", 0, 1200, {"gpus": 1, "tenant": "nlp", "partition": "dev"}),
    Job("too_big", 0, 60, {"gpus": 16}),
    Job("fit__node0", 600, 3600, {"gpus": 4, "interconnect": "same_node", "tenant": "nlp"}, gang=(0, 2)),
    Job("fit__node1", 600, 3600, {"gpus": 4, "interconnect": "same_node", "tenant": "nlp"}, gang=(1, 2)),
    Job("vision_b", 900, 3600, {"gpus": 2, "tenant": "vision"}),
    Job("urgent", 1000, 600, {"gpus": 1, "tenant": "nlp", "priority": "high"}),
    Job("nlp_tail", 1200, 1800, {"gpus": 2, "tenant": "nlp"}),
)


def _simulated(policy: Any, fleet: Any) -> list[tuple[Any, ...]]:
    jobs = [SimJob(j.key, j.request, j.arrival_s, j.run_s, gang=j.member()) for j in WORKLOAD]
    result = simulate(jobs, fleet, policy, quota=QuotaPolicy.from_dict(_yaml(QUOTA)))
    decisions: list[tuple[Any, ...]] = [
        (round(r.start_s, 3), "start", r.key, _devices(r.shares)) for r in result.records
    ]
    arrival = {j.key: j.arrival_s for j in WORKLOAD}
    decisions += [(arrival[key], "fail", key, reason) for key, reason in result.rejected.items()]
    assert not result.unstarted, result.unstarted
    return sorted(decisions)


def _executed(ex: Any, reasons: dict[str, set[str]]) -> list[tuple[Any, ...]]:
    """The executor's decisions; ``reasons`` gets every reason each key waited with."""
    from airflow.utils.state import TaskInstanceState

    clock = [T0]
    ex.gpu.clock = lambda: clock[0]
    by_key = {j.key: j for j in WORKLOAD}
    workloads = {j.key: _workload(j) for j in WORKLOAD}
    ends: dict[str, float] = {}
    arrivals = sorted({j.arrival_s for j in WORKLOAD})
    decisions: list[tuple[Any, ...]] = []
    failed: set[str] = set()
    while arrivals or ends or ex.queued_tasks:
        # With nothing running or arriving, what still waits waits for the next budget period.
        t = min([*arrivals[:1], *ends.values()]) if arrivals or ends else RESET
        clock[0] = T0 + t
        for key in [k for k, end in ends.items() if end <= t]:  # completions, then arrivals, then a cycle
            del ends[key]
            ex.change_state(workloads[key].key, TaskInstanceState.SUCCESS)
        if arrivals and arrivals[0] == t:
            arrivals.pop(0)
            for job in WORKLOAD:
                if job.arrival_s == t:
                    ex.queue_workload(workloads[job.key], session=None)
        ex.trigger_tasks(ex.parallelism)
        for entry in ex.ledger.queue():
            reasons.setdefault(entry.key, set()).add(entry.reason)
        for sent in ex.take_dispatched():
            key = next(k for k, w in workloads.items() if w.key == sent)
            alloc = ex.ledger.get(key)
            decisions.append((round(t, 3), "start", key, _devices(alloc.shares)))
            ends[key] = t + by_key[key].run_s
        for key, workload in workloads.items():
            state = ex.event_buffer.get(workload.key, (None,))[0]
            if key not in failed and str(state) == "failed":
                failed.add(key)
                reason = ex.event_buffer[workload.key][1]
                prefix = "can never fit this fleet: "
                assert str(reason).startswith(prefix), reason
                decisions.append((t, "fail", key, str(reason)[len(prefix):]))
    return sorted(decisions)


def _workload(job: Job) -> Any:
    config: dict[str, Any] = {"gpusched": job.request.to_dict()}
    if job.gang is not None:
        config[GANG_KEY] = {"name": "fit", "size": job.gang[1], "rank": job.gang[0], "scope": "same_rack"}
    return gpu_workload(job.task_id, config, dag_id=DAG)


def _devices(shares: Any) -> tuple[tuple[str, int, int], ...]:
    return tuple(sorted((s.node, s.index, s.milli) for s in shares))


def _yaml(text: str) -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load(text))


@pytest.fixture
def fleet_text() -> str:
    """The fleet file both drivers run on (a test may parametrize another)."""
    return FLEET


@pytest.fixture
def gpusched_settings() -> dict[str, str]:
    """``[gpusched]`` settings of the executor, set before it is built (a test may parametrize them)."""
    return {}


@pytest.fixture(params=["local-sqlite", pytest.param("celery-postgresql", marks=BACKENDS[1].marks)])
def executor(
    request: pytest.FixtureRequest, airflow_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    fleet_text: str, gpusched_settings: dict[str, str],
) -> Iterator[Any]:
    fleet, quota = tmp_path / "fleet.yaml", tmp_path / "quota.yaml"
    fleet.write_text(fleet_text)
    quota.write_text(QUOTA)
    monkeypatch.setenv("GPUSCHED_FLEET", str(fleet))
    monkeypatch.setenv("GPUSCHED_QUOTA_FILE", str(quota))
    (tmp_path / "throughputs.json").write_text(json.dumps(THROUGHPUTS))
    for name, value in gpusched_settings.items():
        monkeypatch.setenv(f"AIRFLOW__GPUSCHED__{name.upper()}", value.replace("{tmp}", str(tmp_path)))
    if request.param == "local-sqlite":
        for ex in queue_reading_executor(monkeypatch):
            ex.take_dispatched = lambda ex=ex: _drain_local(ex)
            yield ex
        return
    for url in database_url("postgresql", tmp_path):
        yield from _celery_executor(url, fleet, monkeypatch)


def _drain_local(ex: Any) -> list[Any]:
    """The Airflow keys the local executor handed to its workers since the last call."""
    keys = []
    while not ex.activity_queue.empty():
        keys.append(ex.activity_queue.get()[0].key)
    return keys


def _celery_executor(url: str, fleet: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The recording GPUCeleryExecutor on the PostgreSQL ledger at ``url``; each workload it sends
    must go to the queue of the host that owns its devices."""
    for ex in recording_celery_executor(monkeypatch, url, fleet, stale_after_s=3600):

        def take(ex: Any = ex) -> list[Any]:
            for workload in ex.sent:
                (node,) = {s.node for s in ex.ledger.get(_ledger_key(workload)).shares}
                assert workload.ti.queue == f"gpusched@{node}", (workload.ti.queue, node)
            keys = [w.key for w in ex.sent]
            ex.sent.clear()
            return keys

        ex.take_dispatched = take
        yield ex


def _ledger_key(workload: Any) -> str:
    ti = workload.ti
    return ti_key(ti.dag_id, ti.task_id, ti.run_id, ti.try_number, -1)


def test_the_simulator_and_the_executor_make_the_same_decisions(executor: Any) -> None:
    reasons: dict[str, set[str]] = {}
    executed = _executed(executor, reasons)
    simulated = _simulated(executor.gpu.policy, executor.ledger.snapshot(T0))
    assert executed == simulated
    # The workload exercises what it claims to (a parity of nothing would pass too).
    starts = {d[2]: d for d in executed if d[1] == "start"}
    assert {d[2] for d in executed if d[1] == "fail"} == {ti_key(DAG, "too_big", RUN, 1, -1)}
    gang = [starts[ti_key(DAG, f"fit__node{r}", RUN, 1, -1)] for r in (0, 1)]
    assert gang[0][0] == gang[1][0] > 600  # together, once both nodes are free
    assert {dev[0] for d in gang for dev in d[3]} == {"host-a", "host-b"}
    shared = [d for d in starts.values() if any(dev[2] < 1000 for dev in d[3])]
    assert len(shared) == 2 and shared[0][3][0][:2] == shared[1][3][0][:2]  # the fractions share one GPU
    vision_b = ti_key(DAG, "vision_b", RUN, 1, -1)
    assert starts[vision_b][0] == RESET  # its tenant's budget held it until the next period
    assert any(r.startswith("tenant vision used") for r in reasons[vision_b]), reasons[vision_b]
    assert starts[ti_key(DAG, "urgent", RUN, 1, -1)][0] == 1000  # high priority: at once


# ---- preemption: notice, grace, checkpoints, requeue ---------------------------------------------

GRACE_S, CHECKPOINT_S, MIN_RUNTIME_S = 30.0, 1800.0, 300.0
PREEMPTING = (
    Job("low_a", 0, 7200, {"gpus": 4, "priority": "low"}),
    Job("low_b", 100, 10800, {"gpus": 4, "priority": "low"}),
    Job("urgent", 2000, 600, {"gpus": 2, "priority": "critical"}),
    Job("later", 2010, 300, {"gpus": 1, "priority": "low"}),
)
"""Two low-priority jobs fill both hosts; a critical one preempts the younger of them (least work
lost since its checkpoint at 1,900 s), which runs through its grace; a low one queued meanwhile
starts beside the critical one on the room it made; the victim restarts from its checkpoint once
its host is free again."""


def _simulated_preemption(policy: Any, fleet: Any) -> list[tuple[Any, ...]]:
    from gpusched.sim.preempt import SimPreemption

    jobs = [SimJob(j.key, j.request, j.arrival_s, j.run_s) for j in PREEMPTING]
    rules = SimPreemption("priority", checkpoint_s=CHECKPOINT_S, min_runtime_s=MIN_RUNTIME_S, grace_s=GRACE_S)
    result = simulate(jobs, fleet, policy, preemption=rules)
    return _runs(result)


def _executed_preemption(ex: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The executor's decisions on :data:`PREEMPTING`, driven as the simulator replays: at each
    instant, tasks that end are finished, running tasks report the checkpoints they made, arrivals
    are queued, victims whose grace ran out are stopped (Airflow's clear is recorded, the process
    ends and the next try is queued), then cycles run — again at the same instant after a cycle
    that began a preemption (the next heartbeat)."""
    from airflow.utils.state import TaskInstanceState

    from gpusched.airflow import gpu_preemption

    stopped: list[Any] = []
    monkeypatch.setattr(gpu_preemption, "requeue", _recorder(stopped))
    clock = [T0]
    ex.gpu.clock = lambda: clock[0]
    by_task = {j.task_id: j for j in PREEMPTING}
    tries: dict[str, int] = {}
    workloads: dict[Any, tuple[str, Any]] = {}  # Airflow key -> (task id, workload)
    current: dict[str, Any] = {}  # task id -> Airflow key of its latest try
    started_at: dict[str, float] = {}  # task id -> start of its current try
    done: dict[str, float] = {}  # task id -> seconds of work saved by its earlier tries
    ends: dict[str, float] = {}
    arrivals = sorted({j.arrival_s for j in PREEMPTING})
    decisions: list[tuple[Any, ...]] = []

    def queue(task_id: str) -> None:
        tries[task_id] = tries.get(task_id, 0) + 1
        job = by_task[task_id]
        config = {"gpusched": job.request.to_dict()}
        workload = gpu_workload(task_id, config, dag_id=DAG, try_number=tries[task_id])
        workloads[workload.key] = (task_id, workload)
        current[task_id] = workload.key
        ex.queue_workload(workload, session=None)

    def deadline() -> list[float]:
        due = ex.gpu.preemption.preemptions.next_deadline() - T0
        return [due] if due != float("inf") else []

    while arrivals or ends or ex.queued_tasks:
        t = min([*arrivals[:1], *ends.values(), *deadline()])
        clock[0] = T0 + t
        for task_id in [k for k, end in ends.items() if end <= t]:
            del ends[task_id]
            ex.change_state(current[task_id], TaskInstanceState.SUCCESS)
        for task_id, begun in started_at.items():  # the checkpoints the replay's model makes
            if task_id in ends and t - begun >= CHECKPOINT_S:
                at = begun + (t - begun) // CHECKPOINT_S * CHECKPOINT_S
                key = ti_key(DAG, task_id, RUN, tries[task_id], -1)
                ex.ledger.report_checkpoint(key, key, now=T0 + at)
        if arrivals and arrivals[0] == t:
            arrivals.pop(0)
            for job in PREEMPTING:
                if job.arrival_s == t:
                    queue(job.task_id)
        ex.gpu.preemption.advance(T0 + t)
        for airflow_key in stopped:  # Airflow stops the cleared try and schedules its next one
            task_id = workloads[airflow_key][0]
            begun = started_at.pop(task_id)
            done[task_id] = done.get(task_id, 0.0) + (t - begun) // CHECKPOINT_S * CHECKPOINT_S
            del ends[task_id]
            ex.change_state(airflow_key, TaskInstanceState.SUCCESS)
            decisions.append((round(t, 3), "stop", task_id, ()))
            queue(task_id)
        stopped.clear()
        while True:
            before = dict(ex.gpu.preemption.evictions)
            ex.trigger_tasks(ex.parallelism)
            for sent in ex.take_dispatched():
                task_id = workloads[sent][0]
                alloc = ex.ledger.get(ti_key(DAG, task_id, RUN, tries[task_id], -1))
                decisions.append((round(t, 3), "start", task_id, _devices(alloc.shares)))
                started_at[task_id] = t
                ends[task_id] = t + by_task[task_id].run_s - done.get(task_id, 0.0)
            if ex.gpu.preemption.evictions.keys() <= before.keys():
                break
    return sorted(decisions)


def _recorder(stopped: list[Any]) -> Any:
    """In place of Airflow's clear: record which try was to be stopped."""

    def requeue(key: Any, reason: str) -> str:
        stopped.append(key)
        return "recorded"

    return requeue


def _runs(result: Any, *, ends: bool = False) -> list[tuple[Any, ...]]:
    """A replay's decisions: each run of each job started on its devices, stopped when a later run
    follows (and, with ``ends``, its last run's end); every job ran, none was refused."""
    decisions: list[tuple[Any, ...]] = []
    for record in result.records:
        runs = record.segments or ((record.start_s, record.end_s, record.shares),)
        for n, (start, end, shares) in enumerate(runs):
            decisions.append((round(start, 3), "start", _task(record.key), _devices(shares)))
            if n < len(runs) - 1:
                decisions.append((round(end, 3), "stop", _task(record.key), ()))
            elif ends:
                decisions.append((round(end, 3), "end", _task(record.key), ()))
    assert not result.unstarted and not result.rejected
    return sorted(decisions)


def _task(key: str) -> str:
    from gpusched.scheduler.keys import parse_ti_key

    parts = parse_ti_key(key)
    assert parts is not None
    return parts.task_id


def test_preemption_makes_the_same_decisions_in_the_simulator_and_the_executor(
    executor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpusched.airflow.gpu_preemption import Preemptor

    monkeypatch.setenv("AIRFLOW__GPUSCHED__PREEMPTION", "priority")
    monkeypatch.setenv("AIRFLOW__GPUSCHED__PREEMPTION_GRACE_SECONDS", str(GRACE_S))
    monkeypatch.setenv("AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS", str(MIN_RUNTIME_S))
    executor.gpu.preemption = Preemptor(executor.gpu)
    assert executor.gpu.preemption.enabled
    executed = _executed_preemption(executor, monkeypatch)
    simulated = _simulated_preemption(executor.gpu.policy, executor.ledger.snapshot(T0))
    assert executed == simulated
    # What it claims to exercise: one stop at the end of the grace, the critical job starting on
    # the room it made (not the low job queued meanwhile), the victim restarting from its checkpoint.
    stops = [d for d in executed if d[1] == "stop"]
    assert stops == [(2000 + GRACE_S, "stop", "low_b", ())]
    starts = sorted((d[2], d[0]) for d in executed if d[1] == "start")
    assert starts == [("later", 2000 + GRACE_S), ("low_a", 0), ("low_b", 100),
                      ("low_b", 2000 + GRACE_S + 600), ("urgent", 2000 + GRACE_S)]


# ---- migration between GPU types -----------------------------------------------------------------

V100, K80 = "V100-SXM2-16GB", "K80"
MIGRATION_FLEET = f"""racks:
  - name: r
    nodes:
      - {{name: host-a, cpu: 64, memory: 512GiB, devices: {{model: {V100}, count: 1}}}}
      - {{name: host-b, cpu: 64, memory: 512GiB, devices: {{model: {K80}, count: 1}}}}
"""
THROUGHPUTS = {"cnn": {V100: 3.0, K80: 1.0}}
RUNS = {V100: 1.0, K80: 3.0}  # run time on each model, per second of V100 time
INTERVAL_S, RESTART_S = 360.0, 60.0
MIGRATING = (
    Job("short", 0, 3600, {"gpus": 1, "job_type": "cnn", "expected_duration": "30000s"}),
    Job("long", 10, 10000, {"gpus": 1, "job_type": "cnn"}),
)
"""The first job takes the V100, the second the K80 (the first is expected to hold the V100 for
30,000 s, so waiting for it would end later than running on the K80); the first ends early, and
when the V100 is free the migration rule moves the second there (its gain pays back the restart
within the interval)."""


def _simulated_migration(policy: Any, fleet: Any) -> list[tuple[Any, ...]]:
    from gpusched.sim.preempt import SimPreemption

    jobs = [SimJob(j.key, j.request, j.arrival_s, j.run_s, {m: j.run_s * f for m, f in RUNS.items()}, "cnn")
            for j in MIGRATING]
    rules = SimPreemption("migrate", restart_s=RESTART_S, horizon_s=INTERVAL_S, min_runtime_s=0.0)
    result = simulate(jobs, fleet, policy, preemption=rules)
    return _runs(result, ends=True)


def _executed_migration(ex: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The executor's decisions on :data:`MIGRATING`, driven as the simulator replays: at each
    instant, tasks that end are finished, arrivals queued, cycles run, then the migration rule
    (every :data:`INTERVAL_S` while anything runs). A moved task checkpoints on its notice (the
    replay's model), so it is stopped at once (Airflow's clear recorded, the process ends) and its
    next try, queued, is launched on the devices held for it; it pays the restart, then runs the
    rest of its work at the new model's speed."""
    from airflow.utils.state import TaskInstanceState

    from gpusched.airflow import gpu_preemption

    stopped: list[Any] = []
    monkeypatch.setattr(gpu_preemption, "requeue", _recorder(stopped))
    clock = [T0]
    ex.gpu.clock = lambda: clock[0]
    by_task = {j.task_id: j for j in MIGRATING}
    tries: dict[str, int] = {}
    current: dict[str, Any] = {}  # task id -> Airflow key of its latest try
    names: dict[Any, str] = {}  # Airflow key -> task id
    left: dict[str, float] = {j.task_id: 1.0 for j in MIGRATING}  # fraction of its work to run
    running: dict[str, tuple[float, float]] = {}  # task id -> (start, seconds for all its work here)
    ends: dict[str, float] = {}
    arrivals = sorted({j.arrival_s for j in MIGRATING})
    decisions: list[tuple[Any, ...]] = []
    next_check = 0.0

    def queue(task_id: str) -> None:
        tries[task_id] = tries.get(task_id, 0) + 1
        config = {"gpusched": by_task[task_id].request.to_dict()}
        workload = gpu_workload(task_id, config, dag_id=DAG, try_number=tries[task_id])
        current[task_id], names[workload.key] = workload.key, task_id
        ex.queue_workload(workload, session=None)

    def cycles(t: float) -> None:
        ex.trigger_tasks(ex.parallelism)
        for sent in ex.take_dispatched():
            task_id = names[sent]
            alloc = ex.ledger.get(ti_key(DAG, task_id, RUN, tries[task_id], -1))
            model = ex.ledger.snapshot(T0 + t).device(alloc.shares[0].uuid).model
            decisions.append((round(t, 3), "start", task_id, _devices(alloc.shares)))
            full = by_task[task_id].run_s * RUNS[model]
            running[task_id] = (t, full)
            ends[task_id] = t + (RESTART_S if tries[task_id] > 1 else 0.0) + full * left[task_id]

    def stop(t: float) -> None:
        for airflow_key in stopped:  # Airflow stops the cleared try and schedules its next one
            task_id = names[airflow_key]
            began, full = running.pop(task_id)
            left[task_id] -= (t - began) / full  # checkpointed on its notice: all its work kept
            del ends[task_id]
            ex.change_state(airflow_key, TaskInstanceState.SUCCESS)
            decisions.append((round(t, 3), "stop", task_id, ()))
            queue(task_id)
        stopped.clear()

    while arrivals or ends or ex.queued_tasks:
        t = min([*arrivals[:1], *ends.values(), *([max(next_check, clock[0] - T0)] if ends else [])])
        clock[0] = T0 + t
        for task_id in [k for k, end in ends.items() if end <= t]:
            del ends[task_id], running[task_id]
            ex.change_state(current[task_id], TaskInstanceState.SUCCESS)
            decisions.append((round(t, 3), "end", task_id, ()))
        if arrivals and arrivals[0] == t:
            arrivals.pop(0)
            for job in MIGRATING:
                if job.arrival_s == t:
                    queue(job.task_id)
        cycles(t)
        if running and t >= next_check:
            for move in ex.gpu.migration.tick(ex.gpu.policy, T0 + t):
                ex.ledger.report_checkpoint(move.old_key, move.old_key, now=T0 + t)
            ex.gpu.preemption.advance(T0 + t)
            stop(t)
            cycles(t)
            next_check = t + INTERVAL_S
    return sorted(decisions)


@pytest.mark.parametrize("fleet_text", [MIGRATION_FLEET])
@pytest.mark.parametrize("gpusched_settings", [{
    "preemption": "migrate", "migration_interval_seconds": str(INTERVAL_S),
    "migration_restart_seconds": str(RESTART_S), "preemption_min_runtime_seconds": "0",
    "throughput_file": "{tmp}/throughputs.json"}])
def test_migration_makes_the_same_decisions_in_the_simulator_and_the_executor(
    executor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert executor.gpu.migration.enabled
    executed = _executed_migration(executor, monkeypatch)
    simulated = _simulated_migration(executor.gpu.policy, executor.ledger.snapshot(T0))
    assert executed == simulated
    # What it claims to exercise: "long" starts on the K80, moves to the V100 when "short" leaves
    # it at 3,600 s, pays the restart and runs the rest of its work at V100 speed.
    (moved,) = [d for d in executed if d[1] == "stop"]
    assert moved[:3] == (3600.0, "stop", "long")
    starts = [(d[0], d[3][0][0]) for d in executed if d[1] == "start" and d[2] == "long"]
    assert starts == [(10.0, "host-b"), (3600.0, "host-a")]
    (end,) = [d[0] for d in executed if d[1] == "end" and d[2] == "long"]
    assert end == pytest.approx(3600 + RESTART_S + 10000 * (1 - 3590 / 30000), abs=0.01)


# ---- a GPU host lost and back ----------------------------------------------------------------------

LOST_AT, BACK_AT = 1000.0, 3000.0
LOSING = (
    Job("first", 0, 3600, {"gpus": 2}),
    Job("second", 0, 5400, {"gpus": 2}),
    Job("third", 1500, 1200, {"gpus": 4}),
)
"""Two jobs start together; at 1,000 s the scheduler finds host-a lost: whatever ran there is
stopped (no checkpoint yet: all its work is lost) and its retry runs on the other host; the third
job fits only once host-a is back."""


def _simulated_host_loss(policy: Any, fleet: Any) -> list[tuple[Any, ...]]:
    jobs = [SimJob(j.key, j.request, j.arrival_s, j.run_s) for j in LOSING]
    result = simulate(jobs, fleet, policy, node_losses=[(LOST_AT, "host-a", BACK_AT)])
    return _runs(result)


def _executed_host_loss(ex: Any) -> list[tuple[Any, ...]]:
    """The GPU Celery executor's decisions on :data:`LOSING`, driven as the simulator replays: at
    each instant tasks that end are finished, the agents that are up heartbeat (host-a's stops
    after instant 0 and starts again at :data:`BACK_AT`), the executor's lost-host check runs,
    failed tries are retried at once (their processes started: the Celery worker reported them
    ``STARTED`` and the task-side listener recorded them), arrivals are queued, then a cycle runs."""
    import os

    from airflow.utils.state import TaskInstanceState

    from gpusched.agent.host_guard import confirm_quarantined
    from gpusched.airflow.gpu_faults import handle_lost_hosts
    from gpusched.records import HolderProcess

    clock = [T0]
    ex.gpu.clock = lambda: clock[0]
    ex.watch.celery_state = lambda task_id: "STARTED"
    by_task = {j.task_id: j for j in LOSING}
    tries: dict[str, int] = {}
    current: dict[str, Any] = {}
    names: dict[Any, str] = {}
    ends: dict[str, float] = {}
    instants = sorted({j.arrival_s for j in LOSING} | {LOST_AT, BACK_AT})
    decisions: list[tuple[Any, ...]] = []

    def queue(task_id: str) -> None:
        tries[task_id] = tries.get(task_id, 0) + 1
        config = {"gpusched": by_task[task_id].request.to_dict()}
        workload = gpu_workload(task_id, config, dag_id=DAG, try_number=tries[task_id])
        current[task_id], names[workload.key] = workload.key, task_id
        ex.queue_workload(workload, session=None)

    while instants or ends or ex.queued_tasks:
        t = min([*instants[:1], *ends.values()])
        clock[0] = T0 + t
        if instants and instants[0] == t:
            instants.pop(0)
        for task_id in [k for k, end in ends.items() if end <= t]:
            del ends[task_id]
            ex.change_state(current[task_id], TaskInstanceState.SUCCESS)
        for host in ("host-a", "host-b"):
            if host == "host-b" or t == 0 or t >= BACK_AT:
                # As the agent does before each heartbeat: its lost tries' processes died with the
                # host, so their quarantine ends as it comes back.
                confirm_quarantined(ex.ledger, host, now=T0 + t)
                ex.ledger.heartbeat_host(host, now=T0 + t)
        handle_lost_hosts(ex.gpu, T0 + t)
        for task_id in [k for k in ends if str(ex.event_buffer.get(current[k], (None,))[0]) == "failed"]:
            del ends[task_id]
            decisions.append((round(t, 3), "stop", task_id, ()))
            queue(task_id)  # its retry
        for job in LOSING:
            if job.arrival_s == t:
                queue(job.task_id)
        ex.trigger_tasks(ex.parallelism)
        for sent in ex.take_dispatched():
            task_id = names[sent]
            key = ti_key(DAG, task_id, RUN, tries[task_id], -1)
            alloc = ex.ledger.get(key)
            ex.ledger.attach_process(key, HolderProcess("task", alloc.shares[0].node, os.getpid(), T0 + t))
            decisions.append((round(t, 3), "start", task_id, _devices(alloc.shares)))
            ends[task_id] = t + by_task[task_id].run_s
    return sorted(decisions)


CELERY_ONLY = [pytest.param("celery-postgresql", marks=BACKENDS[1].marks)]
"""Host loss is the multi-host executor's: the local one runs on a single host."""


@pytest.mark.parametrize("executor", CELERY_ONLY, indirect=True)
def test_a_lost_host_makes_the_same_decisions_in_the_simulator_and_the_executor(executor: Any) -> None:
    executed = _executed_host_loss(executor)
    simulated = _simulated_host_loss(executor.gpu.policy, executor.ledger.snapshot(T0))
    assert executed == simulated
    # What it claims to exercise: what ran on host-a stopped at the loss and ran again on host-b
    # at once; nothing started on host-a while it was lost; the third job waited for it to return.
    stops = {d[2] for d in executed if d[1] == "stop"}
    assert stops and all(d[0] == LOST_AT for d in executed if d[1] == "stop")
    starts = [d for d in executed if d[1] == "start"]
    for task in stops:
        again = [d for d in starts if d[2] == task and d[0] == LOST_AT]
        assert len(again) == 1 and {dev[0] for dev in again[0][3]} == {"host-b"}
    assert not [d for d in starts if LOST_AT <= d[0] < BACK_AT and any(dev[0] == "host-a" for dev in d[3])]
    (third,) = [d for d in starts if d[2] == "third"]
    assert third[0] == BACK_AT
