"""The agent against the simulated backend and a real SQLite ledger: faults → cordons, leaks → stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpusched.agent.telemetry import TelemetryAgent, sample_once
from gpusched.cli import main
from gpusched.faults.failures import pending_failures
from gpusched.faults.stopping import PidRegistry, PidStopper
from gpusched.hardware.simulated import SimulatedBackend
from gpusched.ledger import Ledger
from gpusched.model import DeviceSample, DeviceShare, Health
from gpusched.request import GPURequest

GIB = 2**30


def test_agent_once_cordons_devices_with_injected_faults(capsys: object) -> None:
    backend = SimulatedBackend()
    xid_dev, ecc_dev, ok_dev = (d.uuid for d in backend.discover()[0].devices[:3])
    backend.inject_fault(xid_dev, "xid", code=79)
    backend.inject_fault(ecc_dev, "ecc")
    assert main(["agent", "--once", "--backend", "simulated"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert f"{xid_dev}: cordoned (xid_hardware)" in out and f"{ecc_dev}: cordoned (ecc_uncorrected)" in out
    with Ledger() as ledger:
        snapshot = ledger.snapshot()
        for uuid in (xid_dev, ecc_dev):
            assert snapshot.device(uuid).health is Health.UNHEALTHY
            assert snapshot.device(uuid).cordoned
        assert not snapshot.device(ok_dev).cordoned and snapshot.device(ok_dev).health is Health.HEALTHY
        cordons = {e.subject: e.detail["reason"] for e in ledger.events(50, kinds=["cordon"])}
        assert "Xid 79" in cordons[xid_dev] and "uncorrectable ECC" in cordons[ecc_dev]
        assert len(ledger.samples(None, 0)) == snapshot.total_devices() - 8  # standby node is off
    # A second cycle changes nothing: the actions are already in effect.
    assert main(["agent", "--once", "--backend", "simulated"]) == 0
    assert "0 action(s)" in capsys.readouterr().out  # type: ignore[attr-defined]


def test_memory_leak_stops_the_task_process_holding_the_device() -> None:
    backend = SimulatedBackend()
    device = backend.discover()[0].devices[0]
    now = time.time()
    with Ledger() as ledger:
        ledger.migrate()
        ledger.sync_inventory(backend.discover(), source="simulated")
        key = "airflow/train/step/-1/1/manual__2026"
        share = DeviceShare(device.uuid, device.node, device.index, 1000, device.memory_bytes)
        ledger.allocate(key, GPURequest.build(gpus=1), [share], holder="test", now=now - 300)
        # The last two minutes: +300 MB/min, sampled every 10 s; the live sample continues the trend.
        base = 20 * GIB
        history = [
            DeviceSample(device.uuid, now - 120 + 10 * i, 95, base + i * 50_000_000, device.memory_bytes,
                         60_000, 500_000)
            for i in range(12)
        ]
        ledger.record_samples(history)
        backend.set_load(device.uuid, 95, base + 12 * 50_000_000)
        task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            PidRegistry().register(key, task.pid)
            agent = TelemetryAgent(backend, ledger, stopper=PidStopper())
            result = agent.cycle(now)
            assert [(a.kind.value, a.target) for a in result.actions] == [("stop_task", key)]
            assert task.wait(timeout=10) == -signal.SIGTERM
            assert any("task stopped" in line for line in result.applied)
            alert = ledger.events(5, kinds=["alert"])[0]
            assert alert.subject == key and alert.detail["action"] == "stop_task"
            # The killed task cannot report its failure: the agent records it for the fault chain,
            # which classifies a leak as the program's bug (no retry).
            failed = ledger.events(5, kinds=["task_failed"])[0]
            assert failed.subject == key and failed.detail["devices"] == [device.uuid]
            assert "MB/min" in failed.detail["log_tail"]
            handled = ledger.events(5, kinds=["failure_handled"])[0]
            assert handled.subject == key and handled.detail["failure_kind"] == "code_error"
            assert handled.detail["retry"] is False and pending_failures(ledger) == []
            metrics = agent.metrics_text()
            assert 'gpusched_alert_actions_total{action="stop_task",rule="memory_growth"} 1.0' in metrics
            assert f'UUID="{device.uuid}"' in metrics
            # The next cycle does not try again (the stop is done once per allocation).
            assert agent.cycle(now + 10).actions == ()
        finally:
            task.kill()
            task.wait()


def test_sample_once_stores_one_reading_per_powered_device() -> None:
    backend = SimulatedBackend()
    with Ledger() as ledger:
        ledger.migrate()
        samples = sample_once(backend, ledger)
        stored = ledger.samples(None, 0)
    assert {s.uuid for s in stored} == {s.uuid for s in samples} and len(stored) == len(samples) > 0


def test_pid_registry_never_signals_a_dead_or_recycled_process() -> None:
    registry = PidRegistry()
    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    registry.register("k", task.pid)
    assert registry.pid_of("k") == task.pid and registry.pid_of("other") is None
    task.kill()
    task.wait()
    assert registry.pid_of("k") is None  # the process is gone: nothing to signal
    assert PidStopper(registry)("k", "leak") is False


def test_pid_stopper_kills_a_task_that_ignores_sigterm() -> None:
    registry = PidRegistry()
    stubborn = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: None); "
        "print('ready', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
        registry.register("k", stubborn.pid)
        assert PidStopper(registry, grace_s=0.5)("k", "leak") is True
        assert stubborn.wait(timeout=10) == -signal.SIGKILL  # SIGTERM ignored, then killed
    finally:
        stubborn.kill()
        stubborn.wait()


def test_simulated_devices_held_by_tasks_look_busy_and_idle_again_after_release() -> None:
    """Before: every simulated sample read 0 % utilisation, so the fleet page's bars stayed empty."""
    backend = SimulatedBackend()
    whole, half = backend.discover()[0].devices[:2]
    now = time.time()
    with Ledger() as ledger:
        ledger.migrate()
        ledger.sync_inventory(backend.discover(), source="simulated")
        ledger.allocate("job-whole", GPURequest.build(gpus=1),
                        [DeviceShare(whole.uuid, whole.node, whole.index, 1000, whole.memory_bytes)],
                        holder="test", now=now)
        ledger.allocate("job-half", GPURequest.build(gpus=0.5, memory=8 * GIB),
                        [DeviceShare(half.uuid, half.node, half.index, 500, 8 * GIB)], holder="test", now=now)
        agent = TelemetryAgent(backend, ledger)
        readings = {s.uuid: s for s in agent.cycle(now).samples}
        assert 80 <= readings[whole.uuid].utilization_pct <= 90
        assert readings[whole.uuid].memory_used_bytes == int(whole.memory_bytes * 0.9)
        assert 38 <= readings[half.uuid].utilization_pct <= 46
        assert readings[half.uuid].memory_used_bytes == int(8 * GIB * 0.9)
        idle = [s for u, s in readings.items() if u not in (whole.uuid, half.uuid)]
        assert idle and all(s.utilization_pct == 0 for s in idle)
        ledger.release("job-whole", reason="done")
        readings = {s.uuid: s for s in agent.cycle(now + 10).samples}
        assert readings[whole.uuid].utilization_pct == 0


