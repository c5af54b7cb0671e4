"""Failure classification on realistic logs (one per class) and the remedy chosen for each."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpusched.faults.classify import Classification, FailureKind, classify_failure
from gpusched.faults.remedies import choose_remedy
from gpusched.hardware.simulated import SimulatedBackend
from gpusched.model import FleetSnapshot, Health
from gpusched.placement.feasible import feasible
from gpusched.request import GPURequest

GIB = 2**30

TORCH_OOM = """\
[2026-12-02, 10:14:55 UTC] {subprocess.py:93} INFO - step 1200 loss=2.113
Traceback (most recent call last):
  File "/opt/train/train.py", line 212, in <module>
    main()
  File "/opt/train/train.py", line 198, in main
    loss = model(**batch).loss
  File "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1553, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of \
79.15 GiB of which 1.12 GiB is free. Process 48211 has 78.02 GiB memory in use. Of the allocated memory \
75.31 GiB is allocated by PyTorch, and 1.90 GiB is reserved by PyTorch but unallocated. If reserved but \
unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid \
fragmentation.
[2026-12-02, 10:14:56 UTC] {taskinstance.py:3101} ERROR - Bash command failed. The command returned \
a non-zero exit code 1.
"""

HIP_OOM = """\
RuntimeError: HIP error: hipErrorOutOfMemory
HIP kernel errors might be asynchronously reported at some other API call, so the stacktrace below \
might be incorrect.
"""

NCCL_FAILURE = """\
node-2:48213:48390 [3] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/IB/0
node-2:48213:48390 [3] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer 10.0.3.12<51234>
node-2:48213:48390 [3] NCCL INFO transport/net_socket.cc:493 -> 6
[rank3]:[E1202 10:15:02.123 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=1823, OpType=ALLREDUCE, NumelIn=262144000, Timeout(ms)=600000) ran for 600043 milliseconds.
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, \
unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5
ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.
"""

XID_FAILURE = """\
[2026-12-02, 10:20:11 UTC] {subprocess.py:93} INFO - NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', \
name=<unknown>, GPU has fallen off the bus.
RuntimeError: CUDA error: unspecified launch failure
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below \
might be incorrect.
"""

ECC_FAILURE = """\
Traceback (most recent call last):
  File "/opt/train/train.py", line 140, in train_step
    optimizer.step()
RuntimeError: CUDA error: uncorrectable ECC error encountered
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.
"""

CODE_FAILURE = """\
Traceback (most recent call last):
  File "/opt/airflow/dags/finetune.py", line 41, in finetune
    lr = config["learning_rate"]
         ~~~~~~^^^^^^^^^^^^^^^^^
KeyError: 'learning_rate'
"""

ASSERT_WITH_NCCL_NOISE = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/opt/train/train.py", line 88, in <module>
[rank0]:     assert batch["input_ids"].shape[0] == 32
AssertionError
node-1:1201:1290 [1] NCCL WARN Net : Connection closed by remote peer
"""


@pytest.mark.parametrize(("log", "kind", "clue"), [
    (TORCH_OOM, FailureKind.CUDA_OOM, "CUDA out of memory. Tried to allocate 2.00 GiB"),
    (HIP_OOM, FailureKind.CUDA_OOM, "hipErrorOutOfMemory"),
    (NCCL_FAILURE, FailureKind.COMMUNICATION, "NCCL WARN"),
    (XID_FAILURE, FailureKind.HARDWARE, "Xid (PCI:0000:18:00): 79"),
    (ECC_FAILURE, FailureKind.HARDWARE, "uncorrectable ECC error"),
    (CODE_FAILURE, FailureKind.CODE_ERROR, "KeyError: 'learning_rate'"),
    (ASSERT_WITH_NCCL_NOISE, FailureKind.CODE_ERROR, "AssertionError"),
    ("node-1 NCCL WARN Cuda failure 'out of memory'\n", FailureKind.CUDA_OOM, "out of memory"),
    ("Task exited with return code -9\n", FailureKind.UNKNOWN, "return code -9"),
])
def test_classifies_realistic_logs_with_evidence(log: str, kind: FailureKind, clue: str) -> None:
    result = classify_failure(log)
    assert result.kind is kind
    assert any(clue in line for line in result.evidence), result.evidence


