"""Hard constraints and the rejection reasons they produce."""

from __future__ import annotations

from dataclasses import replace

from _placement_support import no_quota

from gpusched.model import MILLI, DeviceShare, FleetSnapshot, Health
from gpusched.placement import PendingTask, Policy, place
from gpusched.request import GPURequest
from gpusched.testing import make_node

GIB = 1024**3


def _task(key: str = "t", **kwargs: object) -> PendingTask:
    return PendingTask(key, GPURequest.from_dict(kwargs), 0.0)


def _one(snapshot: FleetSnapshot, task: PendingTask, policy: str = "gpusched"):  # type: ignore[no-untyped-def]
    plan = place(no_quota([task], snapshot, Policy.named(policy), now=0.0))
    assert len(plan.assignments) + len(plan.rejections) == 1
    return plan


def test_model_absent_from_fleet_is_a_permanent_rejection_naming_the_request() -> None:
    snap = FleetSnapshot((make_node("n1", "T4", 2),))
    plan = _one(snap, _task(gpus=1, model="H100"))
    (rej,) = plan.rejections
    assert rej.permanent
    assert "H100-SXM-80GB" in rej.reason and "no device in the fleet matches" in rej.reason


def test_memory_larger_than_every_matching_device_is_permanent() -> None:
    snap = FleetSnapshot((make_node("n1", "A100-PCIE-40GB", 2), make_node("n2", "T4", 2)))
    plan = _one(snap, _task(gpus=1, memory="60GiB", vendor="nvidia"))
    (rej,) = plan.rejections
    assert rej.permanent
    assert "60 GiB" in rej.reason and "4 matching devices" in rej.reason


def test_min_arch_filters_older_architectures() -> None:
    snap = FleetSnapshot((make_node("old", "V100-SXM2-32GB", 2), make_node("new", "A100-SXM-80GB", 2)))
    plan = _one(snap, _task(gpus=1, min_arch="sm_80"))
    assert plan.assignments[0].shares[0].node == "new"
    plan = _one(snap, _task(gpus=1, min_arch="sm_90"))
    assert plan.rejections[0].permanent


def test_labels_must_match() -> None:
    snap = FleetSnapshot(
        (make_node("a", "T4", 1, labels={"zone": "a"}), make_node("b", "T4", 1, labels={"zone": "b"}))
    )
    plan = _one(snap, _task(gpus=1, labels={"zone": "b"}))
    assert plan.assignments[0].shares[0].node == "b"


def test_fractions_only_on_models_with_partitioning_unless_the_policy_allows() -> None:
    snap = FleetSnapshot((make_node("k", "K80", 2),))  # K80: no MPS/MIG in the catalog
    task = _task(gpus=0.5, memory="2GiB")
    (rej,) = _one(snap, task).rejections
    assert rej.permanent and "supports sharing" in rej.reason
    plan = place(no_quota([task], snap, Policy.named("gpusched", fractions_need_partitioning=False), now=0.0))
    assert plan.assignments[0].shares[0].milli == 500


def test_reason_counts_cordoned_unhealthy_and_busy_devices() -> None:
    node = make_node("n1", "A100-PCIE-40GB", 4)
    devs = list(node.devices)
    devs[0] = replace(devs[0], cordoned=True)
    devs[1] = replace(devs[1], health=Health.UNHEALTHY)
    snap = FleetSnapshot((replace(node, devices=tuple(devs)),))
    snap = snap.with_usage([DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes) for d in devs[2:]])
    (rej,) = _one(snap, _task(gpus=1, model="A100-40GB")).rejections
    assert not rej.permanent
    assert "2 matching devices in service, 2 busy" in rej.reason
    assert "1 unhealthy" in rej.reason and "1 cordoned" in rej.reason


def test_standby_and_cordoned_nodes_take_no_work() -> None:
    snap = FleetSnapshot(
        (
            replace(make_node("standby", "T4", 2), standby=True),
            replace(make_node("cordoned", "T4", 2), cordoned=True),
            make_node("ok", "T4", 2),
        )
    )
    plan = place(no_quota([_task(f"t{i}", gpus=1) for i in range(3)],
        snap, Policy.named("first-fit"), now=0.0))
    assert {a.shares[0].node for a in plan.assignments} == {"ok"}
    assert len(plan.rejections) == 1
    assert "on standby nodes" in plan.rejections[0].reason


