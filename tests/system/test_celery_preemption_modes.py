"""The preemption modes ``partitions``, ``service`` and ``migrate`` on Airflow's distributed engine:
GPUCeleryExecutor, Redis, PostgreSQL and two GPU hosts, each with its own Celery worker on queue
``gpusched@<host>`` and its agent (``gpusched.deploy.multihost_cluster.LocalCluster``);
``host-a`` has one K80, ``host-b`` one A100.

One cluster serves the module; each test restarts only the scheduler with its mode's
``[gpusched]`` settings (:meth:`LocalCluster.restart_scheduler`). In each, a training task on
the A100 gets the executor's notice, checkpoints (``gpusched.airflow.checkpoint``), is cleared and
stopped by Airflow's supervisor in host-b's worker and requeued without using a retry, and its
next try resumes from the checkpoint and succeeds:

- ``partitions``: a ``dev`` task borrowed the A100 beyond its partition's share (a quota file,
  borrowing on); a ``training`` task reclaims it and runs on host-b. A second dev task ignores
  its notice and the scheduler restarts during its grace: the new executor adopts the try,
  restores its eviction (grace counted from the notice) and stops it; nothing is selected twice.
- ``service``: the history says 9 in 10 runs of the task take a second; a run that has already
  had 40 s is probably one of the ten-hour ones, and a fresh run preempts it (Gittins index).
- ``migrate``: a ``resnet`` task (10x faster on the A100, by the throughput file) started on
  host-a's K80 while the A100 was busy; when it frees, the task moves: its next try is held on
  the A100, pinned to that model and launched on host-b's queue.

``test_celery_preemption.py`` covers ``priority`` on one host.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import wait_on_cluster
from _ledger_support import assert_whole_devices_never_shared, record_finished_runs

from gpusched.deploy.multihost_cluster import LocalCluster
from gpusched.ledger.hosts import LAUNCH_EVENT
from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.multihost, pytest.mark.airflow, pytest.mark.slow]

A100, K80 = "A100-SXM-80GB", "K80"
FLEET = f"""
name: slow-and-fast
racks:
  - name: r1
    nodes:
      - name: host-a
        cpu: 8
        memory: 32GiB
        devices: {{model: {K80}, count: 1}}
      - name: host-b
        cpu: 8
        memory: 32GiB
        devices: {{model: {A100}, count: 1}}
