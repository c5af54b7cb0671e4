"""Preemption on Airflow's distributed engine: GPUCeleryExecutor, Redis, PostgreSQL, one GPU host
with one GPU (``gpusched.deploy.multihost_cluster.LocalCluster``).

The same DAGs as ``test_airflow_preemption_e2e.py``: a low-priority trainer on the only GPU is
preempted by a critical task; it checkpoints through the ledger (PostgreSQL, read by the task on
the Celery worker), is cleared and stopped by Airflow's supervisor on the worker, resumes from its
checkpoint in its next try and succeeds without using a retry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from _airflow_support import wait_on_cluster
from test_airflow_preemption_e2e import CRITICAL, DAGS_SOURCE, VICTIM

from gpusched.deploy.multihost_cluster import LocalCluster
from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.multihost, pytest.mark.airflow, pytest.mark.slow]

FLEET = """
name: one-gpu-host
racks:
  - name: r1
    nodes:
      - name: host-a
        cpu: 8
        memory: 32GiB
        devices: {model: A100-SXM-80GB, count: 1}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("celery_preempt")
    fleet = base / "one-gpu-host.yaml"
    fleet.write_text(FLEET)
    env = {"E2E_PREEMPT_DIR": str(base / "out"), "AIRFLOW__GPUSCHED__PREEMPTION": "priority",
           "AIRFLOW__GPUSCHED__PREEMPTION_GRACE_SECONDS": "30",
           "AIRFLOW__GPUSCHED__PREEMPTION_MIN_RUNTIME_SECONDS": "2"}
    local = LocalCluster(base, {"e2e_preempt.py": DAGS_SOURCE}, hosts=("host-a",), fleet=fleet, env=env)
    try:
        local.start()
        yield local
    finally:
        local.stop()


_wait = wait_on_cluster


def test_celery_preemption_requeues_the_victim_without_a_failed_try(cluster: LocalCluster) -> None:
    from gpusched.ledger import Ledger

    out = cluster.out
    _wait(cluster, "the scheduler and dag-processor", cluster.healthy, 300)
    _wait(cluster, "the DAGs to be parsed", lambda: {VICTIM, CRITICAL} <= {
        d["dag_id"] for d in cluster.api("GET", "/dags")["dags"]}, 180)

    def ti(dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        return dict(cluster.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"))

    def finished(dag_id: str, run_id: str, task_id: str) -> dict[str, Any] | None:
        found = ti(dag_id, run_id, task_id)
        return found if found["state"] in ("success", "failed") else None

    victim_run = cluster.trigger(VICTIM)
    _wait(cluster, "the trainer's first checkpoint", lambda: (out / "state.json").exists(), 240)
    critical_run = cluster.trigger(CRITICAL)
    urgent = _wait(cluster, "the critical task", lambda: finished(CRITICAL, critical_run, "urgent"), 240, 2)
    assert urgent["state"] == "success", urgent
    final = _wait(cluster, "the trainer", lambda: finished(VICTIM, victim_run, "train"), 300, 2)
    assert final["state"] == "success" and final["try_number"] == 2 and final["max_tries"] == 1, final
    assert (out / "preempted-try1").read_text() == "1"
    assert (out / "sigterm-try1").read_text() == "SIGTERM"
    assert int((out / "start-try2").read_text()) >= 4
    ledger = Ledger(cluster.db_url)
    try:
        first_try = ti_key(VICTIM, "train", victim_run, 1)
        assert [e.subject for e in ledger.events(20, kinds=["preempted"])] == [first_try]
        history = ledger.history(0, time.time() + 1)
        released = [a for a in history if a.key == first_try]
        assert released and str(released[0].release_reason).startswith("preempted for")
        assert not ledger.active()
    finally:
        ledger.close()
    rows = cluster.api("GET", "/eventLogs", params={"event": "gpusched.preempted", "dag_id": VICTIM})
    assert rows["total_entries"] == 1
