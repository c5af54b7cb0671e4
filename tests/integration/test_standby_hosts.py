"""Standby GPU hosts of a multi-host fleet and the standby rules' scaler calls, on a real ledger.

A standby host (declared, or released by the scale-in) shows as a standby node, is never judged
lost, is not woken by a late heartbeat, and is live again when its agent registers. Several agents
running the reactive rule over one ledger make one scaler call per decision, and none while the
host switched on is still booting; the release is one call too. The burst reserve the executors
keep is the last forecast plan's while it holds.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ledger_support import BACKENDS, database_url, lose_silent_hosts

from gpusched.capacity.scaling import (
    CommandScaler,
    ScalingPlan,
    ScalingResult,
    burst_reserve,
    react_to_waiting,
    record_plan,
    release_idle,
    switched_on,
)
from gpusched.errors import AllocationConflictError, ScalingError
from gpusched.hardware.detect import detect_backend
from gpusched.hardware.host_slice import HostSlice
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare
from gpusched.request import GPURequest

FLEET = """
name: standby
racks:
  - name: r1
    nodes:
      - name: host-a
        devices: {model: A100-SXM-80GB, count: 2}
      - name: host-h100
        standby: true
        devices: {model: H100-SXM-80GB, count: 2}
"""
KEY = "airflow/d/on_h100/-1/1/manual__1"
WANT = GPURequest.build(gpus=2, models=["H100-SXM-80GB"])


@pytest.fixture(params=BACKENDS)
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    for url in database_url(request.param, tmp_path):
        with Ledger(url) as led:
            led.migrate()
            yield led


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    return path


def _slice(fleet: Path, host: str) -> HostSlice:
    return HostSlice(detect_backend("simulated", fleet=fleet), host)


def _scaler(tmp_path: Path) -> tuple[CommandScaler, Path]:
    out = tmp_path / "calls.jsonl"
    code = (f"import sys, pathlib; p = pathlib.Path({str(out)!r}); "
            "p.write_text((p.read_text() if p.exists() else '') + sys.stdin.read() + '\\n')")
    return CommandScaler([sys.executable, "-c", code]), out


def _calls(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.read_text().splitlines() if line] if out.exists() else []


def test_a_standby_host_is_a_standby_node_never_lost_and_live_once_its_agent_registers(
        ledger: Ledger, fleet: Path) -> None:
    ledger.register_host("host-a", _slice(fleet, "host-a").discover(), stale_after_s=10, now=100.0)
    declared = ledger.standby_host("host-h100", _slice(fleet, "host-h100").discover(), reason="declared",
                                   now=100.0)
    assert declared is not None and declared.state == "standby" and len(declared.devices) == 2
    assert ledger.snapshot().node("host-h100").standby and not ledger.snapshot().node("host-a").standby
    # Silent for ever: the executors' lost-host rule leaves it alone.
    ledger.heartbeat_host("host-a", now=1000.0)
    assert lose_silent_hosts(ledger, 10, now=1001.0) == []
    # Switched on: its agent registers it (the fleet file's standby flag is the ledger's to say).
    assert ledger.register_host("host-h100", _slice(fleet, "host-h100").discover(), stale_after_s=10,
                                now=1002.0).state == "live"
    assert not ledger.snapshot().node("host-h100").standby
    # Released: standby again; a last heartbeat of its stopping agent does not wake it.
    host = ledger.standby_host("host-h100", reason="released by the scale-in", now=1010.0)
    assert host is not None and host.state == "standby"
    assert ledger.heartbeat_host("host-h100", now=1011.0) == "standby"
    assert ledger.snapshot().node("host-h100").standby
    assert "host-h100" not in lose_silent_hosts(ledger, 10, now=5000.0)
    states = [e.detail.get("state") for e in ledger.events(kinds=["host"], subject="host-h100")]
    assert states == ["standby", "switched_on", "standby"]  # newest first
    assert ledger.standby_host("host-z", reason="x") is None  # unknown, no devices: nothing declared


def test_agents_deciding_together_call_the_scaler_once_per_decision(
        ledger: Ledger, fleet: Path, tmp_path: Path) -> None:
    """Before: every host's agent ran the reactive rule, and each cycle asked again while the
    switched-on host booted: one waiting task made several power-on calls for the same node."""
    scaler, out = _scaler(tmp_path)
    now = time.time()
    ledger.register_host("host-a", _slice(fleet, "host-a").discover(), stale_after_s=10, now=now)
    ledger.standby_host("host-h100", _slice(fleet, "host-h100").discover(), reason="declared", now=now)
    ledger.record_queue(KEY, WANT, "waiting", now - 400)
    # Four agents decide at the same moment, each with its own ledger connection pool.
    url = ledger.engine.url.render_as_string(hide_password=False)
    barrier = threading.Barrier(4)
    decided: list[tuple[str, ...]] = []

    def agent() -> None:
        with Ledger(url) as own:
            barrier.wait()
            decided.append(react_to_waiting(own, threshold_s=300, scaler=scaler, now=now).activate)

    threads = [threading.Thread(target=agent) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(decided) == [(), (), (), ("host-h100",)]
    assert [c["activate"] for c in _calls(out)] == [["host-h100"]]
    # The host boots (still standby in the ledger): later cycles count it as coming, call nothing.
    for later in (10.0, 20.0, 30.0):
        assert react_to_waiting(ledger, threshold_s=300, scaler=scaler, now=now + later).activate == ()
    assert len(_calls(out)) == 1
    assert list(switched_on(ledger, scaler)) == ["host-h100"]

    # It registers, the task runs there and ends; idle past the cool-down, the release is one call too.
    node = ledger.register_host("host-h100", _slice(fleet, "host-h100").discover(), stale_after_s=10,
                                now=now + 40)
    assert node.state == "live"
    ledger.clear_queue(KEY)
    devices = ledger.snapshot(now + 41).node("host-h100").devices
    ledger.allocate(KEY, WANT, [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in devices],
                    holder="test", now=now + 41, lease_s=10**6)
    ledger.release(KEY, reason="success", now=now + 60)
    released = [release_idle(ledger, cool_down_s=30, scaler=scaler, now=now + 95).release for _ in range(3)]
    assert released == [("host-h100",), (), ()]
    assert [c["action"] for c in _calls(out)] == ["activate", "release"]
    host = ledger.host("host-h100")
    assert host is not None and host.state == "standby"
    assert ledger.snapshot(now + 96).node("host-h100").standby
    assert switched_on(ledger, scaler) == {}


def test_a_failed_scaler_call_lets_a_later_decision_ask_again(ledger: Ledger, fleet: Path) -> None:
    failing = CommandScaler([sys.executable, "-c", "import sys; sys.exit(3)"])
    now = time.time()
    ledger.register_host("host-a", _slice(fleet, "host-a").discover(), stale_after_s=10, now=now)
    ledger.standby_host("host-h100", _slice(fleet, "host-h100").discover(), reason="declared", now=now)
    ledger.record_queue(KEY, WANT, "waiting", now - 400)
    with pytest.raises(ScalingError):
        react_to_waiting(ledger, threshold_s=300, scaler=failing, now=now)
    assert switched_on(ledger, failing) == {}
    assert [e.subject for e in ledger.events(kinds=["scale_out_failed"])] == ["host-h100"]
    with pytest.raises(ScalingError):  # asked again (and failing again)
        react_to_waiting(ledger, threshold_s=300, scaler=failing, now=now + 5)


def test_the_executors_burst_reserve_is_the_last_forecast_plans_while_it_holds(ledger: Ledger) -> None:
    """What the executors' cycle puts in its quota state (gpu_inputs.read_cycle_request): the
    reserve of the last recorded forecast plan, until one hour past its provisioning delay."""
    assert burst_reserve(ledger, 1000.0) == 0  # no plan: no reserve
    plan = ScalingPlan(created_at=1000.0, provisioning_delay_s=900, active_gpus=8, target_gpus=8,
                       activate=(), surplus_gpus=0, burst_reserve_gpus=3, steps=(), model="ets",
                       reason="test")
    record_plan(ledger, plan, ScalingResult("command", True, (), 3, "ok"))
    assert burst_reserve(ledger, 1000.0) == 3
    assert burst_reserve(ledger, 1000.0 + 900 + 3599) == 3
    assert burst_reserve(ledger, 1000.0 + 900 + 3600) == 0  # the DAG stopped: no reserve left behind


def test_a_host_that_never_came_up_is_asked_for_once_more_after_twice_the_provisioning_delay(
        ledger: Ledger, fleet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a node switched on whose host never registered counted as coming for ever, and the
    task waited for it for ever."""
    monkeypatch.setenv("GPUSCHED_PROVISIONING_DELAY_S", "60")
    scaler, out = _scaler(tmp_path)
    now = time.time()
    ledger.register_host("host-a", _slice(fleet, "host-a").discover(), stale_after_s=10, now=now)
    ledger.standby_host("host-h100", _slice(fleet, "host-h100").discover(), reason="declared", now=now)
    ledger.record_queue(KEY, WANT, "waiting", now - 400)
    assert react_to_waiting(ledger, threshold_s=300, scaler=scaler, now=now).activate == ("host-h100",)
    assert react_to_waiting(ledger, threshold_s=300, scaler=scaler, now=now + 119).activate == ()
    # 120 s (twice the delay) and still standby: asked again, once, however many agents look.
    assert react_to_waiting(ledger, threshold_s=300, scaler=scaler, now=now + 120).activate == ("host-h100",)
    assert react_to_waiting(ledger, threshold_s=300, scaler=scaler, now=now + 121).activate == ()
    assert [c["activate"] for c in _calls(out)] == [["host-h100"], ["host-h100"]]
    failed = ledger.events(kinds=["scale_out_failed"], subject="host-h100")
    assert len(failed) == 1 and "still not up" in failed[0].detail["reason"]