def test_tasks_waiting_for_standby_capacity_switch_the_node_on_in_the_agent_cycle() -> None:
    """Before: tasks waiting for 8 H100s showed '8 on standby nodes' and nothing switched it on."""
    from gpusched.capacity.scaling import LocalFleetScaler

    backend = SimulatedBackend()
    h100 = next(n for n in backend.discover() if n.name == "a-h100-1")
    now = time.time()
    with Ledger() as ledger:
        ledger.migrate()
        ledger.sync_inventory(backend.discover(), source="simulated")
        ledger.allocate("busy", GPURequest.build(gpus=8, model="H100-SXM-80GB"),
                        [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in h100.devices],
                        holder="test", now=now - 3600, lease_s=10**7)
        want = GPURequest.build(gpus=8, model="H100-SXM-80GB", interconnect="same_node")
        ledger.record_queue("airflow/train/fit/-1/1/manual__1", want, "8 on standby nodes", now - 200)
        agent = TelemetryAgent(backend, ledger, scale_after_s=300.0)
        assert agent.cycle(now).applied == ()  # 200 s < 300 s: not yet
        assert "a-h100-2" not in LocalFleetScaler().state()["active_standby"]
        result = agent.cycle(now + 120)
        assert any("standby node a-h100-2" in line and "waited 5 min" in line for line in result.applied)
        assert LocalFleetScaler().state()["active_standby"] == ["a-h100-2"]
        assert not ledger.snapshot(now + 120).node("a-h100-2").standby  # usable at once
        event = ledger.events(5, kinds=["scale_out_reactive"])[0]
        assert event.subject == "a-h100-2" and "airflow/train/fit" in event.detail["reason"]
        assert agent.cycle(now + 130).applied == ()  # fits now: nothing more to switch on


def test_a_gang_waiting_for_the_standby_node_switches_it_on_and_then_starts() -> None:
    """Before: every member of the example gang fits a-h100-1 by itself, so the agent never
    switched a-h100-2 on and the gang could never run on the default fleet."""
    from gpusched.capacity.scaling import LocalFleetScaler
    from gpusched.gang import GangMember
    from gpusched.ledger.queue import GangQueueEntry
    from gpusched.placement import Policy
    from gpusched.quota.policy import QuotaState
    from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide

    backend = SimulatedBackend()
    now = time.time()
    want = GPURequest.build(gpus=8, model="H100-SXM-80GB", interconnect="same_node")
    members = [PendingWork(f"airflow/pretrain__node{r}", want, now - 400,
                           gang=GangMember("d/r/-1/pretrain", 2, r)) for r in range(2)]
    with Ledger() as ledger:
        ledger.migrate()
        ledger.sync_inventory(backend.discover(), source="simulated")
        for hold in decide(CycleRequest(tuple(members), ledger.snapshot(now), Policy.named("gpusched"), (),
                                        now, QuotaState.unlimited())).holds:
            assert not hold.permanent and "standby node a-h100-2 would make all 2 fit" in hold.reason
            member = next(m for m in members if m.key == hold.key)
            ledger.record_queue(hold.key, want, hold.reason, now - 400, gang=member.gang)
        queued = ledger.queue()
        assert [type(q) for q in queued] == [GangQueueEntry, GangQueueEntry]
        assert {q.gang for q in queued if isinstance(q, GangQueueEntry)} == {m.gang for m in members}
        result = TelemetryAgent(backend, ledger, scale_after_s=300.0).cycle(now)
        assert any("multi-node gang pretrain" in line and "standby node a-h100-2" in line
                   for line in result.applied), result.applied
        assert LocalFleetScaler().state()["active_standby"] == ["a-h100-2"]
        reply = decide(CycleRequest(tuple(members), ledger.snapshot(now), Policy.named("gpusched"), (), now,
                                    QuotaState.unlimited()))
        assert sorted(launch.shares[0].node for launch in reply.launches) == ["a-h100-1", "a-h100-2"]


