"""The fault chain on a real SQLite ledger: records, overrides, remedies, the recovery sweep, and an
end-to-end Xid fault on the simulated fleet with real task and agent processes."""

from __future__ import annotations

import pytest
from _placement_support import no_quota

from gpusched.faults.failures import (
    FailureRecord,
    clear_override,
    load_overrides,
    mark_handled,
    pending_failures,
    record_failure,
    set_override,
)
from gpusched.faults.remediation import handle_failure
from gpusched.hardware.simulated import SimulatedBackend
from gpusched.ledger import Ledger
from gpusched.model import Health
from gpusched.request import GPURequest

GIB = 2**30
OOM_LOG = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total "
           "capacity of 44.39 GiB of which 1.02 GiB is free.\n")
XID_LOG = ("NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.\n"
           "RuntimeError: CUDA error: unspecified launch failure\n")


@pytest.fixture
def ledger() -> Ledger:
    ledger = Ledger()
    ledger.migrate()
    ledger.sync_inventory(SimulatedBackend().discover(), source="simulated")
    return ledger


def _record(key: str, devices: tuple[str, ...], log: str, request: GPURequest, **kw: object) -> FailureRecord:
    return FailureRecord(key=key, devices=devices, log_tail=log, at=1000.0, dag_id="train", task_id="fit",
                         run_id="r1", try_number=1, request=request, **kw)  # type: ignore[arg-type]


def test_failures_are_pending_until_handled(ledger: Ledger) -> None:
    request = GPURequest.build(gpus=1)
    first = _record("airflow/train/fit/-1/1/r1", ("GPU-x",), XID_LOG, request, will_retry=True)
    record_failure(ledger, first)
    record_failure(ledger, _record("airflow/train/fit/-1/2/r1", ("GPU-y",), OOM_LOG, request))
    pending = pending_failures(ledger)
    assert [p.key for p in pending] == ["airflow/train/fit/-1/1/r1", "airflow/train/fit/-1/2/r1"]
    assert pending[0] == first  # round-trips through the event detail
    mark_handled(ledger, first.key, failure_kind="hardware")
    assert [p.key for p in pending_failures(ledger)] == ["airflow/train/fit/-1/2/r1"]


def test_overrides_are_scoped_newest_first_and_clearable(ledger: Ledger) -> None:
    small, big = GPURequest.build(gpus=1, memory="20GiB"), GPURequest.build(gpus=1, memory="60GiB")
    set_override(ledger, "train", "fit", small, reason="task-wide")
    set_override(ledger, "train", "fit", big, reason="oom", run_id="r1")
    table = load_overrides(ledger)
    assert table.lookup("train", "fit", "r1") == big and table.reason("train", "fit", "r1") == "oom"
    assert table.lookup("train", "fit", "r2") == small
    assert table.lookup("train", "other", "r1") is None
    clear_override(ledger, "train", "fit")
    assert load_overrides(ledger).lookup("train", "fit", "r1") is None


def test_hardware_failure_cordons_and_marks_the_device(ledger: Ledger) -> None:
    device = ledger.snapshot().node("a-h100-1").devices[2].uuid
    record = _record("airflow/train/fit/-1/1/r1", (device,), XID_LOG, GPURequest.build(gpus=1))
    handled = handle_failure(ledger, record)
    assert str(handled.classification.kind) == "hardware" and handled.remedy.retry
    snapshot = ledger.snapshot()
    assert snapshot.device(device).cordoned and snapshot.device(device).health is Health.UNHEALTHY
    assert pending_failures(ledger) == [] or record.key not in {p.key for p in pending_failures(ledger)}
    done = ledger.events(5, kinds=["failure_handled"])[0]
    assert done.subject == record.key and done.detail["failure_kind"] == "hardware"
    assert done.detail["evidence"][0].startswith("NVRM: Xid")


def test_oom_writes_an_override_the_executor_places_on_a_bigger_device(ledger: Ledger) -> None:
    from gpusched.placement import Policy
    from gpusched.quota.policy import QuotaState
    from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide

    snapshot = ledger.snapshot()
    l40s = snapshot.node("a-l40s-1").devices[0]
    request = GPURequest.build(gpus=1, model="L40S")
    handle_failure(ledger, _record("airflow/train/fit/-1/1/r1", (l40s.uuid,), OOM_LOG, request))
    override = load_overrides(ledger).lookup("train", "fit", "r1")
    assert override is not None and override.memory_per_gpu >= l40s.memory_bytes + 4 * GIB
    decision = decide(CycleRequest((PendingWork("airflow/train/fit/-1/2/r1", override, 0.0),),
                                   ledger.snapshot(), Policy.named("gpusched"), (), 0.0,
                                   QuotaState.unlimited()))
    placed = ledger.snapshot().device(decision.launches[0].shares[0].uuid)
    assert placed.model != "L40S" and placed.memory_bytes >= override.memory_per_gpu
    assert not ledger.snapshot().device(l40s.uuid).cordoned  # an OOM is not the device's fault