def test_a_host_that_took_a_task_is_not_released_and_a_released_one_takes_none(
        ledger: Ledger, fleet: Path, tmp_path: Path) -> None:
    """The scale-in decides from a read; a task placed there between that read and the release
    keeps the host on, and once the host is standby an allocation there is refused."""
    scaler, _ = _scaler(tmp_path)
    now = time.time()
    ledger.register_host("host-a", _slice(fleet, "host-a").discover(), stale_after_s=10, now=now)
    ledger.standby_host("host-h100", _slice(fleet, "host-h100").discover(), reason="declared", now=now)
    ledger.record_queue(KEY, WANT, "waiting", now - 400)
    react_to_waiting(ledger, threshold_s=300, scaler=scaler, now=now)
    ledger.register_host("host-h100", _slice(fleet, "host-h100").discover(), stale_after_s=10, now=now + 5)
    ledger.clear_queue(KEY)
    devices = ledger.snapshot(now + 6).node("host-h100").devices
    shares = [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in devices]
    ledger.allocate(KEY, WANT, shares, holder="test", now=now + 6, lease_s=10**6)
    assert ledger.standby_host("host-h100", reason="released", now=now + 7) is None  # busy: kept on
    host = ledger.host("host-h100")
    assert host is not None and host.state == "live"
    ledger.release(KEY, reason="success", now=now + 8)
    assert release_idle(ledger, cool_down_s=30, scaler=scaler, now=now + 60).release == ("host-h100",)
    with pytest.raises(AllocationConflictError, match="standby"):
        ledger.allocate("late", WANT, shares, holder="test", now=now + 61)


