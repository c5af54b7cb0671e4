"""Fault-recovery benchmark at the executor/ledger level, on the simulated fleet, with real processes.

One trial:

1. A GPU task (a real Python process) is placed by the executor's decision function
   (:func:`gpusched.scheduler.cycle.decide` with the ``gpusched`` policy), allocated in the
   ledger (SQLite) and started with the executor's device environment. It reads its device
   through the simulated backend, like a CUDA program that hits a driver error on its next call.
2. At t0 an Xid 79 is injected on its device (:meth:`SimulatedBackend.inject_fault`).
3. The task dies with an NVRM Xid line and a CUDA error on stderr. The loop then does what the
   task-side fault listener does (:func:`gpusched.faults.failures.record_failure`,
   :func:`gpusched.faults.remediation.handle_failure`: classify → cordon → override) and what Airflow
   does on failure with retries left (release, wait ``retry_delay_s``, queue try 2).
4. Meanwhile a real ``gpusched agent`` process samples every ``agent_interval_s`` and cordons
   the device on its own when it sees the Xid first.
5. Try 2 is placed again by the same decision function and started; t1 is when it reports
   RUNNING on its device. The trial records t1 − t0 and whether that device is healthy.

Baseline (``with_chain=False``): no agent and no fault chain, only Airflow's retry — the retry is
placed on the fleet as the ledger sees it.

Not measured here: Airflow's own scheduling latency between a try failing and the next try being
queued (scheduler loop, ``retry_delay``) — ``retry_delay_s`` stands in for it.

:func:`main` is the command line (``scripts/bench_recovery.py [--trials 5] [--agent-interval 2]
[--executor-tick 1] [--retry-delay 0] [--out results/recovery/recovery.json]``): each trial in a fresh
AIRFLOW_HOME, once with the fault chain and once as the baseline (Airflow's plain retry).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusched.extras import lab_module
from gpusched.faults.failures import FailureRecord, load_overrides, record_failure
from gpusched.faults.remediation import handle_failure
from gpusched.hardware.simulated import SimulatedBackend
from gpusched.ledger import Ledger
from gpusched.model import Health
from gpusched.placement import Policy
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide, running_tasks
from gpusched.scheduler.keys import ti_key

__all__ = ["TASK_SCRIPT", "Trial", "run_trial"]

TASK_SCRIPT = r"""
import json, os, sys, time
from gpusched.hardware.simulated import SimulatedBackend
alloc = json.loads(os.environ["GPUSCHED_ALLOCATION"])
uuid = alloc["uuids"][0]
backend = SimulatedBackend(os.environ.get("GPUSCHED_FLEET") or None)
backend.set_load(uuid, 90, 30 * 2**30)
print(f"RUNNING {uuid} {time.time():.6f}", flush=True)
deadline = time.time() + float(os.environ.get("BENCH_TASK_SECONDS", "20"))
try:
    while time.time() < deadline:
        sample = next((s for s in backend.sample() if s.uuid == uuid), None)
        if sample is None or sample.xid_errors:
            code = sample.xid_errors[-1] if sample else 79
            print(f"NVRM: Xid (PCI:0000:{alloc['devices'][0]:02x}:00): {code}, pid={os.getpid()}, "
                  "name=python, GPU has fallen off the bus.", file=sys.stderr)
            print("RuntimeError: CUDA error: unspecified launch failure", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.1)
finally:
    backend.set_load(uuid, 0, 0)
