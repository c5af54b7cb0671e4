"""Multi-node gangs in the scheduling cycle: every member on its own node, or none of them (pure).

What a gang is — its members' membership in ``executor_config`` and their rendezvous variables —
is vocabulary (:mod:`gpusched.gang`); this module places a complete gang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpusched.gang import LOCAL_ADDRESS, GangMember, rendezvous_env
from gpusched.model import DeviceShare, FleetSnapshot, Node
from gpusched.placement import PendingTask, PlacementRequest, Policy, RunningTask, place
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

__all__ = ["GangPlan", "GangWork", "membership", "place_gang"]

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
    (:func:`gpusched.scheduler.cycle.decide`'s gang quota check).
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
            # Quota is judged once for the whole gang on the full fleet (cycle.py); per member on
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
