"""The executor's pure decision step on the default simulated fleet."""

from __future__ import annotations

import json

import pytest

from gpusched.hardware.simulated import SimulatedBackend, default_fleet_path
from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.placement import Policy
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide, running_tasks

NO_QUOTA = QuotaState.unlimited()


@pytest.fixture(scope="module")
def fleet() -> FleetSnapshot:
    backend = SimulatedBackend(default_fleet_path())
    return FleetSnapshot(tuple(n for n in backend.discover() if not n.standby), source="simulated")


def _req(**kwargs: object) -> GPURequest:
    return GPURequest.build(**kwargs)


def test_launches_carry_shares_and_env_and_holds_carry_reasons(fleet: FleetSnapshot) -> None:
    pending = [
        PendingWork("train", _req(gpus=4, vendor="nvidia", interconnect="island", memory="40GiB"), 1.0),
        PendingWork("ft-a", _req(gpus=0.5, memory="16GiB", vendor="nvidia"), 2.0),
        PendingWork("ft-b", _req(gpus=0.5, memory="16GiB", vendor="nvidia"), 2.0),
        PendingWork("huge", _req(gpus=16, vendor="nvidia", interconnect="island"), 3.0),
    ]
    decision = decide(CycleRequest(tuple(pending), fleet, Policy.named("gpusched"), (), 10.0, NO_QUOTA))
    keys = [launch.key for launch in decision.launches] + [hold.key for hold in decision.holds]
    assert sorted(keys) == sorted(w.key for w in pending)  # every key exactly once

    launches = {launch.key: launch for launch in decision.launches}
    train = launches["train"]
    devices = [fleet.device(s.uuid) for s in train.shares]
    assert len({d.node for d in devices}) == 1 and len({d.island for d in devices}) == 1
    assert train.env["CUDA_VISIBLE_DEVICES"] == ",".join(str(s.index) for s in train.shares)
    assert json.loads(train.env["GPUSCHED_ALLOCATION"])["key"] == "train"

    a, b = launches["ft-a"], launches["ft-b"]
    assert a.shares[0].uuid == b.shares[0].uuid  # packed onto one device
    assert a.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"

    (hold,) = decision.holds
    assert hold.key == "huge" and hold.permanent and "16" in hold.reason


def test_waits_with_a_reason_when_the_fleet_is_full(fleet: FleetSnapshot) -> None:
    full = fleet.with_usage(
        DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes) for d in fleet.devices()
    )
    work = (PendingWork("t", _req(gpus=1), 1.0),)
    decision = decide(CycleRequest(work, full, Policy.named("first-fit"), (), 5.0, NO_QUOTA))
    assert decision.launches == ()
    (hold,) = decision.holds
    assert not hold.permanent and hold.reason


def test_existing_allocation_is_reused_not_placed_again(fleet: FleetSnapshot) -> None:
    device = next(d for d in fleet.devices() if d.model == "T4")
    share = DeviceShare(device.uuid, device.node, device.index, MILLI, device.memory_bytes)
    used = fleet.with_usage([share])  # the ledger counts the allocation as used
    work = PendingWork("again", _req(gpus=1), 1.0, existing=(share,))
    decision = decide(CycleRequest((work,), used, Policy.named("gpusched"), (), 2.0, NO_QUOTA))
    (launch,) = decision.launches
    assert launch.reused and launch.shares == (share,)


def test_running_tasks_from_allocations() -> None:
    from gpusched.ledger import Allocation

    share = DeviceShare("GPU-x", "n", 0, MILLI, 0)
    alloc = Allocation("k", _req(gpus=1, expected_duration="1h"), (share,), "h", 100.0, 700.0)
    (task,) = running_tasks([alloc])
    assert (task.key, task.started_at, task.expected_end, task.shares) == ("k", 100.0, 3700.0, (share,))
    alloc2 = Allocation("k2", _req(gpus=1), (share,), "h", 5.0, 9.0)
    assert running_tasks([alloc2])[0].expected_end is None


def test_genetic_replan_keeps_every_key_once_and_never_overbooks(fleet: FleetSnapshot) -> None:
    pending = [
        PendingWork(f"job-{i}", _req(gpus=g, vendor="nvidia", memory="16GiB"), float(i))
        for i, g in enumerate([1, 2, 4, 1, 2, 0.5, 0.5, 8, 1, 2])
    ]
    greedy = decide(CycleRequest(tuple(pending), fleet, Policy.named("gpusched"), (), 20.0, NO_QUOTA))
    replanned = decide(CycleRequest(tuple(pending), fleet, Policy.named("gpusched"), (), 20.0, NO_QUOTA,
                                   replan_budget_ms=60, seed=3))
    keys = [launch.key for launch in replanned.launches] + [hold.key for hold in replanned.holds]
    assert sorted(keys) == sorted(w.key for w in pending)
    # the optimiser keeps what greedy placed placed
    assert {launch.key for launch in greedy.launches} <= {launch.key for launch in replanned.launches}
    used: dict[str, int] = {}
    for launch in replanned.launches:
        for share in launch.shares:
            used[share.uuid] = used.get(share.uuid, 0) + share.milli
            assert fleet.device(share.uuid).vendor == "nvidia"
    assert all(total <= MILLI for total in used.values())


def test_a_task_that_only_a_standby_node_holds_waits_naming_that_node() -> None:
    """Before: the reason said '8 on standby nodes' but not which node would be switched on for it
    (the standby scale-out's choice), so an operator could not tell what the task waited for."""
    backend = SimulatedBackend(default_fleet_path())
    every = FleetSnapshot(tuple(backend.discover()), source="simulated")
    assert every.node("a-h100-2").standby
    h100 = every.node("a-h100-1")
    busy = every.with_usage(DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes) for d in h100.devices)
    want = _req(gpus=8, models=["H100-SXM-80GB"], interconnect="same_node")
    (hold,) = decide(CycleRequest((PendingWork("t", want, 1.0),), busy, Policy.named("gpusched"), (), 5.0,
                                  NO_QUOTA)).holds
    assert not hold.permanent
    assert "standby node a-h100-2 would make it fit" in hold.reason, hold.reason
    # No standby node holds it: nothing named.
    (hold,) = decide(CycleRequest((PendingWork("t", _req(gpus=8, models=["L40S"]), 1.0),), busy,
                                  Policy.named("gpusched"), (), 5.0, NO_QUOTA)).holds
    assert "standby node" not in hold.reason, hold.reason


def test_a_works_placement_view_is_made_once_and_follows_every_rewrite() -> None:
    from dataclasses import replace

    work = PendingWork("w", GPURequest(count=2, job_type="bert"), 5.0, rank=1.5, cpu_milli=300)
    task = work.task()
    assert work.task() is task  # kept: a replay asks for it every pass
    assert (task.key, task.request, task.submitted_at, task.rank, task.job_type, task.cpu_milli) == (
        "w", work.request, 5.0, 1.5, "bert", 300)
    ranked = work.with_rank(3.0)
    longer = replace(work, request=GPURequest(count=2, expected_duration_s=60.0, job_type="bert"))
    assert ranked.task().rank == 3.0 and longer.task().request is longer.request  # never the old view
    assert ranked == PendingWork("w", work.request, 5.0, rank=3.0, cpu_milli=300)  # the memo is no field