"""


@dataclass(frozen=True, slots=True)
class Trial:
    """The outcome of one trial (times in seconds after the fault was injected)."""

    with_chain: bool
    faulty_device: str
    retry_device: str | None
    retry_device_healthy: bool
    task_failed_s: float | None
    cordoned_s: float | None
    recovered_s: float | None  # retry RUNNING on a healthy device
    classification: str
    cordoned_by: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _spawn(env: dict[str, str], task_seconds: float) -> subprocess.Popen[str]:
    child = dict(os.environ)
    child.update(env)
    child["BENCH_TASK_SECONDS"] = str(task_seconds)
    return subprocess.Popen([sys.executable, "-c", TASK_SCRIPT], env=child, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_running(proc: subprocess.Popen[str], timeout: float) -> tuple[str, float]:
    assert proc.stdout is not None
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("RUNNING "):
            _, uuid, stamp = line.split()
            return uuid, float(stamp)
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"task did not start: {proc.stderr.read() if proc.stderr else ''}")


def run_trial(
    *,
    with_chain: bool = True,
    agent_interval_s: float = 2.0,
    executor_tick_s: float = 1.0,
    retry_delay_s: float = 0.0,
    timeout_s: float = 120.0,
    progress: Callable[[str], None] = lambda _msg: None,
) -> Trial:
    """Run one trial in the current ``AIRFLOW_HOME`` (fresh state expected); see the module doc."""

    backend = SimulatedBackend()
    ledger = Ledger()
    ledger.migrate()
    ledger.sync_inventory(backend.discover(), source="simulated")
    policy = Policy.named("gpusched")
    request = GPURequest.build(gpus=1, vendor="nvidia", memory="40GiB")
    dag_id, task_id, run_id = "bench_recovery", "train", "manual__bench"
    agent = None
    if with_chain:
        agent = subprocess.Popen(
            [sys.executable, "-m", "gpusched.cli", "agent", "--backend", "simulated", "--port", "0",
             "--interval", str(agent_interval_s)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def launch(try_number: int) -> tuple[subprocess.Popen[str], str, str]:
        key = ti_key(dag_id, task_id, run_id, try_number)
        wanted = load_overrides(ledger).lookup(dag_id, task_id, run_id) or request
        while True:
            snapshot = ledger.snapshot()
            decision = decide(CycleRequest(
                (PendingWork(key, wanted, time.time()),), snapshot, policy,
                tuple(running_tasks(ledger.active())), time.time(), QuotaState.unlimited(), use_uuids=True,
            ))
            if decision.launches:
                chosen = decision.launches[0]
                ledger.allocate(key, chosen.request, chosen.shares, holder="bench")
                proc = _spawn(dict(chosen.env), timeout_s)
                return proc, key, chosen.shares[0].uuid
            progress(f"try {try_number} held: {decision.holds[0].reason}")
            time.sleep(executor_tick_s)

    procs: list[subprocess.Popen[str]] = []
    try:
        proc, key, device = launch(1)
        procs.append(proc)
        _wait_running(proc, 30)
        time.sleep(max(3 * agent_interval_s, 1.0))  # the agent has seen the healthy device
        t0 = time.time()
        backend.inject_fault(device, "xid", code=79)
        progress(f"Xid 79 injected on {device}")
        stderr = proc.communicate(timeout=timeout_s)[1]
        t_failed = time.time()
        classification, cordoned_by = "none", "nobody"
        if with_chain:
            before = ledger.snapshot().device(device).cordoned
            record = FailureRecord(key=key, devices=(device,), log_tail=stderr, at=t_failed, dag_id=dag_id,
                                   task_id=task_id, run_id=run_id, try_number=1, request=request,
                                   will_retry=True)
            record_failure(ledger, record)
            handled = handle_failure(ledger, record)
            classification = str(handled.classification.kind)
            cordoned_by = "agent" if before else "fault chain"
        ledger.release(key, reason="failed")
        time.sleep(retry_delay_s)
        time.sleep(executor_tick_s / 2)  # on average the failure lands mid-way between heartbeats
        retry, _, retry_device = launch(2)
        procs.append(retry)
        _, t_running = _wait_running(retry, 30)
        cordons = [e.at for e in ledger.events(200, kinds=["cordon"]) if e.subject == device]
        cordon_at = min(cordons) if cordons else None
        healthy = ledger.snapshot().device(retry_device).health is Health.HEALTHY and retry_device != device
        return Trial(
            with_chain, device, retry_device, healthy, t_failed - t0,
            None if cordon_at is None else max(0.0, cordon_at - t0),
            t_running - t0 if healthy else None, classification, cordoned_by,
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        backend.clear_faults()
        ledger.close()


def _trial(with_chain: bool, args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="gpusched-bench-") as home:
        os.environ["AIRFLOW_HOME"] = home
        os.environ.pop("GPUSCHED_DB_URL", None)
        trial = run_trial(with_chain=with_chain, agent_interval_s=args.agent_interval,
                          executor_tick_s=args.executor_tick, retry_delay_s=args.retry_delay)
    return trial.to_dict()


def main() -> int:
    """Run ``--trials`` trials with the fault chain and as the baseline; print the summary JSON."""

    parser = argparse.ArgumentParser(
        description="Fault-recovery benchmark: Xid 79 to the retried task running on a healthy GPU.")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--agent-interval", type=float, default=2.0, help="gpusched agent --interval")
    parser.add_argument("--executor-tick", type=float, default=1.0, help="executor heartbeat (s)")
    parser.add_argument("--retry-delay", type=float, default=0.0, help="the DAG's retry_delay (s)")
    parser.add_argument("--out", type=Path, default=None, help="write all trials as JSON here")
    args = parser.parse_args()
    results: dict[str, list[dict[str, object]]] = {"gpusched": [], "baseline": []}
    for _ in lab_module("tqdm").tqdm(range(args.trials), desc="fault-recovery trials", file=sys.stderr):
        results["gpusched"].append(_trial(True, args))
        results["baseline"].append(_trial(False, args))
    chain, base = results["gpusched"], results["baseline"]
    recovered = [float(t["recovered_s"]) for t in chain if t["recovered_s"] is not None]  # type: ignore[arg-type]
    cordoned = [float(t["cordoned_s"]) for t in chain if t["cordoned_s"] is not None]  # type: ignore[arg-type]
    base_ok = sum(1 for t in base if t["retry_device_healthy"])
    base_same = sum(1 for t in base if t["retry_device"] == t["faulty_device"])
    summary = {
        "trials": args.trials,
        "agent_interval_s": args.agent_interval, "executor_tick_s": args.executor_tick,
        "retry_delay_s": args.retry_delay,
        "gpusched_recovered": f"{len(recovered)}/{len(chain)}",
        "gpusched_fault_to_running_s": {
            "median": statistics.median(recovered) if recovered else None,
            "max": max(recovered) if recovered else None,
        },
        "gpusched_fault_to_cordon_s_median": statistics.median(cordoned) if cordoned else None,
        "cordoned_by": sorted({str(t["cordoned_by"]) for t in chain}),
        "baseline_retry_on_healthy_gpu": f"{base_ok}/{len(base)}",
        "baseline_retry_on_faulty_gpu": f"{base_same}/{len(base)}",
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "trials": results}, indent=2))
    return 0