def test_oom_reads_the_failed_allocation_and_xids_are_collected() -> None:
    assert classify_failure(TORCH_OOM).tried_bytes == 2 * GIB
    assert classify_failure(XID_FAILURE).xids == (79,)
    app = classify_failure("NVRM: Xid (PCI:0000:3b:00): 13, pid=311, Graphics Exception\n")
    assert app.kind is FailureKind.CODE_ERROR  # Xid 13 is the program's fault, not the device's


def test_device_state_from_the_ledger_makes_a_vague_log_a_hardware_failure() -> None:
    vague = "RuntimeError: CUDA error: unspecified launch failure\n"
    assert classify_failure(vague).kind is FailureKind.UNKNOWN
    by_health = classify_failure(vague, {"GPU-1": Health.UNHEALTHY, "GPU-2": Health.HEALTHY})
    assert by_health.kind is FailureKind.HARDWARE and by_health.suspect_devices == ("GPU-1",)
    by_xid = classify_failure(vague, device_xids={"GPU-2": [79], "GPU-3": [13]})
    assert by_xid.kind is FailureKind.HARDWARE and by_xid.suspect_devices == ("GPU-2",)
    leak = classify_failure("Received SIGTERM. Terminating subprocesses.\n",
                            agent_stops=["device memory grows 300 MB/min over 13 samples"])
    assert leak.kind is FailureKind.CODE_ERROR and "300 MB/min" in leak.evidence[0]
    # An explicit code exception beats a device that went bad later (a retry would fail the same way).
    assert classify_failure(CODE_FAILURE, {"GPU-1": Health.UNHEALTHY}).kind is FailureKind.CODE_ERROR


@pytest.fixture(scope="module")
def fleet() -> FleetSnapshot:
    import tempfile
    from pathlib import Path

    backend = SimulatedBackend(state_folder=Path(tempfile.mkdtemp()))
    return FleetSnapshot(tuple(backend.discover()), source="simulated")


def _devices(fleet: FleetSnapshot, node: str, n: int = 1) -> list[str]:
    return [d.uuid for d in fleet.node(node).devices[:n]]


def test_hardware_failure_cordons_the_suspect_and_retries_unchanged(fleet: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=1, vendor="nvidia")
    devices = _devices(fleet, "a-h100-1")
    remedy = choose_remedy(classify_failure(XID_FAILURE), request, devices, fleet)
    assert remedy.retry and remedy.request is None
    assert remedy.cordon == tuple(devices) == remedy.mark_unhealthy
    assert remedy.scale_out is None


def test_oom_on_a_smaller_model_retries_on_a_larger_one(fleet: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=1, model="L40S")
    remedy = choose_remedy(classify_failure(TORCH_OOM), request, _devices(fleet, "a-l40s-1"), fleet)
    assert remedy.retry and remedy.request is not None
    assert remedy.request.memory_per_gpu >= 48 * GIB * 5 // 4
    assert "L40S" not in remedy.request.models and "H100-SXM-80GB" in remedy.request.models
    assert feasible(remedy.request, fleet)


def test_oom_of_a_fraction_asks_for_more_memory_on_the_same_kind(fleet: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=0.25, memory="16GiB")
    remedy = choose_remedy(classify_failure(TORCH_OOM), request, _devices(fleet, "a-h100-1"), fleet)
    assert remedy.request is not None and remedy.request.is_fractional
    # max(had + tried = 18 GiB, had × 1.25 = 20 GiB): at least a quarter more
    assert remedy.request.memory_per_gpu == 20 * GIB


