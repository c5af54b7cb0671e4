"""The agent against the simulated backend and a real SQLite ledger: faults → cordons, leaks → stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from gpusched.cli import main
from gpusched.failures import pending_failures
from gpusched.hardware.simulated import SimulatedBackend
from gpusched.ledger import Ledger
from gpusched.model import DeviceSample, DeviceShare, Health
from gpusched.remediation import PidRegistry, PidStopper
from gpusched.request import GPURequest
from gpusched.telemetry import TelemetryAgent, sample_once

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
