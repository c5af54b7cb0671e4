"""What the fault chain does about a classified failure (pure policy).

:func:`choose_remedy` turns a :class:`~gpusched.faults.classify.Classification` into a
:class:`Remedy`: retry (with a new :class:`~gpusched.request.GPURequest` when more memory or
another model is needed), cordon the suspect devices and retry elsewhere, ask for more capacity
(scale out) when the fleet cannot hold the retry, or do not retry at all (code errors: the same
code fails on any GPU). :func:`standby_to_activate` says which standby nodes would make a
request fit; whether a request fits at all is placement's own check,
:func:`gpusched.placement.feasible.feasible`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpusched.catalog import Catalog, default_catalog
from gpusched.errors import GPURequestError
from gpusched.faults.classify import Classification, FailureKind
from gpusched.model import FleetSnapshot
from gpusched.placement.feasible import feasible
from gpusched.request import GPURequest, Interconnect

__all__ = [
    "Remedy",
    "choose_remedy",
    "standby_to_activate",
]

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
    if kind is FailureKind.UNSCHEDULABLE:
        # The placement already judged it against the whole fleet, standby nodes included:
        # a retry fails the same way and no scale-out this chain can ask for helps. The
        # executor's own reason, once (one line; evidence is clipped at a word boundary).
        said = classification.evidence[0] if classification.evidence else "the request can never fit"
        return Remedy(False, f"unschedulable ({said.strip()}); not retrying: change the task's GPU "
                             "request or add matching hardware, then clear the task")
    if attempt >= max_attempts:
        return Remedy(False, f"{kind}: try {attempt} of {max_attempts} failed; giving up")
    if kind is FailureKind.CODE_ERROR:
        return Remedy(False, "code error: the same code fails on any GPU; fix it and clear the task")
    if kind is FailureKind.HARDWARE:
        suspects = tuple(classification.suspect_devices) or tuple(devices)
        excluded = frozenset(suspects)
        where = ", ".join(suspects) or "an unknown device"
        reason = f"hardware fault on {where}; cordoned, retrying elsewhere"
        return _with_capacity(Remedy(True, reason, None, suspects, suspects), request, snapshot, excluded)
    if kind is FailureKind.GANG_STOPPED:
        return Remedy(True, "stopped because another member of its multi-node gang failed; "
                            "retried with the gang")
    if kind is FailureKind.NODE_LOST:
        # The lost host's devices are out of the snapshot until its agent is back: no cordon.
        reason = "node lost (hardware fault of the host); retrying on another host"
        return _with_capacity(Remedy(True, reason), request, snapshot)
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
    hard = request.isolation == "hard" and request.is_fractional
    if hard:
        data["profile"] = None  # any slice big enough: the smallest free one that holds the new need
    if request.models or (request.is_fractional and held and needed > max(held)):
        vendors = request.vendors
        bigger = sorted(m.name for m in cat.models
                        if m.disclosed and (not vendors or m.vendor in vendors)
                        and (max((p.memory_bytes for p in m.slice_profiles), default=0) if hard
                             else m.memory_bytes) >= needed)
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
        if feasible(tight, snapshot, empty=True):
            return _with_capacity(Remedy(
                True, "collective communication failed across nodes; retrying inside one node", tight,
            ), tight, snapshot)
    return _with_capacity(Remedy(True, "collective communication failed; retrying"), request, snapshot)


def _with_capacity(
    remedy: Remedy, request: GPURequest, snapshot: FleetSnapshot, excluded: frozenset[str] = frozenset()
) -> Remedy:
    if feasible(request, snapshot, excluded=excluded, empty=True):
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
    if feasible(request, snapshot, excluded=excluded, empty=True):
        return ()
    chosen: list[str] = []
    current = snapshot
    for node in snapshot.nodes:
        if not node.standby or node.cordoned:
            continue
        current = current.with_nodes([replace(node, standby=False)])
        chosen.append(node.name)
        if feasible(request, current, excluded=excluded, empty=True):
            # Drop nodes that did not help (greedy order may have picked useless ones first).
            return tuple(n for n in chosen if _helps(request, snapshot, excluded, n, chosen))
    return ()


def _helps(
    request: GPURequest, snapshot: FleetSnapshot, excluded: frozenset[str], name: str, chosen: list[str]
) -> bool:
    others = [snapshot.node(n) for n in chosen if n != name]
    without = snapshot.with_nodes([replace(n, standby=False) for n in others])
    return not feasible(request, without, excluded=excluded, empty=True)