"""
DAG_SOURCE = '''
from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, get_current_context, task

from gpusched.airflow.authoring import gpu

OUT = Path(os.environ["GPUSCHED_TEST_OUT"])
A100 = ["A100-SXM-80GB"]


def _record(name: str, **more: object) -> None:
    """Where and on what this try runs: OUT/<name>-try<N>.json."""
    try_number = get_current_context()["ti"].try_number
    seen = {"host": os.environ.get("GPUSCHED_HOST"),
            "models": json.loads(os.environ["GPUSCHED_ALLOCATION"])["models"], "at": time.time(), **more}
    (OUT / f"{name}-try{try_number}.json").write_text(json.dumps(seen))


def _train(name: str) -> None:
    """Steps of 0.5 s, a checkpoint every 4. The first try runs until it is preempted (10 minutes
    at most); a later one resumes from the last checkpoint and ends 4 steps later."""
    from gpusched.airflow import checkpoint

    try_number = get_current_context()["ti"].try_number
    earlier = checkpoint.resume()
    first = earlier.step + 1 if earlier is not None else 0
    _record(name, resumed_at=first)
    for step in range(first, 1200 if try_number == 1 else first + 4):
        time.sleep(0.5)
        if step % 4 == 3 or checkpoint.preempted():
            checkpoint.report(step=step, path=str(OUT / f"{name}.state"))
            (OUT / f"{name}-checkpoint-try{try_number}").write_text(str(step))
            if checkpoint.preempted():
                (OUT / f"{name}-preempted-try{try_number}").write_text(os.environ["GPUSCHED_PREEMPTED"])
                checkpoint.wait_for_stop()


@dag(dag_id="pm_dev", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pm_dev():
    @task(task_id="borrow", retries=0, **gpu(gpus=1, models=A100, partition="dev"))
    def borrow() -> None:
        _train("borrow")

    borrow()


@dag(dag_id="pm_stubborn", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pm_stubborn():
    @task(task_id="borrow", retries=0, **gpu(gpus=1, models=A100, partition="dev"))
    def borrow() -> None:
        """Ignores the notice: its first try runs until it is stopped; a later one ends at once."""
        _record("stubborn")
        if get_current_context()["ti"].try_number == 1:
            time.sleep(600)

    borrow()


@dag(dag_id="pm_training", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pm_training():
    @task(task_id="reclaim", **gpu(gpus=1, models=A100, partition="training"))
    def reclaim() -> None:
        _record("reclaim")
        time.sleep(1)

    reclaim()


@dag(dag_id="pm_service", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pm_service():
    @task(task_id="train", retries=0, **gpu(gpus=1, models=A100))
    def train() -> None:
        if get_current_context()["dag_run"].conf.get("quick"):
            _record("quick")
            time.sleep(1)
        else:
            _train("long")

    train()


@dag(dag_id="pm_mover", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pm_mover():
    @task(task_id="train", retries=0, **gpu(gpus=1, job_type="resnet"))
    def train() -> None:
        _train("mover")

    train()


@dag(dag_id="pm_blocker", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pm_blocker():
    @task(task_id="hold", **gpu(gpus=1, models=A100))
    def hold() -> None:
        _record("blocker")
        while not (OUT / "release-blocker").exists():
            time.sleep(0.5)

    hold()


pm_dev()
pm_stubborn()
pm_training()
pm_service()
pm_mover()
pm_blocker()
'''
DAG_IDS = {"pm_dev", "pm_stubborn", "pm_training", "pm_service", "pm_mover", "pm_blocker"}
SERVICE_MIN_RUNTIME_S = 40
"""``service``: the victim has had this much before it may be preempted, and the fresh task that
preempts it ends well within it (so the victim's requeued try cannot preempt it back)."""


def _modes(base: Path) -> dict[str, dict[str, str]]:
    """Each mode's scheduler settings (files under ``base``)."""
    quota = base / "quota.yaml"
    quota.write_text("shares: {training: 70, burst: 20, dev: 10}\nborrowing: true\n")
    throughputs = base / "throughputs.json"
    throughputs.write_text(json.dumps({"resnet": {A100: 10.0, K80: 1.0}}))
    return {
        "partitions": {"AIRFLOW__GPUSCHED__PREEMPTION": "partitions", "GPUSCHED_QUOTA_FILE": str(quota),
                       "AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS": "2"},
        "service": {"AIRFLOW__GPUSCHED__PREEMPTION": "service",
                    "AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS": str(SERVICE_MIN_RUNTIME_S)},
        # a short round: a move must pay back 1 s of restart within 5 s
        "migrate": {"AIRFLOW__GPUSCHED__PREEMPTION": "migrate",
                    "AIRFLOW__GPUSCHED__THROUGHPUT_FILE": str(throughputs),
                    "AIRFLOW__GPUSCHED__MIGRATION_INTERVAL_SECONDS": "5",
                    "AIRFLOW__GPUSCHED__MIGRATION_RESTART_SECONDS": "1",
                    "AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS": "2"},
    }


class Modes:
    """The module's cluster and its scheduler's mode."""

    def __init__(self, cluster: LocalCluster, modes: Mapping[str, dict[str, str]]) -> None:
        self.cluster = cluster
        self.modes = modes

    def use(self, mode: str, *, restart: bool = False) -> LocalCluster:
        """The cluster with its scheduler in ``mode`` (restarted if it was in another one, or
        ``restart``)."""
        if restart or self.cluster.scheduler_env != self.modes[mode]:
            self.cluster.restart_scheduler(self.modes[mode])
        _wait(self.cluster, "the scheduler and dag-processor", self.cluster.healthy, 300, 2)
        return self.cluster


@pytest.fixture(scope="module")
def modes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Modes]:
    base = tmp_path_factory.mktemp("celery_modes")
    (base / "fleet.yaml").write_text(FLEET)
    settings = _modes(base)
    local = LocalCluster(base, {"preemption_modes.py": DAG_SOURCE}, fleet=base / "fleet.yaml",
                         env={"AIRFLOW__GPUSCHED__PREEMPTION_GRACE_SECONDS": "30"},
                         scheduler_env=settings["partitions"])
    try:
        local.start()
        _wait(local, "the scheduler and dag-processor", local.healthy, 300, 2)
        _wait(local, "the DAGs to be parsed",
              lambda: {d["dag_id"] for d in local.api("GET", "/dags")["dags"]} >= DAG_IDS, 180, 2)
        yield Modes(local, settings)
    finally:
        local.stop()


_wait = wait_on_cluster


