"""Quarantine: a lost host's tries keep their devices until its agent confirms they are gone.

Real ledgers (SQLite and PostgreSQL) and real processes: a quarantined allocation keeps its
devices out of the snapshot's free capacity while the same try is placed again elsewhere; the
agent's guard kills a leftover task process of it (and its process group) before it ends the
quarantine; the history replay counts the quarantined holder; an agent sees its Celery worker
running, stopped (SIGSTOP) and missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from _ledger_support import BACKENDS, database_url, lose_silent_hosts

from gpusched.agent.host_guard import confirm_quarantined, watch_worker
from gpusched.hardware.detect import detect_backend
from gpusched.hardware.host_slice import HostSlice
from gpusched.ledger import Ledger
from gpusched.ledger.audit import audit
from gpusched.ledger.hosts import HostState, WorkerState, WorkerStatus
from gpusched.ledger.liveness import current_process
from gpusched.model import DeviceShare
from gpusched.records import AllocationStatus, HolderProcess
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

FLEET = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets" / "multihost.yaml"
KEY = ti_key("dag", "train", "run", 1)
REQUEST = GPURequest(count=1)


@pytest.fixture(params=BACKENDS)
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    for url in database_url(request.param, tmp_path):
        with Ledger(url) as led:
            led.migrate()
            for host in ("host-a", "host-b"):
                led.register_host(host, HostSlice(detect_backend("simulated", fleet=FLEET), host).discover(),
                                  stale_after_s=10, now=100.0)
            yield led


def _share(ledger: Ledger, node: str) -> DeviceShare:
    device = next(d for n in ledger.snapshot().nodes if n.name == node for d in n.devices)
    return DeviceShare(device.uuid, node, device.index, 1000, 0)


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def test_a_quarantined_try_holds_its_devices_while_the_same_try_runs_elsewhere(ledger: Ledger) -> None:
    on_a = _share(ledger, "host-a")
    ledger.allocate(KEY, REQUEST, [on_a], holder="executor", now=101.0)
    fenced = ledger.quarantine(KEY, host="host-a", reason="node lost: test", now=102.0)
    assert fenced is not None and fenced.status == AllocationStatus.QUARANTINED
    assert fenced.holder == "fence@host-a"
    assert ledger.quarantine(KEY, host="host-a", reason="again", now=102.5) is None  # no active one left
    assert ledger.snapshot().usage[on_a.uuid].used_milli == 1000  # still held
    assert ledger.release(KEY, reason="executor", now=103.0) is None  # only the agent's confirmation ends it
    assert ledger.expire_leases(now=10**9) == []  # nor does a lease
    # the same try again, elsewhere
    ledger.allocate(KEY, REQUEST, [_share(ledger, "host-b")], holder="executor", now=104.0)
    assert ledger.get(KEY).status == AllocationStatus.ACTIVE  # type: ignore[union-attr]
    assert [a.key for a in ledger.quarantined("host-a")] == [KEY] and ledger.quarantined("host-b") == []
    with pytest.raises(Exception, match="has 0 milli-GPU"):  # the devices stay out of reach
        ledger.allocate(ti_key("dag", "other", "run", 1), REQUEST, [on_a], holder="executor", now=105.0)
    assert ledger.end_quarantine(KEY, host="host-a", reason="confirmed", now=106.0) == 1
    assert on_a.uuid not in ledger.snapshot().usage
    ledger.allocate(ti_key("dag", "other", "run", 1), REQUEST, [on_a], holder="executor", now=107.0)
    assert audit(ledger) == []


def test_the_replay_counts_a_quarantined_holder(ledger: Ledger) -> None:
    import sqlalchemy as sa

    from gpusched.ledger.schema import ALLOCATIONS

    on_a = _share(ledger, "host-a")
    ledger.allocate(KEY, REQUEST, [on_a], holder="executor", now=101.0)
    ledger.quarantine(KEY, host="host-a", reason="node lost: test", now=102.0)
    # Behind the ledger's back (the bug quarantine prevents): the row is marked released without
    # an event, so the ledger hands the device out again while the replay still sees it fenced.
    with ledger.engine.begin() as conn:
        conn.execute(sa.update(ALLOCATIONS).where(ALLOCATIONS.c.key == KEY).values(released_at=103.0))
    ledger.allocate(ti_key("dag", "other", "run", 1), REQUEST, [on_a], holder="executor", now=104.0)
    found = audit(ledger)
    assert len(found) == 1 and found[0].startswith(f"{on_a.uuid}: over-committed"), found


def test_the_agent_kills_a_leftover_try_before_it_frees_its_devices(ledger: Ledger) -> None:
    leftover = _sleeper()
    gone_already = _sleeper()
    gone_already.kill()
    gone_already.wait()
    try:
        on_a, on_b = _share(ledger, "host-a"), _share(ledger, "host-b")
        alive_key, dead_key = KEY, ti_key("dag", "eval", "run", 1)
        for key, proc, share in ((alive_key, leftover, on_a), (dead_key, gone_already, on_b)):
            ledger.allocate(key, REQUEST, [share], holder="executor", now=101.0)
            ledger.attach_process(key, HolderProcess("task", "host-a", proc.pid,
                                                     psutil.Process(leftover.pid).create_time()
                                                     if proc is leftover else 0.0))
            ledger.attach_process(key, current_process("executor"))  # another machine's: never judged
        ledger.quarantine(alive_key, host="host-a", reason="node lost", now=102.0)
        ledger.quarantine(dead_key, host="host-b", reason="node lost", now=102.0)

        kept = confirm_quarantined(ledger, "host-a", kill=False, now=103.0)
        assert kept == [f"{alive_key}: quarantined, task process(es) {leftover.pid} still running here"]
        assert leftover.poll() is None and ledger.quarantined("host-a")

        lines = confirm_quarantined(ledger, "host-a", now=104.0)
        assert lines == [f"{alive_key}: host host-a's agent confirmed try 1 stopped (killed task process "
                         f"{leftover.pid}); its devices are free"]
        assert leftover.wait(timeout=10) == -signal.SIGKILL
        assert ledger.quarantined("host-a") == [] and on_a.uuid not in ledger.snapshot().usage
        released = ledger.get(alive_key)
        assert released is not None and "agent confirmed try 1 stopped" in (released.release_reason or "")

        lines = confirm_quarantined(ledger, "host-b", now=105.0)  # nothing of it runs here
        assert lines == [f"{dead_key}: host host-b's agent confirmed try 1 stopped (no task process of it "
                         "runs here); its devices are free"]
        kinds = [e.kind for e in reversed(ledger.events(kinds=["quarantine", "unquarantine"]))]
        assert kinds == ["quarantine", "quarantine", "unquarantine", "unquarantine"]
        assert audit(ledger) == []
    finally:
        leftover.kill()


def test_a_heartbeat_with_the_worker_gone_keeps_a_lost_host_out(ledger: Ledger) -> None:
    assert lose_silent_hosts(ledger, 10, now=200.0) == ["host-a", "host-b"]
    missing, stopped = WorkerStatus(WorkerState.MISSING), WorkerStatus(WorkerState.STOPPED, 2)
    assert ledger.heartbeat_host("host-a", now=201.0, worker=missing) == HostState.LOST
    assert "host-a" not in {n.name for n in ledger.snapshot().nodes}
    running = WorkerStatus(WorkerState.RUNNING, 2)
    assert ledger.heartbeat_host("host-a", now=202.0, worker=running) == HostState.LIVE
    record = ledger.host("host-a")
    assert record is not None and (record.worker_state, record.worker_seen_at, record.worker_slots) == (
        "running", 202.0, 2)
    # A live host whose worker the agent sees stopped takes no new work at once (cordoned), though
    # the scheduler judges it lost only after the timeout.
    assert ledger.heartbeat_host("host-a", now=203.0, worker=stopped) == HostState.LIVE
    node = next(n for n in ledger.snapshot().nodes if n.name == "host-a")
    assert node.cordoned
    assert ledger.host("host-a").worker_seen_at == 202.0  # type: ignore[union-attr]


def test_the_agent_sees_its_worker_run_stop_and_go() -> None:
    fake = subprocess.Popen([sys.executable, "-c", "import time;time.sleep(120)", "celery", "worker",
                             "--queues", "gpusched@guard-host,default", "--concurrency", "3"])
    try:
        deadline = time.monotonic() + 10
        while watch_worker("guard-host").state != WorkerState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch_worker("guard-host") == WorkerStatus(WorkerState.RUNNING, 3)
        assert watch_worker("other-host").state == WorkerState.MISSING
        os.kill(fake.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while watch_worker("guard-host").state != WorkerState.STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch_worker("guard-host") == WorkerStatus(WorkerState.STOPPED, 3)
        os.kill(fake.pid, signal.SIGKILL)
        fake.wait(timeout=10)
        assert watch_worker("guard-host").state == WorkerState.MISSING
    finally:
        fake.kill()
