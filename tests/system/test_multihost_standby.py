"""Capacity as an action of the scheduler, end to end on the multi-host Celery deployment.

Real processes (``gpusched.deploy.multihost_cluster.LocalCluster``: Redis, PostgreSQL, the
GPUCeleryExecutor's scheduler, per GPU host a Celery worker on ``gpusched@<host>`` and a
``gpusched agent``). The fleet has two live hosts (``host-a``: 2 A100, ``host-b``: 2 L40S) and a
standby one (``host-h100``: 2 H100, ``standby: true``), declared standby in the ledger
(``gpusched agent --host-name host-h100 --standby``) and powered off: neither its worker nor its
agent runs. ``GPUSCHED_SCALER`` is a command this test writes, standing in for an operator's
IPMI / Redfish / cloud call: it logs each call and hands the request to the cluster's stand-in
power controller (:meth:`LocalCluster.serve_power_requests`), which starts or stops the host's
worker and agent.

Shows: a task that needs two H100s waits with a reason naming the standby host's node; the
scaler command runs once with that node (the other agents, deciding the same, call nothing, and
nothing asks again while the host boots); the host's agent registers it live, the task is sent to
``gpusched@host-h100``, runs there and succeeds; once the host has been idle past
``GPUSCHED_SCALE_IN_AFTER_S`` the release runs once, the host's worker and agent stop, the host is
``standby`` again (never judged lost: no quarantine, no ``node_lost``), and its node is a standby
node of the snapshot again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import wait_on_cluster
from _ledger_support import assert_whole_devices_never_shared

from gpusched.deploy.multihost_cluster import LocalCluster
from gpusched.ledger import Ledger
from gpusched.ledger.hosts import LAUNCH_EVENT
from gpusched.scheduler.keys import ti_key

pytestmark = [pytest.mark.multihost, pytest.mark.airflow, pytest.mark.slow]

HOSTS = ("host-a", "host-b", "host-h100")
STANDBY = "host-h100"
SCALE_IN_AFTER_S = 20
FLEET = """
name: standby-multihost
racks:
  - name: r1
    nodes:
      - name: host-a
        cpu: 32
        memory: 256GiB
        devices: {model: A100-SXM-80GB, count: 2}
      - name: host-b
        cpu: 32
        memory: 256GiB
        devices: {model: L40S, count: 2}
      - name: host-h100
        standby: true
        cpu: 64
        memory: 512GiB
        devices: {model: H100-SXM-80GB, count: 2}