def test_an_idle_standby_node_goes_back_to_standby_after_the_cool_down() -> None:
    """Before: the agent only ever switched standby nodes on; a-h100-2 stayed on (and paid for)
    long after the task that needed it had finished."""
    from gpusched.capacity.scaling import LocalFleetScaler

    backend = SimulatedBackend()
    h100 = next(n for n in backend.discover() if n.name == "a-h100-1")
    now = time.time()
    key = "airflow/train/fit/-1/1/manual__1"
    want = GPURequest.build(gpus=8, model="H100-SXM-80GB", interconnect="same_node")
    with Ledger() as ledger:
        ledger.migrate()
        ledger.sync_inventory(backend.discover(), source="simulated")
        ledger.allocate("busy", want, [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes)
                                       for d in h100.devices], holder="test", now=now - 3600, lease_s=10**7)
        ledger.record_queue(key, want, "8 on standby nodes", now - 400)
        agent = TelemetryAgent(backend, ledger, scale_after_s=300.0, release_after_s=1800.0)
        agent.cycle(now)
        assert LocalFleetScaler().state()["active_standby"] == ["a-h100-2"]
        standby = ledger.snapshot(now).node("a-h100-2")
        ledger.clear_queue(key)  # the executor places the task on the node switched on for it
        ledger.allocate(key, want, [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes)
                                    for d in standby.devices], holder="test", now=now + 10, lease_s=10**7,
                        queued_at=now - 400)
        assert agent.cycle(now + 1900).applied == ()  # busy: the task still runs there
        ledger.release(key, reason="success", now=now + 2000)
        # A second task waits for those H100s: the node stays on although idle past the cool-down.
        ledger.record_queue("airflow/train/fit/-1/1/manual__2", want, "placing", now + 3800)
        assert agent.cycle(now + 3850).applied == ()
        ledger.clear_queue("airflow/train/fit/-1/1/manual__2")
        assert agent.cycle(now + 2000 + 1700).applied == ()  # idle 1,700 s < 1,800 s
        result = agent.cycle(now + 2000 + 1800)
        assert result.applied == ("standby node a-h100-2 idle 30 min (cool-down 30 min); back to standby",)
        assert LocalFleetScaler().state()["active_standby"] == []
        assert ledger.snapshot(now + 3800).node("a-h100-2").standby  # takes no work any more
        event = ledger.events(5, kinds=["scale_in"])[0]
        assert event.subject == "a-h100-2" and event.detail["provider"] == "local"
        assert agent.cycle(now + 4000).applied == ()  # nothing left to release


def test_a_command_scaler_is_told_which_nodes_to_release(tmp_path: Path) -> None:
    """Scale-in through an operator's command: it gets the nodes on stdin, the ledger says so."""
    from gpusched.capacity.scaling import CommandScaler, ScalingPlan, record_plan, release_idle, switched_on

    backend = SimulatedBackend()
    out = tmp_path / "calls.jsonl"
    code = (f"import sys, pathlib; p = pathlib.Path({str(out)!r}); "
            "p.write_text((p.read_text() if p.exists() else '') + sys.stdin.read() + '\\n')")
    scaler = CommandScaler([sys.executable, "-c", code])
    now = time.time()
    with Ledger() as ledger:
        ledger.migrate()
        ledger.sync_inventory(backend.discover(), source="simulated")
        plan = ScalingPlan(created_at=now - 7200, provisioning_delay_s=0, active_gpus=0, target_gpus=0,
                           activate=("a-h100-1",), surplus_gpus=0, burst_reserve_gpus=0, steps=(),
                           model="ets", reason="test")
        record_plan(ledger, plan, scaler.apply(plan))
        assert switched_on(ledger, scaler) == {"a-h100-1": now - 7200}
        assert release_idle(ledger, cool_down_s=1800.0, scaler=scaler, now=now).release == ("a-h100-1",)
        calls = [json.loads(line) for line in out.read_text().splitlines() if line]
        assert [c["action"] for c in calls] == ["activate", "release"]
        assert calls[1]["release"] == ["a-h100-1"] and "idle 31 min" in calls[1]["reason"]
        assert switched_on(ledger, scaler) == {}
