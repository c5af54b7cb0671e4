"""Why did a GPU task fail (pure policy).

:func:`classify_failure` reads the task's log text (and what the ledger knows about its devices)
and returns a :class:`Classification`: one :class:`FailureKind` with the log lines that prove it.
What happens next is :func:`gpusched.faults.remedies.choose_remedy`.

Precedence when a log shows several symptoms: hardware named in the log (Xid, ECC, fallen off
the bus) > stopped by the agent for a memory leak > CUDA OOM > code error > hardware known only
from the device's state (ledger health, telemetry Xids) > communication > unknown. A rank that
dies of a ``KeyError`` makes its peers report NCCL timeouts, so an explicit code exception wins
over communication noise; an NCCL failure that is really an out-of-memory or an Xid is
classified by that cause; a vague CUDA or NCCL error on a device the telemetry saw fail is a
hardware failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from gpusched.faults.xid import XidClass, classify_xid
from gpusched.model import Health

__all__ = [
    "Classification",
    "FailureKind",
    "classify_failure",
]


class FailureKind(StrEnum):
    """The failure classes the recovery chain distinguishes."""

    CUDA_OOM = "cuda_oom"
    COMMUNICATION = "communication"
    HARDWARE = "hardware"
    CODE_ERROR = "code_error"
    NODE_LOST = "node_lost"
    GANG_STOPPED = "gang_stopped"
    UNSCHEDULABLE = "unschedulable"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Classification:
    """The verdict on one failure.

    Attributes:
        kind: the failure class.
        evidence: the log lines (or device facts) that decided it, at most a handful.
        xids: Xid codes seen in the log.
        tried_bytes: for an OOM, the allocation that failed ("Tried to allocate 2.00 GiB"), or 0.
        suspect_devices: device uuids the evidence points at (unhealthy / hardware Xid).
    """

    kind: FailureKind
    evidence: tuple[str, ...]
    xids: tuple[int, ...] = ()
    tried_bytes: int = 0
    suspect_devices: tuple[str, ...] = ()


_XID_RE = re.compile(r"\bXid\b\s*(?:\(PCI:[0-9a-fA-F:.]+\))?\s*[:=]?\s*(\d{1,3})\b")
_HW_PATTERNS = [re.compile(p, re.IGNORECASE) for p in (
    r"uncorrectable ECC error",
    r"cudaErrorECCUncorrectable|CUDA_ERROR_ECC_UNCORRECTABLE",
    r"hipErrorECCNotCorrectable",
    r"GPU has fallen off the bus",
    r"Unable to determine the device handle for GPU.*Unknown Error",
    r"double[- ]bit ECC",
    r"amdgpu.*(?:uncorrectable|ras).*error",
)]
_OOM_PATTERNS = [re.compile(p) for p in (
    r"CUDA out of memory\.?",
    r"torch\.(?:cuda\.)?OutOfMemoryError",
    r"hipErrorOutOfMemory",
    r"HIP out of memory",
    r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation",
    r"RESOURCE_EXHAUSTED: Out of memory",
    r"OOM when allocating tensor",
    r"CUBLAS_STATUS_ALLOC_FAILED",
    r"NPU out of memory",
    r"NCCL WARN.*out of memory",
)]
_NODE_LOST_RE = re.compile(r"node lost: no heartbeat from host \S+")
"""The reason the GPU executors give a task whose GPU host stopped heartbeating."""

_GANG_STOPPED_RE = re.compile(r"multi-node gang member .* failed; stopping the other members")
"""The reason the GPU executors give a gang member they stopped because another member failed."""

_COMM_PATTERNS = [re.compile(p) for p in (
    r"NCCL WARN",
    r"\bNCCL error\b",
    r"ncclSystemError|ncclRemoteError|ncclInternalError|ncclUnhandledCudaError",
    r"unhandled system error",
    r"DistBackendError",
    r"Watchdog caught collective operation timeout",
    r"NCCL communicator was aborted",
    r"\bRCCL\b.*(?:WARN|error)",
    r"\bHCCL\b.*(?:error|timeout)",
    r"Connection reset by peer",
    r"socket(?:Progress|PollConnect).*(?:error|fail)",
)]
_CODE_EXCEPTIONS = (
    "KeyError", "AssertionError", "TypeError", "ValueError", "NameError", "AttributeError",
    "IndexError", "ZeroDivisionError", "ImportError", "ModuleNotFoundError", "SyntaxError",
    "IndentationError", "NotImplementedError", "UnboundLocalError", "RecursionError",
    "FileNotFoundError",
)
_CODE_RE = re.compile(r"^\s*(?:[\w]+\.)*(" + "|".join(_CODE_EXCEPTIONS) + r")\b(?::|$)")
_CODE_PATTERNS = [re.compile(p) for p in (
    r"device-side assert triggered",
    r"an illegal memory access was encountered",
)]
_UNSCHEDULABLE_RE = re.compile(r"can never fit this fleet")
"""The executor's words (in the try's log) for a request the placement can never satisfy."""
_TRIED_RE = re.compile(r"Tried to allocate ([\d.]+)\s*([KMGT]i?B)", re.IGNORECASE)
_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_MAX_EVIDENCE = 5
_MAX_LINE = 300
"""The longest evidence line kept (longer ones are cut at a word boundary, marked with "…")."""


def classify_failure(
    log_text: str,
    device_health: Mapping[str, Health] | None = None,
    device_xids: Mapping[str, Sequence[int]] | None = None,
    agent_stops: Sequence[str] = (),
) -> Classification:
    """Classify a failed task from its log text and the state of the devices it held.

    Args:
        log_text: the task log (or its tail, or the formatted exception); any size.
        device_health: health of each device the task held, as the ledger knows it.
        device_xids: Xid codes the telemetry saw on each of those devices.
        agent_stops: reasons ``gpusched agent`` gave for stopping this try (its device memory kept
            growing): a leak is the program's bug, so such a try is a code error.
    """
    lines = log_text.splitlines()
    # The executor's reason itself, from its words on (the log's prefix and a repeat dropped).
    never_fits = [line[match.start():] for line in lines if (match := _UNSCHEDULABLE_RE.search(line))]
    if never_fits:  # the try never started: nothing else in the log is about this request
        return Classification(FailureKind.UNSCHEDULABLE, _evidence(never_fits))
    lost = [line for line in lines if _NODE_LOST_RE.search(line)]
    if lost:  # the whole host went away: a hardware fault of the node, not of one device
        return Classification(FailureKind.NODE_LOST, _evidence(lost), ())
    stopped = [line for line in lines if _GANG_STOPPED_RE.search(line)]
    if stopped:  # not this member's fault: it retries with its gang
        return Classification(FailureKind.GANG_STOPPED, _evidence(stopped), ())
    xids: list[int] = []
    hw_lines: list[str] = []
    for line in lines:
        for match in _XID_RE.finditer(line):
            code = int(match.group(1))
            xids.append(code)
            if classify_xid(code) is XidClass.HARDWARE:
                hw_lines.append(line)
    hw_lines += _matching(lines, _HW_PATTERNS)
    suspects: list[str] = []
    state_lines: list[str] = []
    for uuid, health in sorted((device_health or {}).items()):
        if health is Health.UNHEALTHY:
            suspects.append(uuid)
            state_lines.append(f"device {uuid} is marked unhealthy in the ledger")
    for uuid, codes in sorted((device_xids or {}).items()):
        bad = sorted({c for c in codes if classify_xid(c) is XidClass.HARDWARE})
        if bad:
            if uuid not in suspects:
                suspects.append(uuid)
            state_lines.append(f"telemetry saw hardware Xid {', '.join(map(str, bad))} on {uuid}")
    found_xids = tuple(dict.fromkeys(xids))
    if hw_lines:
        return Classification(FailureKind.HARDWARE, _evidence(hw_lines + state_lines), found_xids,
                              suspect_devices=tuple(suspects))
    if agent_stops:
        stops = [f"stopped by gpusched agent: {reason}" for reason in agent_stops]
        return Classification(FailureKind.CODE_ERROR, _evidence(stops), found_xids)
    oom = _matching(lines, _OOM_PATTERNS)
    if oom:
        return Classification(FailureKind.CUDA_OOM, _evidence(oom), found_xids, _tried_bytes(log_text))
    code_lines = [line for line in lines if _CODE_RE.match(line)] + _matching(lines, _CODE_PATTERNS)
    code_lines += [line for line in lines for m in _XID_RE.finditer(line)
             if classify_xid(int(m.group(1))) is XidClass.APPLICATION]
    if code_lines:
        return Classification(FailureKind.CODE_ERROR, _evidence(code_lines), found_xids)
    if state_lines:  # the device is bad, and the log names nothing more specific
        return Classification(FailureKind.HARDWARE, _evidence(state_lines), found_xids,
                              suspect_devices=tuple(suspects))
    comm = _matching(lines, _COMM_PATTERNS)
    if comm:
        return Classification(FailureKind.COMMUNICATION, _evidence(comm), found_xids)
    tail = [line for line in lines if line.strip()][-2:]
    return Classification(FailureKind.UNKNOWN, _evidence(tail), found_xids)


def _matching(lines: Sequence[str], patterns: Sequence[re.Pattern[str]]) -> list[str]:
    return [line for line in lines if any(p.search(line) for p in patterns)]


def _evidence(lines: Sequence[str]) -> tuple[str, ...]:
    unique = list(dict.fromkeys(_clip(line.strip()) for line in lines if line.strip()))
    return tuple(unique[:_MAX_EVIDENCE])


def _clip(line: str) -> str:
    """``line`` cut to at most :data:`_MAX_LINE` characters, at a word boundary, "…" marking the cut."""
    if len(line) <= _MAX_LINE:
        return line
    cut = line[:_MAX_LINE - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > _MAX_LINE // 2 else cut).rstrip(" ,;:(") + "…"


def _tried_bytes(text: str) -> int:
    match = _TRIED_RE.search(text)
    if not match:
        return 0
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
