"""Worker prefetch end to end (``[gpusched] worker_prefetch_multiplier = 1``, the default, set explicitly).

On the local multi-host cluster (``gpusched.deploy.multihost_cluster.LocalCluster``: Redis,
PostgreSQL, ``GPUCeleryExecutor``, two GPU hosts whose Celery workers have 2 slots each), eight
quarter-GPU tasks that their author expects to run 20 s: the first four fill the slots, and the
executor's second look sends more to a host whose running tries are predicted to end soon. Shows:
a host holds tries beyond its slots (prefetched: allocated, waiting in its queue), never more than
slots + multiplier × slots; no host ever runs more task bodies at once than it has slots (the
prefetched ones start only when a slot frees); every task succeeds; and the ledger's history has
no device with two holders at any instant.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from _airflow_support import most_at_once, wait_on_cluster

from gpusched.deploy.multihost_cluster import LocalCluster
from gpusched.ledger import Ledger
from gpusched.ledger.audit import audit

pytestmark = [pytest.mark.multihost, pytest.mark.airflow, pytest.mark.slow]

HOSTS = ("host-a", "host-b")
SLOTS = 2
TASKS = 8
RUN_S = 20
DAG_SOURCE = f'''
from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, get_current_context, task

from gpusched.airflow.authoring import gpu

OUT = Path(os.environ["GPUSCHED_TEST_OUT"])


@dag(dag_id="pf_burst", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def pf_burst():
    for i in range({TASKS}):
        @task(task_id=f"p{{i}}", **gpu(gpus=0.25, memory="8GiB", vendor="nvidia", expected_duration={RUN_S}))
        def quarter() -> None:
            ti = get_current_context()["ti"]
            started = time.time()
            time.sleep({RUN_S})
            seen = {{"host": os.environ.get("GPUSCHED_HOST"), "started": started, "ended": time.time()}}
            (OUT / f"{{ti.task_id}}.json").write_text(json.dumps(seen))

        quarter()


pf_burst()
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path_factory.mktemp("prefetch"), {"prefetch_dags.py": DAG_SOURCE}, hosts=HOSTS,
                         worker_concurrency=SLOTS,
                         env={"AIRFLOW__GPUSCHED__WORKER_PREFETCH_MULTIPLIER": "1"})
    try:
        local.start()
        yield local
    finally:
        local.stop()


def test_a_busy_host_is_sent_tries_beyond_its_slots_that_start_when_a_slot_frees(
        cluster: LocalCluster) -> None:
    wait_on_cluster(cluster, "scheduler and dag-processor to be healthy", cluster.healthy, 300, 2)
    with Ledger(cluster.db_url) as ledger:
        wait_on_cluster(cluster, "both hosts live with their slots known", lambda: [
            (h.state, h.worker_slots) for h in ledger.hosts()] == [("live", SLOTS)] * 2, 180)
        wait_on_cluster(cluster, "pf_burst to be parsed",
                        lambda: cluster.api("GET", "/dags/pf_burst"), 180, 2)
        since = time.time()
        run_id = cluster.trigger("pf_burst")
        wait_on_cluster(cluster, "pf_burst to finish",
                        lambda: cluster.run_state("pf_burst", run_id) in ("success", "failed"), 420, 2)
        states = {ti["task_id"]: ti["state"] for ti in cluster.task_instances("pf_burst", run_id)}
        assert states == {f"p{i}": "success" for i in range(TASKS)}, cluster.tail()

        node_host = {node: host for node, (host, _) in ledger.node_hosts().items()}
        held: dict[str, list[tuple[float, int]]] = {h: [] for h in HOSTS}
        tries = [a for a in ledger.history(since - 5) if a.key.startswith("airflow/pf_burst/")]
        assert len(tries) == TASKS  # one try each: nothing was sent twice
        for alloc in tries:
            host = node_host[alloc.shares[0].node]
            held[host] += [(alloc.created_at, 1), (alloc.released_at or time.time(), -1)]
        allocated = {host: most_at_once(spans) for host, spans in held.items()}
        # Prefetched: some host held more tries than it has slots, never more than slots + 1 × slots.
        assert max(allocated.values()) > SLOTS, allocated
        assert all(peak <= 2 * SLOTS for peak in allocated.values()), allocated

        ran: dict[str, list[tuple[float, int]]] = {h: [] for h in HOSTS}
        for i in range(TASKS):
            seen = json.loads((cluster.out / f"p{i}.json").read_text())
            ran[seen["host"]] += [(seen["started"], 1), (seen["ended"], -1)]
        bodies = {host: most_at_once(spans) for host, spans in ran.items()}
        assert all(peak <= SLOTS for peak in bodies.values()), bodies  # a prefetched try waited for its slot
        assert audit(ledger) == []
