"""End to end: real Airflow (``scripts/run.sh`` → ``airflow standalone`` on the PostgreSQL run.sh
starts itself; SQLite where the server binaries are absent) with the GPU executor on the default
simulated fleet runs the example DAGs (the multi-node gang once the agent switches the standby H100
node on).

Checks: every task succeeds; each GPU task got correctly placed devices (4 GPUs in one NVLink
island of one node; two half-GPU fine-tunes on one shared device; the dev smoke test on a dev
node); no device is over-committed at any instant of the ledger's allocation history; the task
logs show the CUDA_VISIBLE_DEVICES that the ledger recorded; a hard-isolated fraction runs on a
MIG instance and sees its MIG UUID; every allocation is released at the end; SIGINT stops
Airflow cleanly, its PostgreSQL with it; the API server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from _run_sh_support import REPO, Airflow, run_sh_airflow
from _run_sh_support import healthy as _healthy
from _run_sh_support import log_text as _log_text
from _run_sh_support import login as _login
from _run_sh_support import wait_for as _wait

from gpusched.deploy.airflow_instance import stop_run_sh as _stop
from gpusched.model import MILLI
from gpusched.scheduler.keys import parse_ti_key, ti_key

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

DAGS = ("example_multi_gpu_nvlink_training", "example_fractional_finetune", "example_dev_smoke_test")
GANG_DAG = "example_multi_node_gang"
WAIT_DAG = "e2e_gpu_wait"
WAIT_DAG_SOURCE = """
from __future__ import annotations

