"""Multi-node gangs in the scheduling cycle: membership, placement (every member on its own node, or none
of them) and the rendezvous variables (pure).

A gang member is one task per node; its membership travels in the task's ``executor_config`` under
:data:`GANG_KEY` (written by :func:`gpusched.airflow.gang.gang_task`).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpusched.errors import GPURequestError
from gpusched.model import DeviceShare, FleetSnapshot, Node
from gpusched.placement import PendingTask, PlacementRequest, Policy, RunningTask, place
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

__all__ = [
    "GANG_KEY", "GANG_SCOPES", "RENDEZVOUS_VARS", "GangMember", "GangPlan", "GangWork", "gang_member",
    "membership", "place_gang", "rendezvous_env",
]

GANG_KEY = "gpusched_gang"
"""Key of the gang spec in a member task's ``executor_config``."""

RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_WORLD_SIZE",
                   "GPUSCHED_GANG")
"""Every variable :func:`rendezvous_env` sets."""

GANG_SCOPES = ("same_rack", "any")
_PORT_BASE, _PORT_SPAN = 29500, 500


@dataclass(frozen=True, slots=True)
class GangMember:
    """One member of a multi-node gang: ``gang`` is unique per DAG run (and map index)."""

    gang: str
    size: int
    rank: int
    scope: str = "same_rack"


def gang_member(
    executor_config: object, *, dag_id: str, run_id: str, map_index: int = -1
) -> GangMember | None:
    """The gang membership in a task's ``executor_config``, or None for an ordinary task.

    Raises:
        GPURequestError: the ``gpusched_gang`` entry is malformed.
    """
    if not isinstance(executor_config, Mapping) or GANG_KEY not in executor_config:
        return None
    spec = executor_config[GANG_KEY]
    try:
        name, size, rank = str(spec["name"]), int(spec["size"]), int(spec["rank"])
        scope = str(spec.get("scope", "same_rack"))
    except (KeyError, TypeError, ValueError):
        raise GPURequestError(GANG_KEY, spec, "a mapping with name, size and rank (use gang_task)") from None
    if size < 2 or not 0 <= rank < size or scope not in GANG_SCOPES:
        raise GPURequestError(GANG_KEY, spec, f"size >= 2, 0 <= rank < size, scope in {GANG_SCOPES}")
    return GangMember(f"{dag_id}/{run_id}/{map_index}/{name}", size, rank, scope)


def rendezvous_env(member: GangMember, gpus_per_node: int, master_addr: str) -> dict[str, str]:
    """The torchrun / DeepSpeed variables of ``member`` (``MASTER_PORT`` derived from the gang id)."""
    port = _PORT_BASE + zlib.crc32(member.gang.encode()) % _PORT_SPAN
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(member.size * gpus_per_node),
        "NODE_RANK": str(member.rank),
        "NNODES": str(member.size),
        "LOCAL_WORLD_SIZE": str(gpus_per_node),
        "GPUSCHED_GANG": member.gang,
    }

LOCAL_ADDRESS = "127.0.0.1"
"""Rendezvous address of a node with no registered GPU host (the local executor: one machine)."""


class GangWork(Protocol):
    """What gang placement reads of a member's work (:class:`~gpusched.scheduler.cycle.PendingWork`)."""

    @property
    def key(self) -> str: ...

    @property
    def request(self) -> GPURequest: ...

    @property
    def submitted_at(self) -> float: ...

    @property
    def gang(self) -> GangMember | None: ...


def membership(work: GangWork) -> GangMember:
    """The gang ``work`` belongs to (only gang members reach gang placement)."""
    if work.gang is None:
        raise ValueError(f"{work.key} is not a gang member")
    return work.gang


@dataclass(frozen=True, slots=True)
class GangPlan:
    """Shares and rendezvous variables per member key, or why the gang waits."""

    shares: Mapping[str, tuple[DeviceShare, ...]]
    rendezvous: Mapping[str, Mapping[str, str]]
    reason: str = ""
    permanent: bool = False


def place_gang(
    members: Sequence[GangWork],
    snapshot: FleetSnapshot,
    policy: Policy,
    *,
    now: float,
    running: Sequence[RunningTask] = (),
    addresses: Mapping[str, str] | None = None,
) -> GangPlan:
    """Place every member (``PendingWork`` with ``gang``, all ranks present) on distinct nodes.

    ``same_rack`` gangs try one rack at a time (racks with more free devices first). Returns an
    empty plan with the reason (``permanent`` when even an idle fleet could not hold the gang).
    Quotas are not checked here: the caller admits the whole gang on the chosen shares
    (``gpu_cycle``'s gang quota check).
    """
    ordered = sorted(members, key=lambda m: membership(m).rank)
    first = ordered[0]
    shares, best, why = _try(ordered, snapshot, policy, now, running)
    if shares is None:
        idle = FleetSnapshot(snapshot.nodes, {}, snapshot.source, snapshot.taken_at)
        never = _try(ordered, idle, policy, now, ())[0] is None
        gang = membership(first)
        scope = "one rack" if gang.scope == "same_rack" else "the fleet"
        reason = (f"multi-node gang {gang.gang.rsplit('/', 1)[-1]}: only {best} of {gang.size} members "
                  f"fit on distinct nodes of {scope}{' even when idle' if never else ' now'}"
                  f"{f' ({why})' if why else ''}")
        return GangPlan({}, {}, reason, never)
    master_node = shares[first.key][0].node
    master = (addresses or {}).get(master_node, LOCAL_ADDRESS)
    per_node = first.request.count
    rendezvous = {m.key: rendezvous_env(membership(m), per_node, master) for m in ordered}
    return GangPlan(shares, rendezvous)


def _groups(snapshot: FleetSnapshot, scope: str) -> list[tuple[Node, ...]]:
    if scope != "same_rack":
        return [snapshot.nodes]
    racks: dict[str, list[Node]] = {}
    for node in snapshot.nodes:
        racks.setdefault(node.rack, []).append(node)

    def free(nodes: list[Node]) -> int:
        return sum(1 for n in nodes for d in n.devices if snapshot.usage.get(d.uuid) is None)

    return [tuple(nodes) for _, nodes in sorted(racks.items(), key=lambda kv: (-free(kv[1]), kv[0]))]


def _try(
    members: Sequence[GangWork], snapshot: FleetSnapshot, policy: Policy, now: float,
    running: Sequence[RunningTask],
) -> tuple[dict[str, tuple[DeviceShare, ...]] | None, int, str]:
    best, why = 0, ""
    for group in _groups(snapshot, membership(members[0]).scope):
        snap, used, placed = snapshot, set(), {}
        for member in members:
            nodes = tuple(n for n in group if n.name not in used)
            sub = FleetSnapshot(nodes, snap.usage, snap.source, snap.taken_at)
            task = PendingTask(member.key, member.request, member.submitted_at)
            # Quota is judged once for the whole gang on the full fleet (gpu_cycle); per member on
            # a part of the fleet its partition capacity would be wrong, so members place unlimited.
            plan = place(PlacementRequest(pending=(task,), snapshot=sub, policy=policy, now=now,
                                          quota=QuotaState.unlimited(), running=running))
            if not plan.assignments:
                why = plan.rejections[0].reason if plan.rejections else why
                break
            chosen = tuple(plan.assignments[0].shares)
            used.add(chosen[0].node)
            snap = snap.with_usage(chosen)
            placed[member.key] = chosen
        if len(placed) == len(members):
            return placed, len(placed), ""
        best = max(best, len(placed))
    return None, best, why