def test_oom_beyond_every_model_is_not_retried(fleet: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=1, memory="190GiB", model="MI300X")
    remedy = choose_remedy(classify_failure(HIP_OOM), request, _devices(fleet, "b-mi300x-1"), fleet)
    assert not remedy.retry and "shard the model" in remedy.reason


def test_code_errors_and_exhausted_attempts_are_not_retried(fleet: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=1)
    devices = _devices(fleet, "a-h100-1")
    assert not choose_remedy(classify_failure(CODE_FAILURE), request, devices, fleet).retry
    late = choose_remedy(classify_failure(XID_FAILURE), request, devices, fleet, attempt=3, max_attempts=3)
    assert not late.retry and late.cordon == ()
    unknown = Classification(FailureKind.UNKNOWN, ("?",))
    assert choose_remedy(unknown, request, devices, fleet, attempt=1).retry
    assert not choose_remedy(unknown, request, devices, fleet, attempt=2).retry


def test_cross_node_nccl_failure_retries_inside_one_node(fleet: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=4, interconnect="any", vendor="nvidia")
    remedy = choose_remedy(classify_failure(NCCL_FAILURE), request, _devices(fleet, "a-h100-1", 4), fleet)
    assert remedy.retry and remedy.request is not None
    assert str(remedy.request.interconnect) == "same_node"


def test_shortage_after_cordon_asks_to_activate_the_standby_node(fleet: FleetSnapshot) -> None:
    request = GPURequest.build(gpus=8, model="H100-SXM-80GB")
    devices = _devices(fleet, "a-h100-1", 8)
    verdict = classify_failure(XID_FAILURE, {devices[3]: Health.UNHEALTHY})
    remedy = choose_remedy(verdict, request, devices, fleet)
    assert remedy.cordon == (devices[3],)
    assert remedy.scale_out == request and remedy.activate == ("a-h100-2",)
    cordoned = fleet.with_device(replace(fleet.device(devices[3]), cordoned=True))
    assert not feasible(request, cordoned, empty=True)


def test_a_lost_host_is_a_node_fault_retried_elsewhere_twice_without_cordons(fleet: FleetSnapshot) -> None:
    text = ("Executor GPUCeleryExecutor reported that the task instance finished with state failed. "
            "Extra info: node lost: no heartbeat from host host-a for 12 s; its devices are released")
    verdict = classify_failure(text)
    assert verdict.kind is FailureKind.NODE_LOST and "host-a" in verdict.evidence[0]
    request = GPURequest.build(gpus=1)
    for attempt in (1, 2):  # an unknown failure would not be retried a second time
        remedy = choose_remedy(verdict, request, ("GPU-x",), fleet, attempt=attempt)
        assert remedy.retry and remedy.cordon == () and "node lost" in remedy.reason


def test_a_stopped_gang_member_is_retried_with_its_gang(fleet: FleetSnapshot) -> None:
    text = ("Extra info: multi-node gang member train__node1 failed; stopping the other members so that "
            "the gang is retried as a whole")
    verdict = classify_failure(text)
    assert verdict.kind is FailureKind.GANG_STOPPED
    for attempt in (1, 2):
        assert choose_remedy(verdict, GPURequest.build(gpus=1), (), fleet, attempt=attempt).retry


def test_a_request_that_can_never_fit_is_not_retried_nor_scaled_out(fleet: FleetSnapshot) -> None:
    """Before: 'unknown failure; retrying once unchanged' plus a 64-device scale-out request."""
    log = ("Could not read served logs: Hostname not available for worker\n"
           "gpusched: not started, can never fit this fleet: needs 64 NVLink-connected GPUs; "
           "the largest island has 8")
    verdict = classify_failure(log)
    assert verdict.kind is FailureKind.UNSCHEDULABLE and "largest island has 8" in verdict.evidence[0]
    remedy = choose_remedy(verdict, GPURequest.build(gpus=64, interconnect="island"), [], fleet)
    assert not remedy.retry and remedy.scale_out is None and remedy.activate == ()
    assert "not retrying" in remedy.reason and "largest island has 8" in remedy.reason