def test_a_failed_release_keeps_the_host_in_service(ledger: Ledger, fleet: Path, tmp_path: Path) -> None:
    scaler, _ = _scaler(tmp_path)
    failing = CommandScaler([sys.executable, "-c", "import sys; sys.exit(3)"])
    now = time.time()
    ledger.register_host("host-a", _slice(fleet, "host-a").discover(), stale_after_s=10, now=now)
    ledger.standby_host("host-h100", _slice(fleet, "host-h100").discover(), reason="declared", now=now)
    ledger.record_queue(KEY, WANT, "waiting", now - 400)
    react_to_waiting(ledger, threshold_s=300, scaler=scaler, now=now)
    ledger.register_host("host-h100", _slice(fleet, "host-h100").discover(), stale_after_s=10, now=now + 5)
    ledger.clear_queue(KEY)
    with pytest.raises(ScalingError):
        release_idle(ledger, cool_down_s=30, scaler=failing, now=now + 60)
    host = ledger.host("host-h100")
    assert host is not None and host.state == "live"
    assert not ledger.snapshot(now + 61).node("host-h100").standby
    devices = ledger.snapshot(now + 61).node("host-h100").devices
    shares = [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in devices]
    ledger.allocate("after", WANT, shares, holder="test", now=now + 61)
    # Still switched on (idle again from the failure): released after another cool-down.
    assert list(switched_on(ledger, scaler)) == ["host-h100"]