def test_recovery_sweep_handles_leftovers_and_reports_an_unreachable_api(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpusched.airflow.recovery_task import RETRY_REQUESTED, run_recovery

    monkeypatch.setenv("GPUSCHED_AIRFLOW_API_URL", "http://127.0.0.1:9")  # nothing listens there
    device = ledger.snapshot().node("a-a100-1").devices[0].uuid
    request = GPURequest.build(gpus=1)
    xid = _record("airflow/train/fit/-1/3/r1", (device,), XID_LOG, request, will_retry=False)
    record_failure(ledger, xid)
    record_failure(ledger, _record("airflow/train/eval/-1/1/r1", (device,), "KeyError: 'x'\n", request))
    summary = run_recovery(ledger)
    assert [(h["key"], h["kind"]) for h in summary["handled"]] == [
        ("airflow/train/fit/-1/3/r1", "hardware"), ("airflow/train/eval/-1/1/r1", "code_error"),
    ]
    assert len(summary["errors"]) == 1 and "unreachable" in summary["errors"][0]  # the clear failed
    assert ledger.events(5, kinds=[RETRY_REQUESTED]) == []  # so the next sweep tries again
    assert pending_failures(ledger) == []


@pytest.mark.slow
def test_xid_fault_end_to_end_retry_lands_on_a_healthy_gpu() -> None:
    from gpusched.bench.recovery import run_trial

    trial = run_trial(with_chain=True, agent_interval_s=1.0, executor_tick_s=0.5)
    assert trial.classification == "hardware"
    assert trial.retry_device is not None and trial.retry_device != trial.faulty_device
    assert trial.retry_device_healthy and trial.recovered_s is not None and trial.cordoned_s is not None
    with Ledger() as ledger:
        assert ledger.snapshot().device(trial.faulty_device).cordoned


def test_recovery_dag_parses_with_light_top_level_imports() -> None:
    import ast
    from pathlib import Path

    from airflow.dag_processing.dagbag import DagBag

    path = Path(__file__).resolve().parents[2] / "dags" / "fault_recovery.py"
    top = {n.module for n in ast.parse(path.read_text()).body if isinstance(n, ast.ImportFrom)}
    assert top <= {"__future__", "datetime", "airflow.sdk"}  # heavy work only inside the task
    bag = DagBag(dag_folder=str(path))
    assert bag.import_errors == {}
    dag = bag.dags.get("gpusched_fault_recovery")
    assert dag is not None and [t.task_id for t in dag.tasks] == ["recover"]


def test_a_code_error_with_airflow_retries_left_refuses_the_next_try(ledger: Ledger) -> None:
    device = ledger.snapshot().node("a-h100-1").devices[0].uuid
    record = _record("airflow/train/fit/-1/1/r1", (device,), "KeyError: 'lr'\n", GPURequest.build(gpus=1),
                     will_retry=True)
    handled = handle_failure(ledger, record)
    assert not handled.remedy.retry
    table = load_overrides(ledger)
    assert "code error" in (table.refusal("train", "fit", "r1", 2) or "")
    assert table.refusal("train", "fit", "r1", 3) is None  # a later manual clear runs normally
    assert table.refusal("train", "fit", "r2", 2) is None


def test_shortage_scales_out_a_standby_node_the_simulated_fleet_then_offers(ledger: Ledger) -> None:
    from gpusched.placement import PendingTask, Policy, place

    node = ledger.snapshot().node("a-h100-1")
    request = GPURequest.build(gpus=8, models=["H100-SXM-80GB"], interconnect="island")
    record = _record("airflow/train/fit/-1/1/r1", tuple(d.uuid for d in node.devices), XID_LOG, request)
    handled = handle_failure(ledger, record)
    assert handled.remedy.retry and handled.remedy.activate == ("a-h100-2",)
    (event,) = ledger.events(5, kinds=["scale_out_request"])
    assert "activated a-h100-2" in str(event.detail["scaler"])

    # The simulated fleet "provisions" the node; the next inventory sync makes it schedulable.
    backend = SimulatedBackend()
    assert not next(n for n in backend.discover() if n.name == "a-h100-2").standby
    ledger.sync_inventory(backend.discover(), source="simulated")
    plan = place(no_quota([PendingTask("retry", request, 1.0)],
        ledger.snapshot(), Policy.named("gpusched"), now=2.0))
    (assignment,) = plan.assignments
    assert {s.node for s in assignment.shares} == {"a-h100-2"}