"""
DAG_SOURCE = '''
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from airflow.sdk import dag, get_current_context, task

from gpusched.airflow.authoring import gpu

OUT = Path(os.environ["GPUSCHED_TEST_OUT"])


@dag(dag_id="mh_standby", schedule=None, start_date=datetime(2026, 1, 1), catchup=False)
def mh_standby():
    @task(task_id="on_h100", **gpu(gpus=2, models=["H100-SXM-80GB"]))
    def on_h100() -> None:
        ti = get_current_context()["ti"]
        seen = {k: os.environ.get(k) for k in ("GPUSCHED_HOST", "CUDA_VISIBLE_DEVICES")}
        (OUT / f"on_h100-{ti.try_number}.json").write_text(json.dumps(seen))

    on_h100()


mh_standby()
'''
# The operator's scaler command: log the call (with the agent that made it), hand the request to
# the machines' power controller (here: the cluster's folder), answer at once (power-on is
# asynchronous: the host registers when it has booted).
SCALER = '''
import json, os, sys, time
from pathlib import Path

base = Path(sys.argv[1])
payload = json.loads(sys.stdin.read())
record = {"payload": payload, "by": os.environ.get("GPUSCHED_HOST"), "at": time.time()}
with (base / "calls.jsonl").open("a") as sink:
    sink.write(json.dumps(record) + "\\n")
request = base / "power" / f"{time.time_ns()}.json"
request.with_suffix(".tmp").write_text(json.dumps(payload))
request.with_suffix(".tmp").rename(request)
print(f"power {payload['action']} requested")
'''


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    base = tmp_path_factory.mktemp("standby")
    fleet = base / "fleet.yaml"
    fleet.write_text(FLEET)
    scaler = base / "scaler.py"
    scaler.write_text(SCALER)
    (base / "power").mkdir()
    env = {"GPUSCHED_SCALER": f"command:{sys.executable} {scaler} {base}",
           "GPUSCHED_SCALE_IN_AFTER_S": str(SCALE_IN_AFTER_S)}
    # The agents decide every 3 s; a task waiting 10 s for standby capacity switches it on.
    local = LocalCluster(base / "cluster", {"standby_dags.py": DAG_SOURCE}, hosts=HOSTS, fleet=fleet,
                         env=env, standby=(STANDBY,), agent_args=("--interval", "3", "--scale-after", "10"))
    try:
        local.start()
        local.serve_power_requests(base / "power")
        yield local
    finally:
        local.stop()


def _calls(cluster: LocalCluster) -> list[dict[str, Any]]:
    path = cluster.base.parent / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _waiting_reason(ledger: Ledger, key: str) -> str | None:
    return next((q.reason for q in ledger.queue() if q.key == key), None)


def _cli_hosts(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    done = subprocess.run([sys.executable, "-m", "gpusched.cli", "ledger", "--url", cluster.db_url, "hosts",
                           "--json"], capture_output=True, text=True, timeout=120, check=True)
    return {h["name"]: h for h in json.loads(done.stdout)}


def test_a_task_waiting_for_a_standby_host_switches_it_on_runs_there_and_the_idle_host_is_released(
        cluster: LocalCluster) -> None:
    wait_on_cluster(cluster, "scheduler and dag-processor to be healthy", cluster.healthy, 300, 2)
    with Ledger(cluster.db_url) as ledger:
        wait_on_cluster(cluster, "host-a and host-b live, host-h100 standby",
                        lambda: [h.state for h in ledger.hosts()] == ["live", "live", "standby"], 180)
        assert ledger.snapshot().node(STANDBY).standby
        assert not cluster.running(STANDBY)
        wait_on_cluster(cluster, "mh_standby to be parsed", lambda: cluster.api("GET", "/dags/mh_standby"),
                        180, 2)

        run_id = cluster.trigger("mh_standby")
        key = ti_key("mh_standby", "on_h100", run_id, 1)
        reason = wait_on_cluster(cluster, "the H100 task to wait", lambda: _waiting_reason(ledger, key),
                                 120, 0.5)
        assert f"standby node {STANDBY} would make it fit" in reason, reason

        wait_on_cluster(cluster, "the scaler command to be called", lambda: _calls(cluster), 120, 0.5)
        wait_on_cluster(cluster, f"{STANDBY} to register live",
                        lambda: (h := ledger.host(STANDBY)) is not None and h.state == "live", 180, 0.5)
        assert cluster.running(STANDBY)
        listed = _cli_hosts(cluster)[STANDBY]
        assert listed["state"] == "live" and time.time() - listed["last_heartbeat"] < 15, listed

        wait_on_cluster(cluster, "mh_standby to finish",
                        lambda: cluster.run_state("mh_standby", run_id) in ("success", "failed"), 240, 2)
        assert cluster.run_state("mh_standby", run_id) == "success", cluster.tail()
        (launch,) = ledger.events(5, kinds=[LAUNCH_EVENT], subject=key)
        assert launch.detail["host"] == STANDBY
        seen = json.loads((cluster.out / "on_h100-1.json").read_text())
        assert seen["GPUSCHED_HOST"] == STANDBY and seen["CUDA_VISIBLE_DEVICES"] == "0,1"
        allocation = ledger.get(key)
        assert allocation is not None and {s.node for s in allocation.shares} == {STANDBY}

        # One decision, one call: three agents ran the rule, several cycles passed while the host
        # booted, and only one activation was asked for.
        (activate,) = [c for c in _calls(cluster) if c["payload"]["action"] == "activate"]
        assert activate["payload"]["activate"] == [STANDBY]
        assert [e.subject for e in ledger.events(50, kinds=["scale_out_reactive"])] == [STANDBY]

        # Idle past the cool-down: released once, powered off, standby again (not lost).
        wait_on_cluster(cluster, f"{STANDBY} to be released and stopped",
                        lambda: (h := ledger.host(STANDBY)) is not None and h.state == "standby"
                        and not cluster.running(STANDBY), SCALE_IN_AFTER_S + 120, 1)
        released = [c for c in _calls(cluster) if c["payload"]["action"] == "release"]
        assert [c["payload"]["release"] for c in released] == [[STANDBY]], released
        assert [e.subject for e in ledger.events(50, kinds=["scale_in"])] == [STANDBY]
        # Past the host timeout (10 s) with its agent silent: still standby, never judged lost.
        time.sleep(15)
        host = ledger.host(STANDBY)
        assert host is not None and host.state == "standby", host
        states = [e.detail.get("state") for e in ledger.events(200, kinds=["host"], subject=STANDBY)]
        assert "lost" not in states and "unconfirmed" not in states, states
        assert not ledger.events(50, kinds=["node_lost"])
        assert not ledger.quarantined(STANDBY)
        assert ledger.snapshot().node(STANDBY).standby
        assert [c["payload"]["action"] for c in _calls(cluster)] == ["activate", "release"]
        assert not (Path(cluster.logs) / "power.log").read_text().count("Error"), cluster.tail()
        assert ledger.active() == []
        # The ledger's whole history: no device had two holders at any instant.
        assert_whole_devices_never_shared(ledger.history(0, time.time() + 1))