def _finished(cluster: LocalCluster, dag_id: str, run_id: str, task_id: str) -> dict[str, Any] | None:
    found = dict(cluster.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"))
    return found if found["state"] in ("success", "failed") else None


def _outcome(cluster: LocalCluster, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
    return dict(_wait(cluster, f"{dag_id}.{task_id} to finish",
                      lambda: _finished(cluster, dag_id, run_id, task_id), 300, 2))


def _seen(cluster: LocalCluster, name: str, try_number: int) -> dict[str, Any]:
    return dict(json.loads((cluster.out / f"{name}-try{try_number}.json").read_text()))


def _ran_without_a_failed_try(ti: dict[str, Any]) -> None:
    """Succeeded in its second try with no retry used (retries=0: max_tries follows the try)."""
    assert (ti["state"], ti["try_number"], ti["max_tries"]) == ("success", 2, 1), ti


def _audit(cluster: LocalCluster, event: str, dag_id: str) -> list[dict[str, Any]]:
    return list(cluster.api("GET", "/eventLogs", params={"event": event, "dag_id": dag_id})["event_logs"])


def _released(history: list[Any], key: str) -> Any:
    (alloc,) = [a for a in history if a.key == key]
    assert alloc.released_at is not None, alloc
    return alloc


def _before_every_allocation(ledger: Any) -> float:
    """A minute before the first allocation the ledger holds (or now): invented past runs that
    end then never overlap the module's real ones on the same device."""
    first = min((a.created_at for a in ledger.history(0, time.time() + 1)), default=time.time())
    return min(first, time.time()) - 60


def _launched_on(ledger: Any, key: str) -> str:
    """The GPU host whose queue the executor sent try ``key`` to."""
    (launch,) = ledger.events(10, kinds=[LAUNCH_EVENT], subject=key)
    return str(launch.detail["host"])


def test_partitions_a_training_task_reclaims_the_a100_a_dev_task_borrowed(modes: Modes) -> None:
    from gpusched.ledger import Ledger

    cluster = modes.use("partitions")
    borrow_run = cluster.trigger("pm_dev")
    _wait(cluster, "the dev task's first checkpoint",
          lambda: (cluster.out / "borrow-checkpoint-try1").exists(), 240)
    reclaim_run = cluster.trigger("pm_training")
    reclaim = _outcome(cluster, "pm_training", reclaim_run, "reclaim")
    assert (reclaim["state"], reclaim["try_number"]) == ("success", 1), reclaim
    borrow = _outcome(cluster, "pm_dev", borrow_run, "borrow")
    _ran_without_a_failed_try(borrow)
    assert "preempted for" in str(borrow["note"]), borrow
    assert (cluster.out / "borrow-preempted-try1").read_text() == "1"
    assert [_seen(cluster, "borrow", n)["host"] for n in (1, 2)] == ["host-b", "host-b"]
    assert _seen(cluster, "borrow", 2)["resumed_at"] >= 4  # from try 1's checkpoint
    winner_seen = _seen(cluster, "reclaim", 1)
    assert (winner_seen["host"], winner_seen["models"]) == ("host-b", [A100]), winner_seen

    ledger = Ledger(cluster.db_url)
    try:
        victim = ti_key("pm_dev", "borrow", borrow_run, 1)
        winner = ti_key("pm_training", "reclaim", reclaim_run, 1)
        preempted = [e for e in ledger.events(50, kinds=["preempted"]) if "pm_dev" in e.subject]
        assert [e.subject for e in preempted] == [victim], [(e.subject, e.at, e.detail) for e in preempted]
        (event,) = preempted
        assert event.detail["by"] == winner
        assert "partition 'dev' runs on capacity borrowed beyond its share; 'training' reclaims it" in str(
            event.detail["reason"]), event.detail
        history = ledger.history(0, time.time() + 1)
        stopped, reclaimed = _released(history, victim), _released(history, winner)
        assert str(stopped.release_reason).startswith("preempted for"), stopped.release_reason
        assert [s.node for s in reclaimed.shares] == ["host-b"]
        assert reclaimed.created_at >= stopped.released_at  # only once the borrower let go
        assert _launched_on(ledger, winner) == "host-b"
        assert _launched_on(ledger, ti_key("pm_dev", "borrow", borrow_run, 2)) == "host-b"
        assert_whole_devices_never_shared(history)
        assert not ledger.active()
    finally:
        ledger.close()
    rows = _audit(cluster, "gpusched.preempted", "pm_dev")
    assert len(rows) == 1, rows
    assert "reclaims it" in rows[0]["extra"], rows


def test_partitions_a_victim_being_stopped_when_the_scheduler_restarts_is_stopped_by_the_next(
        modes: Modes) -> None:
    from gpusched.ledger import Ledger

    cluster = modes.use("partitions")
    stubborn_run = cluster.trigger("pm_stubborn")
    _wait(cluster, "the stubborn dev task on the A100",
          lambda: (cluster.out / "stubborn-try1.json").exists(), 240)
    reclaim_run = cluster.trigger("pm_training")
    victim = ti_key("pm_stubborn", "borrow", stubborn_run, 1)
    beneficiary = ti_key("pm_training", "reclaim", reclaim_run, 1)
    ledger = Ledger(cluster.db_url)
    try:
        notice = _wait(cluster, "the stubborn task's notice",
                       lambda: next(iter(ledger.events(5, kinds=["preempted"], subject=victim)), None), 120)
        # It ignores the notice, so its grace (30 s) runs; the scheduler and its executor restart
        # meanwhile. The new executor adopts the running try from Celery and must finish the stop.
        cluster.restart_scheduler(cluster.scheduler_env)
        # The reclaimer was queued, waiting for the A100, when the scheduler stopped: Airflow
        # resets such an orphan and queues it again as its next try (never sent to Celery, it is
        # not adopted), which is still the preemption's beneficiary.
        reclaim = _outcome(cluster, "pm_training", reclaim_run, "reclaim")
        assert (reclaim["state"], reclaim["try_number"]) == ("success", 2), reclaim
        winner = ti_key("pm_training", "reclaim", reclaim_run, 2)
        stubborn = _outcome(cluster, "pm_stubborn", stubborn_run, "borrow")
        _ran_without_a_failed_try(stubborn)
        assert "preempted for" in str(stubborn["note"]), stubborn

        (resumed,) = ledger.events(5, kinds=["preemption_resumed"], subject=victim)
        assert (resumed.detail["by"], resumed.detail["notice_at"]) == (beneficiary, notice.at), resumed.detail
        preempted = [e for e in ledger.events(50, kinds=["preempted"]) if "pm_stubborn" in e.subject]
        assert [e.subject for e in preempted] == [victim], [(e.subject, e.detail) for e in preempted]
        history = ledger.history(0, time.time() + 1)
        stopped, reclaimed = _released(history, victim), _released(history, winner)
        assert str(stopped.release_reason).startswith("preempted for"), stopped.release_reason
        assert stopped.released_at >= notice.at + 29  # its whole grace, counted from the notice
        assert [s.node for s in reclaimed.shares] == ["host-b"]
        assert reclaimed.created_at >= stopped.released_at
        assert _launched_on(ledger, ti_key("pm_stubborn", "borrow", stubborn_run, 2)) == "host-b"
        assert_whole_devices_never_shared(history)
        assert not ledger.active()
    finally:
        ledger.close()


def test_service_a_fresh_run_preempts_one_that_outlived_most_runs_of_its_kind(modes: Modes) -> None:
    from gpusched.ledger import Ledger
    from gpusched.model import DeviceShare
    from gpusched.request import GPURequest

    cluster = modes.cluster
    ledger = Ledger(cluster.db_url)
    try:
        # The past, read by the executor (restarted after it) at its start: 27 runs of a second,
        # 3 of ten hours. Fresh, a run's index is about 0.9 /GPU-s; after 1 s, about 3e-5.
        (a100,) = [d for n in ledger.snapshot().nodes if n.name == "host-b" for d in n.devices]
        record_finished_runs(ledger, "pm_service", "train", GPURequest.build(gpus=1, models=[A100]),
                             DeviceShare(a100.uuid, "host-b", a100.index, 1000, 0),
                             [1.0] * 27 + [36_000.0] * 3, end=_before_every_allocation(ledger))
        cluster = modes.use("service", restart=True)
        long_run = cluster.trigger("pm_service")
        _wait(cluster, "the long run to start", lambda: (cluster.out / "long-try1.json").exists(), 240)
        quick_run = cluster.trigger("pm_service", {"quick": True})
        quick = _outcome(cluster, "pm_service", quick_run, "train")
        assert (quick["state"], quick["try_number"]) == ("success", 1), quick
        long = _outcome(cluster, "pm_service", long_run, "train")
        _ran_without_a_failed_try(long)
        assert "preempted for" in str(long["note"]), long
        assert (cluster.out / "long-preempted-try1").read_text() == "1"
        assert [_seen(cluster, "long", n)["host"] for n in (1, 2)] == ["host-b", "host-b"]
        assert _seen(cluster, "long", 2)["resumed_at"] >= 4
        assert _seen(cluster, "quick", 1)["host"] == "host-b"

        victim = ti_key("pm_service", "train", long_run, 1)
        winner = ti_key("pm_service", "train", quick_run, 1)
        preempted = [e for e in ledger.events(50, kinds=["preempted"]) if "pm_service" in e.subject]
        assert [e.subject for e in preempted] == [victim], [(e.subject, e.at, e.detail) for e in preempted]
        (event,) = preempted
        assert event.detail["by"] == winner
        assert "expected-service index" in str(event.detail["reason"]), event.detail
        assert [e.subject for e in ledger.events(20, kinds=["preempted"], since=event.at - 600)
                if "pm_service" in e.subject] == [victim]  # the quick run was never preempted back
        history = ledger.history(time.time() - 3600, time.time() + 1)
        stopped = _released(history, victim)
        assert stopped.released_at - stopped.created_at >= SERVICE_MIN_RUNTIME_S  # never a fresh victim
        assert _released(history, winner).created_at >= stopped.released_at
        assert _launched_on(ledger, winner) == "host-b"
        assert_whole_devices_never_shared(history)
        assert not ledger.active()
    finally:
        ledger.close()
    (row,) = _audit(cluster, "gpusched.preempted", "pm_service")
    assert "expected-service index" in row["extra"], row


def test_migrate_a_task_on_host_a_k80_moves_to_host_b_a100_once_it_frees(modes: Modes) -> None:
    from gpusched.ledger import Ledger

    cluster = modes.use("migrate")
    out = cluster.out
    blocker_run = cluster.trigger("pm_blocker")
    _wait(cluster, "the blocker on the A100", lambda: (out / "blocker-try1.json").exists(), 240)
    mover_run = cluster.trigger("pm_mover")
    _wait(cluster, "the mover on the K80", lambda: (out / "mover-try1.json").exists(), 240)
    first = _seen(cluster, "mover", 1)
    assert (first["host"], first["models"], first["resumed_at"]) == ("host-a", [K80], 0), first
    time.sleep(7)  # a migration round with the A100 busy: nothing moves
    assert not (out / "mover-preempted-try1").exists()
    (out / "release-blocker").write_text("1")
    assert _outcome(cluster, "pm_blocker", blocker_run, "hold")["state"] == "success"
    mover = _outcome(cluster, "pm_mover", mover_run, "train")
    _ran_without_a_failed_try(mover)
    assert "moving to A100-SXM-80GB" in str(mover["note"]), mover
    second = _seen(cluster, "mover", 2)
    assert (second["host"], second["models"]) == ("host-b", [A100]), second  # host-b's worker
    assert second["resumed_at"] >= 1  # from try 1's checkpoint

    ledger = Ledger(cluster.db_url)
    try:
        first_key = ti_key("pm_mover", "train", mover_run, 1)
        next_key = ti_key("pm_mover", "train", mover_run, 2)
        (event,) = ledger.events(20, kinds=["migrated"], subject=first_key)
        assert event.detail["next_try"] == next_key and event.detail["devices"] == ["host-b:0"]
        assert (event.detail["from_model"], event.detail["to_model"]) == (K80, A100)
        history = ledger.history(time.time() - 3600, time.time() + 1)
        old, new = _released(history, first_key), _released(history, next_key)
        assert [s.node for s in old.shares] == ["host-a"]
        assert str(old.release_reason).startswith("moving to A100-SXM-80GB"), old.release_reason
        assert [s.node for s in new.shares] == ["host-b"]
        assert _launched_on(ledger, first_key) == "host-a"
        assert _launched_on(ledger, next_key) == "host-b"  # sent to gpusched@host-b
        # try 2, and only it, was pinned to the A100 until it started
        for kind in ("request_pinned", "pin_cleared"):
            (pin,) = ledger.events(20, kinds=[kind], subject="pm_mover/train")
            assert (pin.detail["run_id"], pin.detail["try_number"]) == (mover_run, 2), pin
        assert_whole_devices_never_shared(history)
        assert not ledger.active()
        print(f"\nmigration: notice -> try 2 running on host-b {second['at'] - event.at:.1f} s")
    finally:
        ledger.close()
    (row,) = _audit(cluster, "gpusched.migrated", "pm_mover")
    assert "moving to A100-SXM-80GB" in row["extra"], row
