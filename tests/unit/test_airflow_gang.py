"""Multi-node gangs: authoring expands into member tasks; a cycle places all members or none."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusched.airflow.gang import gang_task
from gpusched.errors import GPURequestError
from gpusched.gang import GANG_KEY, GangMember, gang_member, rendezvous_env
from gpusched.hardware.detect import detect_backend
from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.placement import Policy
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide

FLEETS = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets"

NO_QUOTA = QuotaState.unlimited()


def _fleet(name: str) -> FleetSnapshot:
    backend = detect_backend("simulated", fleet=FLEETS / name)
    return FleetSnapshot(tuple(backend.discover()))


def _members(size: int, per_node: int, scope: str = "same_rack", present: int | None = None,
             **request: object) -> list[PendingWork]:
    req = GPURequest.build(gpus=per_node, interconnect="same_node", **request)
    return [PendingWork(f"train__node{r}", req, 1.0, gang=GangMember("d/r/-1/train", size, r, scope))
            for r in range(size if present is None else present)]


def test_a_gang_lands_one_member_per_node_with_consistent_rendezvous() -> None:
    fleet = _fleet("multihost.yaml")
    members = _members(2, 1, vendor="nvidia")
    reply = decide(CycleRequest(tuple(members), fleet, Policy.named("gpusched"), (), 5.0, NO_QUOTA,
                                addresses={"host-a": "10.0.0.1", "host-b": "10.0.0.2"}))
    assert not reply.holds and len(reply.launches) == 2
    nodes = [launch.shares[0].node for launch in reply.launches]
    assert sorted(nodes) == ["host-a", "host-b"]
    envs = {launch.key: launch.env for launch in reply.launches}
    rank0 = next(launch for launch in reply.launches if launch.env["NODE_RANK"] == "0")
    master = {"host-a": "10.0.0.1", "host-b": "10.0.0.2"}[rank0.shares[0].node]
    for env in envs.values():
        assert env["MASTER_ADDR"] == master and env["WORLD_SIZE"] == "2" and env["NNODES"] == "2"
        assert env["LOCAL_WORLD_SIZE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert len({env["MASTER_PORT"] for env in envs.values()}) == 1
    assert sorted(env["NODE_RANK"] for env in envs.values()) == ["0", "1"]


def test_a_gang_that_does_not_fit_holds_every_member_with_the_reason() -> None:
    fleet = _fleet("multihost.yaml")
    too_big = _members(3, 1, vendor="nvidia")  # three nodes wanted, two exist
    reply = decide(CycleRequest(tuple(too_big), fleet, Policy.named("gpusched"), (), 5.0, NO_QUOTA))
    assert reply.launches == () and len(reply.holds) == 3
    assert all("only 2 of 3 members" in h.reason and h.permanent for h in reply.holds)
    partial = _members(2, 1, present=1, vendor="nvidia")
    reply = decide(CycleRequest(tuple(partial), fleet, Policy.named("gpusched"), (), 5.0, NO_QUOTA))
    assert reply.launches == () and "1 of 2 members queued" in reply.holds[0].reason


def test_same_rack_gangs_stay_in_one_rack() -> None:
    fleet = _fleet("small.yaml")  # r1: n1 (4 A100), n2 (2 T4); r2: n3 (MI300X), n4 (Ascend)
    reply = decide(CycleRequest(tuple(_members(2, 2)), fleet, Policy.named("gpusched"), (), 5.0, NO_QUOTA))
    racks = {fleet.node(launch.shares[0].node).rack for launch in reply.launches}
    assert len(reply.launches) == 2 and len(racks) == 1


def test_gang_task_validates_at_parse_time_and_membership_round_trips() -> None:
    with pytest.raises(GPURequestError, match="nodes"):
        gang_task(nodes=1, gpus_per_node=1)
    with pytest.raises(GPURequestError, match="interconnect"):
        gang_task(nodes=2, gpus_per_node=1, interconnect="island")
    config = {GANG_KEY: {"name": "train", "size": 2, "rank": 1, "scope": "any"}}
    member = gang_member(config, dag_id="d", run_id="r")
    assert member == GangMember("d/r/-1/train", 2, 1, "any")
    with pytest.raises(GPURequestError, match="gpusched_gang"):
        gang_member({GANG_KEY: {"name": "t", "size": 2, "rank": 2}}, dag_id="d", run_id="r")
    assert rendezvous_env(member, 4, "h")["WORLD_SIZE"] == "8"


def test_gang_task_expands_into_member_tasks() -> None:
    from airflow.sdk import dag

    @dag(dag_id="gang_expand", schedule=None)
    def gang_expand() -> None:
        @gang_task(nodes=3, gpus_per_node=2, models=["A100-SXM-80GB"], retries=2)
        def train() -> None:
            pass

        train()

    built = gang_expand()
    ids = sorted(built.task_ids)
    assert ids == ["train__node0", "train__node1", "train__node2"]
    task = built.get_task("train__node2")
    assert task.retries == 2
    assert task.executor_config[GANG_KEY] == {"name": "train", "size": 3, "rank": 2, "scope": "same_rack"}
    assert GPURequest.from_dict(task.executor_config["gpusched"]).count == 2


def test_a_gang_waits_as_a_whole_for_its_tenants_budget() -> None:
    from gpusched.quota.policy import UNITS_PER_A100_HOUR, QuotaPolicy

    fleet = _fleet("multihost.yaml")
    members = tuple(_members(2, 1, vendor="nvidia", tenant="vision"))
    spent = QuotaState(QuotaPolicy(budgets_hours={"vision": 10}, period_s=7 * 86400),
                       used={"vision": 10 * UNITS_PER_A100_HOUR})
    reply = decide(CycleRequest(members, fleet, Policy.named("gpusched"), (), 5.0, spent))
    assert reply.launches == () and len(reply.holds) == 2
    assert all(h.reason.startswith("tenant vision used 10.0 of 10.0 A100-h this week") for h in reply.holds)
    assert not any(h.permanent for h in reply.holds)
    fresh = QuotaState(spent.policy)
    assert len(decide(CycleRequest(members, fleet, Policy.named("gpusched"), (), 5.0, fresh)).launches) == 2


def test_a_gang_that_needs_the_standby_node_waits_for_it_and_says_how_many_fit() -> None:
    """Before: the example gang on the default fleet (one H100 node in service, one on standby)
    failed as never fitting, counting the members of the busy fleet as 'even when idle' and
    giving the reason of a rack without H100s ('no device in the fleet matches')."""
    from gpusched.capacity.prescale import activate_in_snapshot

    fleet = _fleet("default.yaml")
    gang = tuple(_members(2, 8, model="H100-SXM-80GB"))
    policy = Policy.named("gpusched")
    reply = decide(CycleRequest(gang, fleet, policy, (), 5.0, NO_QUOTA))
    assert reply.launches == () and len(reply.holds) == 2
    assert not any(h.permanent for h in reply.holds)
    assert reply.holds[0].reason == (
        "multi-node gang train: only 1 of 2 members fit on distinct nodes of one rack now (1 when idle); "
        "standby node a-h100-2 would make all 2 fit: waiting for the standby scale-out to switch it on")
    h100 = fleet.node("a-h100-1")
    busy = fleet.with_usage(DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes) for d in h100.devices)
    reason = decide(CycleRequest(gang, busy, policy, (), 5.0, NO_QUOTA)).holds[0].reason
    assert "only 0 of 2 members fit on distinct nodes of one rack now (1 when idle); standby node a-h100-2 " \
        "would make all 2 fit" in reason
    on = decide(CycleRequest(gang, activate_in_snapshot(fleet, ["a-h100-2"]), policy, (), 5.0, NO_QUOTA))
    assert sorted(launch.shares[0].node for launch in on.launches) == ["a-h100-1", "a-h100-2"]
    three = tuple(_members(3, 8, model="H100-SXM-80GB"))
    never = decide(CycleRequest(three, fleet, policy, (), 5.0, NO_QUOTA)).holds
    assert all(h.permanent for h in never)
    assert never[0].reason.startswith("multi-node gang train: only 2 of 3 members fit on distinct nodes of "
                                      "one rack even when idle with every standby node on: ")
    assert never[0].reason.endswith("each needs 8 same-node H100-SXM-80GB on a node of its own; at most 2 "
                                    "nodes of one rack hold that")
