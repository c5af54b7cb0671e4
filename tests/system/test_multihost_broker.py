"""End to end: the Celery broker fails under GPUCeleryExecutor, and no GPU task pays for it.

Boots the local multi-host deployment (``gpusched.deploy.multihost_cluster.LocalCluster``: real
``redis-server`` without persistence, a throwaway PostgreSQL, Airflow's scheduler with
``GPUCeleryExecutor``, api-server, dag-processor, and per GPU host — ``host-a``: 2 A100,
``host-b``: 2 L40S — one Celery worker with one slot plus ``gpusched agent``), then:

(a) Redis is down for 40 s while GPU tasks are triggered: they stay queued (the scheduler says
    once that GPU dispatch is paused), run once it is back, and no retry is spent and no DAG run
    fails.
(b) Redis is restarted while tasks without GPUs hold each host's one worker slot and GPU tries
    sent to the hosts wait in their queues (the executor counts its own GPU tries against a
    host's slots, not other tasks; the tries beyond the free slots wait in the executor): the
    waiting messages are lost with it; each lost dispatch is found and placed again within 60 s
    of the restart without spending a retry, the tries never sent are never touched, every task
    ends in success and no allocation is left.

Every wait is on a condition with a generous timeout (a loaded 2-core machine); the tasks that
must still be running at the restart wait for a file the test writes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _airflow_support import wait_on_cluster

from gpusched.deploy.multihost_cluster import LocalCluster
from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.multihost, pytest.mark.airflow, pytest.mark.slow]

HOSTS = ("host-a", "host-b")
DAG_SOURCE = '''
from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, get_current_context, task

from gpusched.airflow.authoring import gpu

OUT = Path(os.environ["GPUSCHED_TEST_OUT"])
RETRY = {"retries": 1, "retry_delay": timedelta(seconds=1)}


def _record() -> None:
    ti = get_current_context()["ti"]
    seen = {"host": os.environ.get("GPUSCHED_HOST"), "try_number": ti.try_number, "started": time.time()}
    (OUT / f"{ti.dag_id}.{ti.task_id}-{ti.try_number}.json").write_text(json.dumps(seen))


@dag(dag_id="bk_outage", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bk_outage():
    for i in range(3):
        task(task_id=f"gpu_{i}", **RETRY, **gpu(gpus=1, vendor="nvidia"))(_record)()


def _held() -> None:
    _record()
    deadline = time.time() + 900
    while not (OUT / "go").exists() and time.time() < deadline:
        time.sleep(1)


@dag(dag_id="bk_restart", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def bk_restart():
    # Tasks without GPUs take each host's one worker slot (hand-routed, so one per host): the GPU
    # tries sent meanwhile wait in the hosts' queues, where a restarted broker loses them.
    for host in ("host-a", "host-b"):
        task(task_id=f"plain_{host}", queue=f"gpusched@{host}")(_held)()
    for i in range(4):
        task(task_id=f"gpu_{i}", **RETRY, **gpu(gpus=1, vendor="nvidia"))(_held)()


bk_outage()
bk_restart()
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("broker"), {"broker_dags.py": DAG_SOURCE}, hosts=HOSTS,
                         worker_concurrency=1)
    try:
        local.start()
        _wait(local, "scheduler and dag-processor to be healthy", local.healthy, 300, 2)
        yield local
    finally:
        local.stop()


_wait = wait_on_cluster


def _tis(cluster: LocalCluster, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
    return {ti["task_id"]: ti for ti in cluster.task_instances(dag_id, run_id)}


def _scheduler_lines(cluster: LocalCluster, text: str) -> list[str]:
    return [line for line in (cluster.logs / "scheduler.log").read_text(errors="replace").splitlines()
            if text in line]


def _ready(cluster: LocalCluster, dag_id: str) -> Any:
    from gpusched.ledger import Ledger

    ledger = Ledger(cluster.db_url)
    _wait(cluster, "both GPU hosts to register", lambda: len(ledger.hosts()) == 2, 120)
    _wait(cluster, f"{dag_id} to be parsed", lambda: cluster.api("GET", f"/dags/{dag_id}"), 180, 2)
    return ledger


def test_a_broker_down_for_40_s_costs_no_gpu_task_a_retry(cluster: LocalCluster) -> None:
    ledger = _ready(cluster, "bk_outage")
    try:
        cluster.stop_broker()
        stopped = time.monotonic()
        run_id = cluster.trigger("bk_outage")
        _wait(cluster, "the scheduler to pause GPU dispatch",
              lambda: _scheduler_lines(cluster, "GPU dispatch paused"), 180, 2)
        states = {t: ti["state"] for t, ti in _tis(cluster, "bk_outage", run_id).items()}
        assert set(states.values()) <= {"scheduled", "queued"}, states  # waiting, none failed
        assert not ledger.active()  # the try whose send failed has its devices back
        time.sleep(max(0.0, 40 - (time.monotonic() - stopped)))
        assert cluster.run_state("bk_outage", run_id) == "running"
        cluster.start_broker()
        back = time.time()
        down_s = time.monotonic() - stopped

        _wait(cluster, "bk_outage to finish",
              lambda: cluster.run_state("bk_outage", run_id) in ("success", "failed"), 300, 2)
        assert cluster.run_state("bk_outage", run_id) == "success", cluster.tail()
        tis = _tis(cluster, "bk_outage", run_id)
        assert {t: (ti["state"], ti["try_number"]) for t, ti in tis.items()} == {
            f"gpu_{i}": ("success", 1) for i in range(3)}, cluster.tail()
        starts = [json.loads((cluster.out / f"bk_outage.gpu_{i}-1.json").read_text())["started"]
                  for i in range(3)]
        assert _scheduler_lines(cluster, "GPU dispatch resumed"), cluster.tail()
        refused = ledger.events(kinds=["task_failed", "retry_refused"], limit=50)
        assert not [e for e in refused if "bk_outage" in e.subject]  # the fault chain never saw it
        _wait(cluster, "every allocation to be released", lambda: not ledger.active(), 60)
        paused = len(_scheduler_lines(cluster, "GPU dispatch paused"))
        print(f"broker down {down_s:.0f} s: 3 GPU tasks succeeded on try 1, started "
              f"{min(starts) - back:.1f} - {max(starts) - back:.1f} s after it was back; "
              f"{paused} pause line(s)")
    finally:
        ledger.close()


def test_a_broker_restart_loses_no_gpu_task(cluster: LocalCluster) -> None:
    ledger = _ready(cluster, "bk_restart")
    try:
        run_id = cluster.trigger("bk_restart")
        keys = {f"gpu_{i}": ti_key("bk_restart", f"gpu_{i}", run_id, 1) for i in range(4)}

        def started(prefix: str = "gpu_") -> set[str]:
            found = cluster.out.glob(f"bk_restart.{prefix}*-1.json")
            return {p.name.split(".")[1].rsplit("-", 1)[0] for p in found}

        def sent() -> set[str]:
            return {t for t, k in keys.items() if ledger.events(1, kinds=["launch"], subject=k)}

        # Both slots held by the tasks without GPUs; one GPU try sent to each host waits in its
        # queue; the two others wait in the executor (no free slot left for them).
        _wait(cluster, "both slots taken and 2 GPU tries sent", lambda: len(started("plain_")) == 2
              and len(sent()) == 2, 300, 2)
        time.sleep(3)
        queued = sent()
        assert len(queued) == 2 and not started()  # they really wait (their hosts' only slot is taken)
        never_sent = set(keys) - queued
        cluster.stop_broker()
        cluster.start_broker()  # no persistence: the waiting messages are gone
        restarted = time.time()

        def lost() -> dict[str, float]:
            found = {}
            for t in queued:
                events = ledger.events(1, kinds=["dispatch_lost"], subject=keys[t])
                if events:
                    found[t] = events[0].at
            return found

        _wait(cluster, "the lost dispatches to be placed again", lambda: len(lost()) == len(queued), 180, 2)
        replaced_s = {t: at - restarted for t, at in lost().items()}
        assert all(s <= 60 for s in replaced_s.values()), replaced_s
        for t in never_sent:  # still waiting in the executor: nothing of theirs was lost
            assert not ledger.events(1, kinds=["dispatch_lost"], subject=keys[t])
        (cluster.out / "go").write_text("")

        _wait(cluster, "bk_restart to finish",
              lambda: cluster.run_state("bk_restart", run_id) in ("success", "failed"), 300, 2)
        assert cluster.run_state("bk_restart", run_id) == "success", cluster.tail()
        tis = _tis(cluster, "bk_restart", run_id)
        assert {t: (ti["state"], ti["try_number"]) for t, ti in tis.items() if t in keys} == {
            t: ("success", 1) for t in keys}, cluster.tail()
        history = {}
        for alloc in ledger.history(since=restarted - 3600):
            history.setdefault(alloc.key, []).append(alloc)
        for t in queued:  # the lost one, released for it, then the one it ran on
            assert len(history[keys[t]]) == 2
            assert any("dispatch lost" in (a.release_reason or "") for a in history[keys[t]])
        _wait(cluster, "every allocation to be released", lambda: not ledger.active(), 60)
        seen = [json.loads((cluster.out / f"bk_restart.{t}-1.json").read_text()) for t in keys]
        assert {s["host"] for s in seen} <= set(HOSTS)
        print("broker restart -> lost dispatches placed again after "
              + ", ".join(f"{t}: {s:.1f} s" for t, s in sorted(replaced_s.items())))
    finally:
        ledger.close()