import time
from datetime import datetime

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(dag_id="e2e_gpu_wait", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_gpu_wait():
    # Two tasks that each need the whole 8-GPU H100 island: one must wait for the other.
    for name in ("first", "second"):
        @task(task_id=name, **gpu(gpus=8, models=["H100-SXM-80GB"], interconnect="island"))
        def hold_island() -> None:
            time.sleep(4)

        hold_island()


e2e_gpu_wait()
"""
NEVER_DAG = "e2e_gpu_never_fits"
NEVER_DAG_SOURCE = """
from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


def note_failure(context) -> None:
    Path(os.environ["AIRFLOW_HOME"], "e2e_gpu_never_fits.failed").write_text(str(context["ti"].try_number))


@dag(dag_id="e2e_gpu_never_fits", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_gpu_never_fits():
    # 64 NVLink-connected GPUs: the largest island of the default fleet has 8. Its retries must
    # not be spent (the same request fails the same way); its failure callback still runs.
    @task(task_id="huge", retries=2, retry_delay=timedelta(seconds=1), on_failure_callback=note_failure,
          **gpu(gpus=64, vendor="nvidia", interconnect="island"))
    def huge() -> None:
        raise AssertionError("must never start")

    huge()


e2e_gpu_never_fits()
"""
ISOLATED_DAG = "e2e_gpu_isolated"
ISOLATED_DAG_SOURCE = """
from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(dag_id="e2e_gpu_isolated", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def e2e_gpu_isolated():
    # A hard-isolated tenth of an NVIDIA GPU: a MIG instance of its own, named by its MIG UUID.
    @task(task_id="isolated", **gpu(gpus=0.1, memory="8GiB", isolation="hard", vendor="nvidia"))
    def isolated() -> None:
        print("isolated sees CUDA_VISIBLE_DEVICES=" + os.environ["CUDA_VISIBLE_DEVICES"])
        print("isolated sees GPUSCHED_ISOLATION=" + os.environ["GPUSCHED_ISOLATION"])

    isolated()


e2e_gpu_isolated()
"""
GPU_TASKS = {
    "example_multi_gpu_nvlink_training": ("train_resnet50",),
    "example_fractional_finetune": ("finetune_sentiment", "finetune_ner"),
    "example_dev_smoke_test": ("smoke_test",),
}


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    home = tmp_path_factory.mktemp("airflow_home")
    dags = tmp_path_factory.mktemp("dags")  # only the examples: other DAGs must not disturb the checks
    for dag_id in (*DAGS, GANG_DAG):
        shutil.copy(REPO / "dags" / f"{dag_id}.py", dags)
    (dags / f"{WAIT_DAG}.py").write_text(WAIT_DAG_SOURCE)
    (dags / f"{NEVER_DAG}.py").write_text(NEVER_DAG_SOURCE)
    (dags / f"{ISOLATED_DAG}.py").write_text(ISOLATED_DAG_SOURCE)
    yield from run_sh_airflow(home, dags, {
        "GPUSCHED_EXAMPLE_STEPS": "6",
        "GPUSCHED_EXAMPLE_STEP_SECONDS": "0.5",
        "AIRFLOW__CORE__PARALLELISM": "8",
    })


def _dags_loaded(airflow: Airflow) -> bool:
    found = {d["dag_id"] for d in airflow.api("GET", "/dags", params={"limit": 100})["dags"]}
    return {*DAGS, GANG_DAG, WAIT_DAG, NEVER_DAG, ISOLATED_DAG} <= found


def test_example_dags_run_on_placed_devices(airflow: Airflow) -> None:
    from gpusched.ledger import Ledger

    _wait("api-server, scheduler and dag-processor to be healthy", lambda: _healthy(airflow), 240, airflow)
    # Airflow's database is the one run.sh gives users: its own PostgreSQL where the server
    # binaries are installed (on SQLite the API server stalled under load: docs/reliability.md).
    said = [line for line in airflow.output.read_text(errors="replace").splitlines()
            if line.startswith("gpusched: Airflow database: ")]
    if airflow.pgdata is not None:
        assert said and said[0].startswith("gpusched: Airflow database: PostgreSQL"), said
        assert (airflow.pgdata / "data" / "postmaster.pid").is_file()
    else:
        assert said and "SQLite" in said[0], said
    # The main job's API server listens on loopback only (run.sh's default).
    import psutil

    port = int(airflow.url.rsplit(":", 1)[1])
    listening = {c.laddr.ip for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
    assert listening and listening <= {"127.0.0.1"}, listening
    airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
    _wait("the example DAGs to be parsed", lambda: _dags_loaded(airflow), 120, airflow)
    assert airflow.api("GET", "/importErrors")["total_entries"] == 0

    runs: dict[str, str] = {}
    for dag_id in (*DAGS, WAIT_DAG, ISOLATED_DAG):
        airflow.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
        run = airflow.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None})
        runs[dag_id] = run["dag_run_id"]

    def finished() -> bool:
        states = [airflow.api("GET", f"/dags/{d}/dagRuns/{r}")["state"] for d, r in runs.items()]
        return all(s in ("success", "failed") for s in states)

    _wait("the DAG runs to finish", finished, 300, airflow, interval=2)

    tis: dict[tuple[str, str], dict[str, Any]] = {}
    for dag_id, run_id in runs.items():
        for ti in airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]:
            tis[(dag_id, ti["task_id"])] = ti
    failed = {k: v["state"] for k, v in tis.items() if v["state"] != "success"}
    assert not failed, f"tasks not successful: {failed}\n{airflow.tail()}"

    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        _wait("every allocation to be released", lambda: not ledger.active(), 60, airflow)
        snapshot = ledger.snapshot()
        history = ledger.history(since=airflow.started_at - 60)
    finally:
        ledger.close()

    allocations = {}
    for dag_id, task_ids in GPU_TASKS.items():
        for task_id in task_ids:
            ti = tis[(dag_id, task_id)]
            key = ti_key(dag_id, task_id, runs[dag_id], ti["try_number"], ti["map_index"])
            found = [a for a in history if a.key == key]
            assert len(found) == 1, f"{key}: {len(found)} allocations in the ledger"
            allocations[task_id] = found[0]
            assert found[0].released_at is not None

    # 4 GPUs on one node, inside one NVLink/NVSwitch island.
    train = allocations["train_resnet50"]
    devices = [snapshot.device(s.uuid) for s in train.shares]
    assert len(devices) == 4 and len({s.uuid for s in train.shares}) == 4
    assert len({d.node for d in devices}) == 1
    assert devices[0].island is not None and len({d.island for d in devices}) == 1
    assert all(d.vendor == "nvidia" and d.link.is_high_speed for d in devices)
    assert all(s.milli == MILLI for s in train.shares)

    # The two half-GPU fine-tunes share one device.
    a, b = allocations["finetune_sentiment"], allocations["finetune_ner"]
    assert [s.milli for s in a.shares] == [s.milli for s in b.shares] == [500]
    assert a.shares[0].uuid == b.shares[0].uuid
    assert a.created_at < b.released_at and b.created_at < a.released_at  # they ran side by side

    # The dev smoke test got one device of a dev node.
    dev = allocations["smoke_test"]
    assert len(dev.shares) == 1
    assert snapshot.node(dev.shares[0].node).label("pool") == "dev"

    _assert_never_overcommitted(history, snapshot)

    # A GPU task that found no free island waited in the executor, then ran once devices freed.
    wait_run = runs[WAIT_DAG]
    wait_keys = {ti_key(WAIT_DAG, t, wait_run, tis[(WAIT_DAG, t)]["try_number"]) for t in ("first", "second")}
    early, late = sorted((a for a in history if a.key in wait_keys), key=lambda a: a.created_at)
    late_ti = tis[(WAIT_DAG, parse_ti_key(late.key).task_id)]  # type: ignore[union-attr]
    queued_at = datetime.fromisoformat(late_ti["queued_when"]).timestamp()
    assert early.released_at is not None
    assert queued_at < early.released_at <= late.created_at

    # The task logs show the devices the ledger recorded.
    for task_id, alloc in allocations.items():
        dag_id = next(d for d, ts in GPU_TASKS.items() if task_id in ts)
        ti = tis[(dag_id, task_id)]
        text = _log_text(airflow, dag_id, runs[dag_id], task_id, ti["try_number"])
        expected = ",".join(str(s.index) for s in sorted(alloc.shares, key=lambda s: s.index))
        assert f"CUDA_VISIBLE_DEVICES={expected}" in text, f"{task_id} log lacks {expected}:\n{text[-3000:]}"
        assert "gpusched: devices for" in text, f"{task_id}: listener did not log the devices"
        if alloc.shares[0].milli < MILLI:
            assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in text
    # The hard-isolated fraction ran on a MIG instance of its own and saw its MIG UUID.
    iso_ti = tis[(ISOLATED_DAG, "isolated")]
    iso_key = ti_key(ISOLATED_DAG, "isolated", runs[ISOLATED_DAG], iso_ti["try_number"], iso_ti["map_index"])
    (iso,) = [a for a in history if a.key == iso_key]
    (iso_share,) = iso.shares
    slice_ = snapshot.device(iso_share.uuid)
    assert slice_.parent is not None and slice_.profile is not None and iso_share.uuid.startswith("MIG-")
    assert snapshot.device(slice_.parent).mig_enabled and iso_share.milli == MILLI
    iso_log = _log_text(airflow, ISOLATED_DAG, runs[ISOLATED_DAG], "isolated", iso_ti["try_number"])
    assert f"isolated sees CUDA_VISIBLE_DEVICES={iso_share.uuid}" in iso_log, iso_log[-3000:]
    assert "isolated sees GPUSCHED_ISOLATION=hard" in iso_log
    cpu_log = _log_text(airflow, "example_multi_gpu_nvlink_training",
                        runs["example_multi_gpu_nvlink_training"], "report",
                        tis[("example_multi_gpu_nvlink_training", "report")]["try_number"])
    assert "final loss" in cpu_log


def _ready(airflow: Airflow) -> None:
    """Healthy, logged in and every DAG parsed (for a test run on its own)."""
    if not airflow.token:
        _wait("the api-server, scheduler and dag-processor", lambda: _healthy(airflow), 240, airflow)
        airflow.token = _wait("a login token", lambda: _login(airflow), 60, airflow)
        _wait("the DAGs to be parsed", lambda: _dags_loaded(airflow), 120, airflow)


def test_never_fitting_task_says_why_in_its_log_and_the_event_log(airflow: Airflow) -> None:
    """Before: the Logs tab showed only 'Could not read served logs', the event log had no
    gpusched.unschedulable row, and the fault chain retried it as an 'unknown failure'. Then:
    it went through every Airflow retry (the reason nested one level deeper each try), left a
    'state mismatch' row and Airflow's 'task state changed externally' error, and the fleet
    page did not show it."""
    import httpx

    from gpusched.ledger import Ledger

    _ready(airflow)
    airflow.api("PATCH", f"/dags/{NEVER_DAG}", json={"is_paused": False})
    run_id = airflow.api("POST", f"/dags/{NEVER_DAG}/dagRuns", json={"logical_date": None})["dag_run_id"]
    _wait("the never-fitting run to fail", lambda: airflow.api(
        "GET", f"/dags/{NEVER_DAG}/dagRuns/{run_id}")["state"] == "failed", 240, airflow, interval=2)
    ti = airflow.api("GET", f"/dags/{NEVER_DAG}/dagRuns/{run_id}/taskInstances/huge")
    assert ti["state"] == "failed" and ti["try_number"] == 1, ti  # retries=2: none spent
    text = _log_text(airflow, NEVER_DAG, run_id, "huge", 1)
    assert "can never fit this fleet" in text and "largest" in text, text[-3000:]

    def logged(event: str) -> list[dict[str, Any]]:
        rows = airflow.api("GET", "/eventLogs", params={"dag_id": NEVER_DAG, "event": event})["event_logs"]
        return list(rows)

    rows = _wait("the gpusched.unschedulable event log row", lambda: logged("gpusched.unschedulable"), 60,
                 airflow)
    (row,) = rows
    reason = row["extra"] or ""
    assert reason.startswith("can never fit this fleet: needs 64") and "\n" not in reason, rows
    assert "refused" not in reason and reason.count("can never fit") == 1
    # Airflow agrees with the executor: no state mismatch, no "changed externally" error.
    assert logged("state mismatch") == []
    assert not [line for line in airflow.output.read_text(errors="replace").splitlines()
                if "changed-externally" in line and NEVER_DAG in line]
    # Its failure callback still runs (in the dag-processor), for try 1.
    marker = airflow.home / f"{NEVER_DAG}.failed"
    _wait("the failure callback", marker.is_file, 120, airflow, interval=2)
    assert marker.read_text() == "1"
    # The fleet page lists it, with the executor's reason.
    failed = httpx.get(f"{airflow.url}/gpusched/unschedulable", headers=airflow.headers(), timeout=30).json()
    key = ti_key(NEVER_DAG, "huge", run_id, 1)
    assert [(f["key"], f["reason"]) for f in failed if f["task"]["dag_id"] == NEVER_DAG] == [(key, reason)]
    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        handled = _wait("the fault chain to handle it", lambda: [
            e for e in ledger.events(200, kinds=["failure_handled"]) if e.subject == key], 60, airflow)
        assert handled[0].detail["failure_kind"] == "unschedulable" and handled[0].detail["retry"] is False
        assert not [e for e in ledger.events(200, kinds=["scale_out_request"]) if e.subject == key]
    finally:
        ledger.close()


def test_the_gang_example_waits_for_the_standby_node_and_runs_once_it_is_on(airflow: Airflow) -> None:
    """Before: example_multi_node_gang failed at once as never fitting on the default fleet (rack-a
    has one H100 node in service and one on standby), and the agent's standby scale-out did not
    consider gangs. The agent runs once here with --scale-after 0 (run.sh's waits 300 s)."""
    import os
    import subprocess
    import sys

    from gpusched.ledger import Ledger
    from gpusched.ledger.queue import GangQueueEntry

    _ready(airflow)
    airflow.api("PATCH", f"/dags/{GANG_DAG}", json={"is_paused": False})
    run_id = airflow.api("POST", f"/dags/{GANG_DAG}/dagRuns", json={"logical_date": None})["dag_run_id"]
    ledger = Ledger(f"sqlite:///{airflow.home / 'gpusched' / 'ledger.db'}")
    try:
        def waiting() -> list[Any]:
            return [q for q in ledger.queue() if isinstance(q, GangQueueEntry) and q.gang.gang.startswith(
                f"{GANG_DAG}/{run_id}/")]

        queued = _wait("both gang members to wait", lambda: len(waiting()) == 2 and waiting(), 120,
                       airflow)
        assert {q.reason for q in queued} == {
            "multi-node gang pretrain: only 1 of 2 members fit on distinct nodes of one rack now "
            "(1 when idle); standby node a-h100-2 would make all 2 fit: waiting for the standby scale-out "
            "to switch it on"}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "GPUSCHED"))}
        env.update(AIRFLOW_HOME=str(airflow.home), GPUSCHED_BACKEND="simulated")
        agent = subprocess.run([sys.executable, "-m", "gpusched.cli", "agent", "--once", "--scale-after", "0",
                                "--port", "0"], env=env, capture_output=True, text=True, timeout=120)
        assert agent.returncode == 0, agent.stderr
        said = agent.stdout
        assert "multi-node gang pretrain" in said and "standby node a-h100-2" in said, said

        def done() -> bool:
            return airflow.api("GET", f"/dags/{GANG_DAG}/dagRuns/{run_id}")["state"] in ("success", "failed")

        _wait("the gang to run", done, 180, airflow, interval=2)
        tis = airflow.api("GET", f"/dags/{GANG_DAG}/dagRuns/{run_id}/taskInstances")["task_instances"]
        assert {t["task_id"]: t["state"] for t in tis} == {"pretrain__node0": "success",
                                                           "pretrain__node1": "success"}, airflow.tail()
        keys = {ti_key(GANG_DAG, t["task_id"], run_id, t["try_number"]) for t in tis}
        nodes = {a.key: {s.node for s in a.shares} for a in ledger.history(since=airflow.started_at - 60)
                 if a.key in keys}
        assert sorted(n for used in nodes.values() for n in used) == ["a-h100-1", "a-h100-2"], nodes
    finally:
        ledger.close()
    node1 = next(t for t in tis if t["task_id"] == "pretrain__node1")
    text = _log_text(airflow, GANG_DAG, run_id, "pretrain__node1", node1["try_number"])
    assert "NNODES=2" in text and "NODE_RANK=1" in text, text[-3000:]


def test_sigint_stops_airflow_cleanly(airflow: Airflow) -> None:
    code, leftovers = _stop(airflow.proc)
    assert code is not None, f"Airflow needed SIGKILL to stop:\n{airflow.tail()}"
    assert leftovers == [], f"processes left running after SIGINT: {leftovers}"
    assert "gpusched: stopped" in airflow.output.read_text(errors="replace")
    if airflow.pgdata is not None:  # run.sh stopped the PostgreSQL it started (its data stays)
        assert not (airflow.pgdata / "data" / "postmaster.pid").exists()
        assert (airflow.pgdata / "data" / "PG_VERSION").is_file()


def _assert_never_overcommitted(history: list[Any], snapshot: Any) -> None:
    events: list[tuple[float, int, Any]] = []
    for alloc in history:
        end = alloc.released_at if alloc.released_at is not None else float("inf")
        for share in alloc.shares:
            events.append((alloc.created_at, 1, share))
            events.append((end, 0, share))  # releases sort before grants at the same instant
    used: dict[str, list[int]] = {}
    for at, grant, share in sorted(events, key=lambda e: (e[0], e[1])):
        milli, memory = used.setdefault(share.uuid, [0, 0])
        sign = 1 if grant else -1
        used[share.uuid] = [milli + sign * share.milli, memory + sign * share.memory_bytes]
        assert used[share.uuid][0] <= MILLI, f"{share.uuid} over-committed at {at}"
        assert used[share.uuid][1] <= snapshot.device(share.uuid).memory_bytes, f"{share.uuid} memory at {at}"