def test_degraded_devices_are_used_last() -> None:
    node = make_node("n1", "T4", 2)
    devs = (replace(node.devices[0], health=Health.DEGRADED), node.devices[1])
    snap = FleetSnapshot((replace(node, devices=devs),))
    plan = _one(snap, _task(gpus=1))
    assert plan.assignments[0].shares[0].index == 1


def test_island_reason_names_the_largest_free_island() -> None:
    node = make_node("n1", "A100-SXM-80GB", 8)  # two NVLink islands of 4
    busy = [node.devices[i] for i in (0, 1, 4, 5)]
    snap = FleetSnapshot((node,)).with_usage(
        [DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes) for d in busy]
    )
    (rej,) = _one(snap, _task(gpus=4, interconnect="island", memory="80GiB")).rejections
    assert not rej.permanent
    assert "needs 4 NVLink/xGMI/HCCS-connected GPUs with ≥80 GiB free" in rej.reason
    assert "largest free island: 2" in rej.reason


def test_island_larger_than_any_in_the_fleet_is_permanent() -> None:
    snap = FleetSnapshot((make_node("n1", "A100-SXM-80GB", 8),))
    (rej,) = _one(snap, _task(gpus=8, interconnect="island")).rejections
    assert rej.permanent and "largest matching island in the fleet has 4" in rej.reason


def test_closed_nodes_count_as_cordoned_in_every_eligibility() -> None:
    # A snapshot's closed nodes (busy worker slots) are placed as cordoned nodes are: each
    # eligibility equals the one on the fleet with those nodes cordoned (masks and counts), on a
    # fleet with MIG instances, compute partitions, a standby node, a cordoned and an unhealthy
    # device; the index is the inventory's own either way.
    import itertools

    from gpusched.fleetfile import load_fleet
    from gpusched.hardware.simulated import default_fleet_path
    from gpusched.placement.filter import eligibility
    from gpusched.placement.index import fleet_index

    nodes = list(load_fleet(default_fleet_path()))
    first = nodes[0]
    broken = (replace(first.devices[0], cordoned=True), replace(first.devices[1], health=Health.UNHEALTHY))
    nodes[0] = replace(first, devices=(*broken, *first.devices[2:]))
    fleet = FleetSnapshot(tuple(nodes))
    requests = [GPURequest.build(gpus=1), GPURequest.build(gpus=2, vendor="nvidia"),
                GPURequest.build(gpus=0.25, memory="8GiB"),
                GPURequest.build(gpus=0.25, memory="8GiB", isolation="hard"),
                GPURequest.build(gpus=0.1, memory="16GiB", profile="CPX")]
    names = ["a-h100-1", "a-a100mig-1", "a-h100-2", "b-mi300x-cpx-1", "b-t4-1"]
    for size in (1, 2, 3):
        for shut in itertools.combinations(names, size):
            closed = fleet.with_closed(shut)
            cordoned = fleet.with_nodes([replace(fleet.node(n), cordoned=True) for n in shut])
            assert fleet_index(closed) is fleet_index(fleet)
            for request in requests:
                frac = request.milli_per_gpu < MILLI
                got = eligibility(fleet_index(closed), request, fractional=frac,
                                  fractions_need_partitioning=True, closed=closed.closed)
                want = eligibility(fleet_index(cordoned), request, fractional=frac,
                                   fractions_need_partitioning=True)
                for name in ("hardware", "usable", "healthy"):
                    assert (getattr(got, name) == getattr(want, name)).all(), (shut, request, name)
                counts = ("n_kind", "n_memory", "n_hardware", "n_unhealthy", "n_cordoned", "n_standby",
                          "n_usable", "largest_slice_milli")
                assert [getattr(got, c) for c in counts] == [getattr(want, c) for c in counts], shut
