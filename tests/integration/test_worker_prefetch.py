"""The executor cycle's second look (``gpu_inputs.prefetch_request``): work left waiting only
for want of a free Celery worker slot is offered the hosts whose workers may hold it until a
running try ends (``[gpusched] worker_prefetch_multiplier``), and nothing else; the shares this cycle's
launches took are not offered twice; gang members and tries owning devices never go."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpusched.airflow.gpu_inputs import prefetch_request
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import Policy, RunningTask
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, Launch, PendingWork, decide, quota_admitted

NOW = 1_000.0
QUARTER = GPURequest.build(gpus=0.25, memory="8GiB")


class _Dispatcher:
    def __init__(self, room: frozenset[str]) -> None:
        self.room = room
        self.asked: list[tuple[int, float]] = []

    def prefetch_nodes(self, running: Any, now: float) -> frozenset[str]:
        self.asked.append((len(running), now))
        return self.room


class _Core:
    def __init__(self, room: frozenset[str]) -> None:
        self.dispatcher, self.ledger = _Dispatcher(room), None


def _cycle(pending: list[PendingWork]) -> CycleRequest:
    nodes = [make_node("a1", "A100-SXM-80GB", 1), make_node("b1", "A100-SXM-80GB", 1),
             make_node("c1", "A100-SXM-80GB", 1)]
    # a1 and b1: hosts whose slots are all busy (the first look closed them); c1 cordoned by
    # an operator.
    snapshot = FleetSnapshot((*nodes[:2], replace(nodes[2], cordoned=True)), closed=frozenset({"a1", "b1"}))
    running = (RunningTask("airflow/d/r/run/1/-1", QUARTER, (DeviceShare("a1-gpu0", "a1", 0, 250, 0),),
                           NOW - 5, NOW + 5),)
    snapshot = snapshot.with_usage(running[0].shares)
    return CycleRequest(tuple(pending), snapshot, Policy.named("gpusched"), running, NOW,
                        QuotaState.unlimited())


def test_held_work_goes_only_to_hosts_with_room_and_not_onto_taken_shares() -> None:
    waiting = [PendingWork(f"airflow/d/w{i}/run/1/-1", QUARTER, NOW - 10 + i) for i in range(4)]
    cycle = _cycle(waiting)
    core = _Core(room=frozenset({"a1"}))
    taken = Launch("airflow/d/first/run/1/-1", QUARTER, (DeviceShare("a1-gpu0", "a1", 0, 500, 0),), {})
    second = prefetch_request(core, cycle, waiting, [taken])  # type: ignore[arg-type]
    # Asked over the cycle's running tries (its own launch has not started: it makes no room).
    assert second is not None and core.dispatcher.asked == [(1, NOW)]
    placement, whole = second
    # The placement sees the room's nodes alone (not b1, never the operator's c1), and the
    # quota's view the whole fleet.
    assert [(n.name, n.cordoned) for n in placement.snapshot.nodes] == [("a1", False)]
    assert placement.snapshot.closed == frozenset()  # open there
    assert whole.snapshot is cycle.snapshot
    assert [r.key for r in placement.running] == [r.key for r in whole.running] == [
        "airflow/d/r/run/1/-1", taken.key]
    assert placement.engine is None and placement.replan_budget_ms == 0.0
    reply = decide(placement)
    # a1 has 1000 milli: 250 running, 500 taken by this cycle's launch: one more quarter fits.
    assert [launch.key for launch in reply.launches] == [waiting[0].key]
    assert {s.node for launch in reply.launches for s in launch.shares} == {"a1"}
    assert quota_admitted(reply.launches, whole) == list(reply.launches)  # no quota configured


def test_the_quota_gate_judges_the_second_looks_launches_on_the_whole_fleet() -> None:
    from gpusched.quota.policy import QuotaPolicy, partition_capacity
    from gpusched.request import Partition

    waiting = [PendingWork(f"airflow/d/w{i}/run/1/-1", GPURequest.build(gpus=0.25, memory="8GiB",
                                                                       partition="burst"), NOW)
               for i in range(2)]
    cycle = _cycle(waiting)
    # burst's share: 20 % of the 2 GPUs in service, the closed a1 and b1 (400 milli; 200 of a1
    # alone, the second look's placement fleet); the running quarter is training work.
    quota = QuotaState(QuotaPolicy(borrowing=False))
    assert partition_capacity(cycle.snapshot) == 2000
    assert quota.policy.share_milli(Partition.BURST, partition_capacity(cycle.snapshot)) == 400
    launches = [Launch(w.key, w.request, (DeviceShare("a1-gpu0", "a1", 0, 250, 0),), {}) for w in waiting]
    whole = replace(cycle, quota=quota)
    assert [x.key for x in quota_admitted(launches, whole)] == [waiting[0].key]  # 250 fits, 500 not


def test_no_second_look_without_room_or_for_gangs_and_owned_devices() -> None:
    from gpusched.gang import GangMember

    owned = PendingWork("airflow/d/own/run/1/-1", QUARTER, NOW, (DeviceShare("b1-gpu0", "b1", 0, 250, 0),))
    member = PendingWork("airflow/d/g0/run/1/-1", QUARTER, NOW, (),
                         GangMember(gang="g", size=2, rank=0))
    plain = PendingWork("airflow/d/p/run/1/-1", QUARTER, NOW)
    cycle = _cycle([owned, member, plain])
    assert prefetch_request(_Core(frozenset()), cycle, [plain], []) is None  # type: ignore[arg-type]
    none_closed = replace(cycle, snapshot=cycle.snapshot.with_closed(()))
    assert prefetch_request(_Core(frozenset({"a1"})), none_closed, [plain], []) is None  # type: ignore[arg-type]
    core = _Core(frozenset({"a1"}))
    assert prefetch_request(core, cycle, [owned, member], []) is None  # type: ignore[arg-type]
    second = prefetch_request(core, cycle, [owned, member, plain], [])  # type: ignore[arg-type]
    assert second is not None and [w.key for w in second[0].pending] == [plain.key]
