"""Why did a GPU task fail, and what should happen next (pure policy).

:func:`classify_failure` reads the task's log text (and what the ledger knows about its devices)
and returns a :class:`Classification`: one :class:`FailureKind` with the log lines that prove it.
:func:`choose_remedy` turns a classification into a :class:`Remedy`: retry (with a new
:class:`~gpusched.request.GPURequest` when more memory or another model is needed), cordon the
suspect devices and retry elsewhere, ask for more capacity (scale out) when the fleet cannot
hold the retry, or do not retry at all (code errors: the same code fails on any GPU).

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
from dataclasses import dataclass, replace
from enum import StrEnum

from gpusched.alerts import XidClass, classify_xid
from gpusched.catalog import Catalog, arch_rank, default_catalog
from gpusched.errors import GPURequestError
from gpusched.model import Device, FleetSnapshot, Health
from gpusched.request import GPURequest, Interconnect

__all__ = [
    "Classification",
    "FailureKind",
    "Remedy",
    "choose_remedy",
    "classify_failure",
    "fits_fleet",
    "standby_to_activate",
]


class FailureKind(StrEnum):
    """The failure classes the recovery chain distinguishes."""

    CUDA_OOM = "cuda_oom"
    COMMUNICATION = "communication"
    HARDWARE = "hardware"
    CODE_ERROR = "code_error"
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
    never_fits = [line for line in lines if _UNSCHEDULABLE_RE.search(line)]
    if never_fits:  # the try never started: nothing else in the log is about this request
        return Classification(FailureKind.UNSCHEDULABLE, _evidence(never_fits))
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
    unique = list(dict.fromkeys(line.strip()[:300] for line in lines if line.strip()))
    return tuple(unique[:_MAX_EVIDENCE])


def _tried_bytes(text: str) -> int:
    match = _TRIED_RE.search(text)
    if not match:
        return 0
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True, slots=True)
class Remedy:
    """What the recovery chain does about one failure.

    Attributes:
        retry: whether to run the task again.
        request: the request the retry must use (an override), or None to keep the task's own.
        cordon: device uuids (or node names) to cordon before the retry.
        mark_unhealthy: device uuids to mark unhealthy.
        scale_out: a request the current fleet cannot hold — capacity to add (None: no shortage).
        activate: standby nodes whose activation would let ``scale_out`` fit (may be empty when
            no standby node helps: then capacity must come from outside).
        reason: one or two sentences for the operator.
    """

    retry: bool
    reason: str
    request: GPURequest | None = None
    cordon: tuple[str, ...] = ()
    mark_unhealthy: tuple[str, ...] = ()
    scale_out: GPURequest | None = None
    activate: tuple[str, ...] = ()


def choose_remedy(
    classification: Classification,
    request: GPURequest,
    devices: Sequence[str],
    snapshot: FleetSnapshot,
    *,
    attempt: int = 1,
    max_attempts: int = 3,
    catalog: Catalog | None = None,
) -> Remedy:
    """Pick the remedy for a classified failure of a task that ran on ``devices`` with ``request``.

    ``attempt`` is the try that failed (1 = first). Past ``max_attempts`` nothing is retried.
    ``snapshot`` is the fleet now (health, cordons, usage); it decides whether the retry fits
    or capacity must be added.
    """
    kind = classification.kind
    if attempt >= max_attempts:
        return Remedy(False, f"{kind}: try {attempt} of {max_attempts} failed; giving up")
    if kind is FailureKind.CODE_ERROR:
        return Remedy(False, "code error: the same code fails on any GPU; fix it and clear the task")
    if kind is FailureKind.UNSCHEDULABLE:
        # The placement already judged it against the whole fleet, standby nodes included:
        # a retry fails the same way and no scale-out this chain can ask for helps.
        said = classification.evidence[0] if classification.evidence else "the request can never fit"
        return Remedy(False, f"unschedulable ({said.strip()}); not retrying: change the task's GPU "
                             "request or add matching hardware, then clear the task")
    if kind is FailureKind.HARDWARE:
        suspects = tuple(classification.suspect_devices) or tuple(devices)
        excluded = frozenset(suspects)
        where = ", ".join(suspects) or "an unknown device"
        reason = f"hardware fault on {where}; cordoned, retrying elsewhere"
        return _with_capacity(Remedy(True, reason, None, suspects, suspects), request, snapshot, excluded)
    if kind is FailureKind.CUDA_OOM:
        return _oom_remedy(classification, request, devices, snapshot, catalog or default_catalog())
    if kind is FailureKind.COMMUNICATION:
        return _comm_remedy(request, snapshot)
    if attempt >= 2:
        return Remedy(False, "unknown failure twice in a row; not retrying blindly")
    return _with_capacity(Remedy(True, "unknown failure; retrying once unchanged"), request, snapshot)


def _oom_remedy(
    cls: Classification, request: GPURequest, devices: Sequence[str], snapshot: FleetSnapshot, cat: Catalog
) -> Remedy:
    held = [snapshot.device(u).memory_bytes for u in devices if snapshot.has_device(u)]
    if request.is_fractional:
        current = request.memory_per_gpu
    else:
        current = min(held) if held else request.memory_per_gpu
    if current <= 0:
        return Remedy(False, "out of memory, but the memory the task had is unknown; not retrying")
    # Ask for what the task had plus what it failed to get, and at least a quarter more.
    needed = max(current + cls.tried_bytes, current * 5 // 4)
    data = request.to_dict()
    data["memory"] = needed
    if request.models or (request.is_fractional and held and needed > max(held)):
        vendors = request.vendors
        bigger = sorted(m.name for m in cat.models
                        if m.disclosed and m.memory_bytes >= needed and (not vendors or m.vendor in vendors))
        if not bigger:
            return Remedy(False, f"out of memory: {needed / 2**30:.1f} GiB per device is more than any "
                                 "allowed model has; shard the model or reduce the batch size")
        data["models"] = bigger
    try:
        new = GPURequest.from_dict(data, catalog=cat)
    except GPURequestError as exc:
        return Remedy(False, f"out of memory and no larger device exists ({exc}); shard the model "
                             "or reduce the batch size")
    reason = (f"CUDA out of memory with {current / 2**30:.1f} GiB per device; retrying with "
              f"{needed / 2**30:.1f} GiB" + (f" on {', '.join(sorted(new.models))}" if new.models else ""))
    return _with_capacity(Remedy(True, reason, new), new, snapshot)


def _comm_remedy(request: GPURequest, snapshot: FleetSnapshot) -> Remedy:
    if request.count > 1 and request.may_span_nodes:
        data = request.to_dict()
        data["interconnect"] = str(Interconnect.SAME_NODE)
        tight = GPURequest.from_dict(data)
        if fits_fleet(tight, snapshot, empty=True):
            return _with_capacity(Remedy(
                True, "collective communication failed across nodes; retrying inside one node", tight,
            ), tight, snapshot)
    return _with_capacity(Remedy(True, "collective communication failed; retrying"), request, snapshot)


def _with_capacity(
    remedy: Remedy, request: GPURequest, snapshot: FleetSnapshot, excluded: frozenset[str] = frozenset()
) -> Remedy:
    if fits_fleet(request, snapshot, excluded=excluded, empty=True):
        return remedy
    nodes = standby_to_activate(request, snapshot, excluded=excluded)
    how = f"activate standby {', '.join(nodes)}" if nodes else "no standby node helps; add capacity"
    return Remedy(
        remedy.retry,
        remedy.reason + f"; the healthy fleet cannot hold it: scale out ({how})",
        remedy.request, remedy.cordon, remedy.mark_unhealthy, request, nodes,
    )


def standby_to_activate(
    request: GPURequest, snapshot: FleetSnapshot, *, excluded: frozenset[str] = frozenset()
) -> tuple[str, ...]:
    """The fewest standby nodes (in fleet order, greedily) whose activation makes ``request`` fit.

    Empty when it already fits, or when even every standby node would not be enough.
    """
    if fits_fleet(request, snapshot, excluded=excluded, empty=True):
        return ()
    chosen: list[str] = []
    current = snapshot
    for node in snapshot.nodes:
        if not node.standby or node.cordoned:
            continue
        current = current.with_nodes([replace(node, standby=False)])
        chosen.append(node.name)
        if fits_fleet(request, current, excluded=excluded, empty=True):
            # Drop nodes that did not help (greedy order may have picked useless ones first).
            return tuple(n for n in chosen if _helps(request, snapshot, excluded, n, chosen))
    return ()


def _helps(
    request: GPURequest, snapshot: FleetSnapshot, excluded: frozenset[str], name: str, chosen: list[str]
) -> bool:
    others = [snapshot.node(n) for n in chosen if n != name]
    without = snapshot.with_nodes([replace(n, standby=False) for n in others])
    return not fits_fleet(request, without, excluded=excluded, empty=True)


def fits_fleet(
    request: GPURequest,
    snapshot: FleetSnapshot,
    *,
    excluded: frozenset[str] = frozenset(),
    empty: bool = False,
) -> bool:
    """Whether ``request`` fits the healthy, uncordoned, active part of the fleet.

    A count-and-memory check (no topology scoring): with ``empty`` it ignores current usage
    (could it *ever* run here?), otherwise it needs the devices free now. ``excluded`` devices
    count as gone (about to be cordoned).
    """
    per_node: list[int] = []
    for node in snapshot.nodes:
        if node.cordoned or node.standby or any(node.label(k) != v for k, v in request.labels):
            continue
        usable = sum(
            1 for d in node.devices if d.uuid not in excluded and _device_fits(request, d, snapshot, empty)
        )
        per_node.append(usable)
    if request.may_span_nodes:
        return sum(per_node) >= request.count
    return any(n >= request.count for n in per_node)


def _device_fits(request: GPURequest, device: Device, snapshot: FleetSnapshot, empty: bool) -> bool:
    if device.cordoned or device.health is Health.UNHEALTHY:
        return False
    if request.vendors and device.vendor not in request.vendors:
        return False
    if request.models and device.model not in request.models:
        return False
    arch = request.min_arch
    if arch is not None and (
        device.architecture[:3] != arch[:3] or arch_rank(device.architecture) < arch_rank(arch)
    ):
        return False
    if device.memory_bytes < request.memory_per_gpu:
        return False
    if empty:
        return True
    return (snapshot.free_milli(device.uuid) >= request.milli_per_gpu
            and snapshot.free_memory(device.uuid) >= (request.memory_per_gpu or device.memory_bytes))
