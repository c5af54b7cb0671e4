"""Multi-node gangs in the scheduling cycle: every member on its own node, or none of them (pure).

What a gang is — its members' membership in ``executor_config`` and their rendezvous variables —
is vocabulary (:mod:`gpusched.gang`); this module places a complete gang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpusched.capacity.prescale import activate_in_snapshot, standby_for_gang
from gpusched.gang import LOCAL_ADDRESS, GangMember, rendezvous_env
from gpusched.model import DeviceShare, FleetSnapshot, Node
from gpusched.placement import PendingTask, PlacementRequest, Policy, RunningTask, place
from gpusched.placement.feasible import gang_fit
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest

__all__ = ["GangPlan", "GangWork", "membership", "place_gang", "standby_note"]

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
    """Shares and rendezvous variables per member key, or why the gang waits (``permanent``: not
    even the idle fleet with every standby node switched on holds it)."""

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
    empty plan with the reason when the gang cannot start now, naming how many members fit now:

    * it fits the idle fleet: it waits for running work to end;
    * it fits only once standby nodes are switched on (the nodes
      :func:`gpusched.capacity.prescale.standby_for_gang` names, the rule the agent's standby
      scale-out applies to waiting gangs): it waits for them;
    * not even the idle fleet with every standby node on holds it: ``permanent``.

    Quotas are not checked here: the caller admits the whole gang on the chosen shares
    (:func:`gpusched.scheduler.cycle.decide`'s gang quota check).
    """
    ordered = sorted(members, key=lambda m: membership(m).rank)
    first = ordered[0]
    shares, best, why = _try(ordered, snapshot, policy, now, running)
    if shares is None:
        return _waiting(ordered, snapshot, policy, now, best, why)
    master_node = shares[first.key][0].node
    master = (addresses or {}).get(master_node, LOCAL_ADDRESS)
    per_node = first.request.count
    rendezvous = {m.key: rendezvous_env(membership(m), per_node, master) for m in ordered}
    return GangPlan(shares, rendezvous)


def _waiting(
    ordered: Sequence[GangWork], snapshot: FleetSnapshot, policy: Policy, now: float, best: int, why: str
) -> GangPlan:
    """Why a gang of which only ``best`` members could be placed now waits, or never fits."""
    gang = membership(ordered[0])
    request, size, same_rack = ordered[0].request, gang.size, gang.scope == "same_rack"
    where = f"on distinct nodes of {'one rack' if same_rack else 'the fleet'}"
    head = f"multi-node gang {gang.gang.rsplit('/', 1)[-1]}: only {best} of {size} members fit {where} now"
    idle = FleetSnapshot(snapshot.nodes, {}, snapshot.source, snapshot.taken_at, snapshot.closed)
    standby = standby_for_gang(request, size, same_rack, idle, empty=True)
    if standby == ():  # the idle fleet holds it: running work must end first
        return GangPlan({}, {}, f"{head}{f' ({why})' if why else ''}")
    when_idle = gang_fit(request, size, same_rack, idle, empty=True)
    if standby is not None:
        nodes = f"standby node {standby[0]}" if len(standby) == 1 else f"standby nodes {', '.join(standby)}"
        return GangPlan({}, {}, f"{head} ({when_idle} when idle); {nodes} would make all {size} fit: "
                                "waiting for the standby scale-out to switch "
                                f"{'it' if len(standby) == 1 else 'them'} on")
    spare = [n.name for n in snapshot.nodes if n.standby]
    everything = activate_in_snapshot(idle, spare)
    most = gang_fit(request, size, same_rack, everything, empty=True)
    if most:
        holders = f"at most {most} {'nodes of one rack' if same_rack else 'nodes'} hold that"
    else:  # placement says why not even one member fits
        cause = _try(ordered, everything, policy, now, ())[2]
        holders = "no node holds that" + (f" ({cause})" if cause else "")
    on = " with every standby node on" if spare else ""
    return GangPlan({}, {}, f"multi-node gang {gang.gang.rsplit('/', 1)[-1]}: only {most} of {size} members "
                            f"fit {where} even when idle{on}: each needs {request.describe()} on a node of "
                            f"its own; {holders}", True)


def has_standby(snapshot: FleetSnapshot) -> bool:
    """Whether ``snapshot`` has a standby node that could take work once switched on (without
    one, :func:`standby_note` leaves every reason as it is)."""
    return any(n.standby and not snapshot.takes_no_work(n) for n in snapshot.nodes)


def standby_note(reason: str, request: GPURequest, snapshot: FleetSnapshot) -> str:
    """``reason`` (why a single task waits) naming the standby node that would give it room now:
    the node the agents' standby scale-out switches on for it once it has waited long enough
    (:func:`gpusched.capacity.prescale.standby_for_gang` with one member over the free fleet, as
    the reactive rule). Unchanged when it fits now (it waits for something else) or no standby
    node helps."""
    if not has_standby(snapshot):
        return reason
    nodes = standby_for_gang(request, 1, False, snapshot)
    if not nodes:
        return reason
    return (f"{reason}; standby node {nodes[0]} would make it fit: waiting for the standby scale-out "
            "to switch it on")


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
    """Place the members one by one in each group (rack, or the fleet); the first group that
    holds them all wins. Otherwise: the most members one group held and why the next one did not
    fit there (the reason of the group that held the most, first such group)."""
    best, why = -1, ""
    for group in _groups(snapshot, membership(members[0]).scope):
        snap, used, placed = snapshot, set(), {}
        reason = ""
        for member in members:
            nodes = tuple(n for n in group if n.name not in used)
            sub = FleetSnapshot(nodes, snap.usage, snap.source, snap.taken_at, snap.closed)
            task = PendingTask(member.key, member.request, member.submitted_at)
            # Quota is judged once for the whole gang on the full fleet (cycle.py); per member on
            # a part of the fleet its partition capacity would be wrong, so members place unlimited.
            plan = place(PlacementRequest(pending=(task,), snapshot=sub, policy=policy, now=now,
                                          quota=QuotaState.unlimited(), running=running))
            if not plan.assignments:
                reason = plan.rejections[0].reason if plan.rejections else ""
                break
            chosen = tuple(plan.assignments[0].shares)
            used.add(chosen[0].node)
            snap = snap.with_usage(chosen)
            placed[member.key] = chosen
        if len(placed) == len(members):
            return placed, len(placed), ""
        if len(placed) > best:
            best, why = len(placed), reason
    return None, max(best, 0), why
