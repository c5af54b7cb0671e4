"""Faults as machines have them, on the local multi-host cluster: a GPU is never used by two tries.

Real processes (``gpusched.deploy.multihost_cluster.LocalCluster``: Redis, PostgreSQL, the
GPUCeleryExecutor's scheduler, per GPU host a Celery worker and a ``gpusched agent``), hurt on
purpose while a GPU task runs:

* **worker SIGKILLed, agent alive** (the task process survives: it is in its own process group):
  the agent reports the worker gone, the host is lost, the running try is quarantined and failed,
  the agent kills the orphan and confirms, the retry runs on the other host, a task submitted
  once the worker is seen gone never goes to the dead host and nothing is left on its queue;
* **whole host frozen** (SIGSTOP of worker, agent and task), past the timeout, then thawed: the
  retry runs elsewhere; on the thaw the old try is killed and confirmed before any new task gets
  its devices;
* **agent alone frozen** (worker and task fine): the host is unconfirmed, not lost; the healthy
  try is not killed and runs to success on its first try;
* **worker slots**: ten quarter-GPU tasks on two hosts whose workers have 2 slots each: no host
  runs more tries than it has slots, nor is sent more than its slots plus the shipped prefetch
  (``[gpusched] worker_prefetch_multiplier`` = 1: one more per slot); the rest wait in the executor,
  not in a host's queue.

After each, the ledger's history replay (quarantined holders counted) shows no device with two
holders at any instant.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from _airflow_support import most_at_once, wait_on_cluster

from gpusched.deploy.multihost_cluster import LocalCluster
from gpusched.ledger import Ledger
from gpusched.ledger.audit import audit
from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.multihost, pytest.mark.airflow, pytest.mark.slow]

HOSTS = ("host-a", "host-b")
MODELS = {"host-a": "A100-SXM-80GB", "host-b": "L40S"}
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


def _record(first_try_sleeps: float = 0.0) -> None:
    ti = get_current_context()["ti"]
    seen = {"host": os.environ.get("GPUSCHED_HOST"), "pid": os.getpid(), "started": time.time(),
            "try_number": ti.try_number}
    (OUT / f"{ti.dag_id}-{ti.try_number}.json").write_text(json.dumps(seen))
    if ti.try_number == 1 and first_try_sleeps:
        time.sleep(first_try_sleeps)


def victim_dag(dag_id: str):
    @dag(dag_id=dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
    def victim_dag():
        @task(task_id="victim", retries=2, retry_delay=timedelta(seconds=1), **gpu(gpus=1, vendor="nvidia"))
        def victim() -> None:
            _record(first_try_sleeps=600)  # the test hurts its host meanwhile

        victim()

    return victim_dag()


def after_dag(dag_id: str, **request):
    @dag(dag_id=dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
    def after_dag():
        @task(task_id="after", **gpu(**request))
        def after() -> None:
            _record()

        after()

    return after_dag()


victim_dag("mf_kill")
victim_dag("mf_freeze")
after_dag("mf_after_kill", gpus=1, vendor="nvidia")
after_dag("mf_after_thaw_a", gpus=2, models=["A100-SXM-80GB"])
after_dag("mf_after_thaw_b", gpus=2, models=["L40S"])


@dag(dag_id="mf_steady", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def mf_steady():
    @task(task_id="steady", retries=1, retry_delay=timedelta(seconds=1), **gpu(gpus=1, vendor="nvidia"))
    def steady() -> None:
        _record()
        time.sleep(45)  # the test freezes its host's agent meanwhile

    steady()


mf_steady()


@dag(dag_id="mf_slots", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def mf_slots():
    for i in range(10):
        @task(task_id=f"q{i}", **gpu(gpus=0.25, memory="8GiB", vendor="nvidia"))
        def quarter() -> None:
            ti = get_current_context()["ti"]
            started = time.time()
            time.sleep(6)
            seen = {"host": os.environ.get("GPUSCHED_HOST"), "started": started, "ended": time.time()}
            (OUT / f"mf_slots-{ti.task_id}.json").write_text(json.dumps(seen))

        quarter()


mf_slots()
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("faults"), {"fault_dags.py": DAG_SOURCE}, hosts=HOSTS)
    try:
        local.start()
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def ledger(cluster: LocalCluster) -> Iterator[Ledger]:
    wait_on_cluster(cluster, "scheduler and dag-processor to be healthy", cluster.healthy, 300, 2)
    with Ledger(cluster.db_url) as led:
        wait_on_cluster(cluster, "both GPU hosts to be live with their workers",
                        lambda: [h.state for h in led.hosts()] == ["live", "live"], 180)
        for dag_id in ("mf_kill", "mf_freeze", "mf_after_kill", "mf_after_thaw_a", "mf_steady",
                       "mf_slots"):
            wait_on_cluster(cluster, f"{dag_id} to be parsed",
                            lambda d=dag_id: cluster.api("GET", f"/dags/{d}"), 180, 2)
        yield led


def _seen(cluster: LocalCluster, dag_id: str, try_number: int) -> dict[str, Any] | None:
    path = cluster.out / f"{dag_id}-{try_number}.json"
    return dict(json.loads(path.read_text())) if path.exists() else None


def _ti(cluster: LocalCluster, dag_id: str, run_id: str) -> dict[str, Any]:
    (ti,) = cluster.task_instances(dag_id, run_id)
    return ti


def _done(cluster: LocalCluster, dag_id: str, run_id: str) -> bool:
    return cluster.run_state(dag_id, run_id) in ("success", "failed")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _started(cluster: LocalCluster, dag_id: str) -> tuple[str, dict[str, Any]]:
    run_id = cluster.trigger(dag_id)
    wait_on_cluster(cluster, f"{dag_id} try 1 to start", lambda: _seen(cluster, dag_id, 1), 180)
    first = _seen(cluster, dag_id, 1)
    assert first is not None and first["host"] in HOSTS
    return run_id, first


def _hosts(first: dict[str, Any]) -> tuple[str, str]:
    """The host try 1 runs on (the one the test hurts) and the other one."""
    doomed = str(first["host"])
    return doomed, next(h for h in HOSTS if h != doomed)


def _queue_length(cluster: LocalCluster, host: str) -> int:
    import redis

    client = redis.Redis(host="127.0.0.1", port=cluster.redis_port)
    try:
        return int(client.llen(f"gpusched@{host}"))
    finally:
        client.close()


def test_a_dead_worker_beside_a_live_agent_loses_its_host_and_its_orphan_is_killed(
        cluster: LocalCluster, ledger: Ledger) -> None:
    run_id, first = _started(cluster, "mf_kill")
    doomed, survivor = _hosts(first)
    first_key = ti_key("mf_kill", "victim", run_id, 1)
    killed_at = time.time()
    cluster.kill_worker(doomed)
    assert not _gone(first["pid"])  # the try's process outlived its worker (its own process group)

    wait_on_cluster(cluster, "the agent to report the worker gone",
                    lambda: (ledger.host(doomed).worker_state or "") == "missing", 60)  # type: ignore[union-attr]
    after_id = cluster.trigger("mf_after_kill")
    wait_on_cluster(cluster, "the victim's retry to run", lambda: _seen(cluster, "mf_kill", 2), 180)
    recovered_s = _seen(cluster, "mf_kill", 2)["started"] - killed_at  # type: ignore[index]
    assert _seen(cluster, "mf_kill", 2)["host"] == survivor  # type: ignore[index]
    lost = ledger.host(doomed)
    assert lost is not None and lost.state == "lost", lost
    assert "its Celery worker (queue gpusched@" in (lost.reason or "") and "is missing" in (lost.reason or "")

    # The orphan of try 1 is killed by the agent, which then frees its devices.
    wait_on_cluster(cluster, "the orphaned try 1 to be killed", lambda: _gone(first["pid"]), 60)
    wait_on_cluster(cluster, "try 1's quarantine to end", lambda: not ledger.quarantined(doomed), 60)
    ended = ledger.get(first_key)
    assert ended is not None and ended.released_at is not None
    confirmed = f"host {doomed}'s agent confirmed try 1 stopped (killed task process"
    assert confirmed in (ended.release_reason or "")

    wait_on_cluster(cluster, "mf_kill and mf_after_kill to finish",
                    lambda: _done(cluster, "mf_kill", run_id) and _done(cluster, "mf_after_kill", after_id),
                    180, 2)
    assert (_ti(cluster, "mf_kill", run_id)["state"], _ti(cluster, "mf_kill", run_id)["try_number"]) == (
        "success", 2), cluster.tail()
    assert _ti(cluster, "mf_after_kill", after_id)["state"] == "success", cluster.tail()
    after_key = ti_key("mf_after_kill", "after", after_id, 1)
    after = [a for a in ledger.history(killed_at - 5) if a.key == after_key]
    assert after and all(s.node == survivor for a in after for s in a.shares)  # never sent to the dead host
    assert _queue_length(cluster, doomed) == 0
    print(f"worker SIGKILL (agent alive) -> retry running on {survivor}: {recovered_s:.1f} s")

    cluster.start_worker(doomed)
    wait_on_cluster(cluster, f"{doomed} to be live again",
                    lambda: ledger.host(doomed).state == "live", 120)  # type: ignore[union-attr]
    assert audit(ledger) == []


def test_a_frozen_host_thawed_stops_its_old_try_before_its_devices_are_given_again(
        cluster: LocalCluster, ledger: Ledger) -> None:
    run_id, first = _started(cluster, "mf_freeze")
    doomed, survivor = _hosts(first)
    first_key = ti_key("mf_freeze", "victim", run_id, 1)
    devices = {s.uuid for s in ledger.get(first_key).shares}  # type: ignore[union-attr]
    pids = cluster.freeze_host(doomed)
    try:
        wait_on_cluster(cluster, "the victim's retry to run elsewhere",
                        lambda: _seen(cluster, "mf_freeze", 2), 180)
        assert _seen(cluster, "mf_freeze", 2)["host"] == survivor  # type: ignore[index]
        fenced = ledger.get(first_key)
        assert fenced is not None and fenced.status == "quarantined", fenced
        waiting = f"host {doomed}: waiting for its agent to confirm try 1 stopped"
        assert waiting in (fenced.release_reason or "")
        assert not _gone(first["pid"])  # frozen, not dead
        thawed_at = time.time()
    finally:
        cluster.thaw_host(doomed, pids)
    # A task that needs every device of the thawed host, the quarantined one included.
    after_id = cluster.trigger(f"mf_after_thaw_{doomed[-1]}")
    wait_on_cluster(cluster, "the old try to be stopped", lambda: _gone(first["pid"]), 60)
    wait_on_cluster(cluster, "the quarantine to end",
                    lambda: ledger.get(first_key).released_at is not None, 60)  # type: ignore[union-attr]
    wait_on_cluster(cluster, "everything to finish", lambda: _done(cluster, "mf_freeze", run_id)
                    and _done(cluster, f"mf_after_thaw_{doomed[-1]}", after_id), 240, 2)
    assert _ti(cluster, "mf_freeze", run_id)["state"] == "success", cluster.tail()
    assert _ti(cluster, f"mf_after_thaw_{doomed[-1]}", after_id)["state"] == "success", cluster.tail()

    # In commit order, from the moment try 1 was quarantined: its devices were handed out again
    # only after its quarantine ended.
    events = list(reversed(ledger.events(10_000, kinds=["allocate", "quarantine", "unquarantine"],
                                         since=thawed_at - 120)))
    fenced_at = next(i for i, e in enumerate(events) if e.kind == "quarantine" and e.subject == first_key)
    ended = next(i for i, e in enumerate(events) if e.kind == "unquarantine" and e.subject == first_key)
    reused = [i for i, e in enumerate(events[fenced_at:], fenced_at)
              if e.kind == "allocate" and devices & set(e.detail.get("devices") or [])]
    assert fenced_at < ended and reused and min(reused) > ended, (fenced_at, ended, reused)
    assert audit(ledger) == []


def test_a_frozen_agent_alone_kills_no_healthy_try(cluster: LocalCluster, ledger: Ledger) -> None:
    run_id, first = _started(cluster, "mf_steady")
    host = first["host"]
    agent = cluster.procs[f"{host}-agent"].pid
    os.kill(agent, signal.SIGSTOP)
    try:
        wait_on_cluster(cluster, f"{host} to be unconfirmed",
                        lambda: ledger.host(host).state == "unconfirmed", 60)  # type: ignore[union-attr]
        record = ledger.host(host)
        assert record is not None and "running tries still heartbeat" in (record.reason or "")
        assert host not in {n.name for n in ledger.snapshot().nodes if not n.cordoned}  # nothing new there
        wait_on_cluster(cluster, "mf_steady to finish", lambda: _done(cluster, "mf_steady", run_id), 180, 2)
    finally:
        os.kill(agent, signal.SIGCONT)
    ti = _ti(cluster, "mf_steady", run_id)
    assert (ti["state"], ti["try_number"]) == ("success", 1), cluster.tail()
    assert _seen(cluster, "mf_steady", 2) is None  # never a second copy
    wait_on_cluster(cluster, f"{host} to be live again",
                    lambda: ledger.host(host).state == "live", 60)  # type: ignore[union-attr]
    assert audit(ledger) == []


def test_no_host_runs_more_tries_than_its_worker_has_slots(cluster: LocalCluster, ledger: Ledger) -> None:
    wait_on_cluster(cluster, "both hosts live with their slots known", lambda: [
        (h.state, h.worker_slots) for h in ledger.hosts()] == [("live", 2), ("live", 2)], 120)
    since = time.time()
    run_id = cluster.trigger("mf_slots")
    wait_on_cluster(cluster, "mf_slots to finish", lambda: _done(cluster, "mf_slots", run_id), 300, 2)
    states = {ti["task_id"]: ti["state"] for ti in cluster.task_instances("mf_slots", run_id)}
    assert states == {f"q{i}": "success" for i in range(10)}, cluster.tail()
    node_host = {node: host for node, (host, _) in ledger.node_hosts().items()}
    sent: dict[str, list[tuple[float, int]]] = {h: [] for h in HOSTS}
    tries = [a for a in ledger.history(since - 5) if a.key.startswith("airflow/mf_slots/")]
    assert len(tries) == 10  # one try each: nothing was sent twice
    for alloc in tries:
        host = node_host[alloc.shares[0].node]
        sent[host] += [(alloc.created_at, 1), (alloc.released_at or time.time(), -1)]
    ran: dict[str, list[tuple[float, int]]] = {h: [] for h in HOSTS}
    for i in range(10):
        seen = json.loads((cluster.out / f"mf_slots-q{i}.json").read_text())
        ran[seen["host"]] += [(seen["started"], 1), (seen["ended"], -1)]
    held = {host: most_at_once(spans) for host, spans in sent.items()}
    running = {host: most_at_once(spans) for host, spans in ran.items()}
    # Both hosts ran two at once, never more; a host held at most 2 slots + 1 prefetched per slot.
    assert running == {"host-a": 2, "host-b": 2}, (running, held)
    assert all(2 <= peak <= 4 for peak in held.values()), held
    # Those that could go neither to a free slot nor to a prefetch place waited in the executor, saying why.
    assert "every Celery worker slot is busy (2 of 2)" in (cluster.logs / "scheduler.log").read_text()
