"""The engine: packing, plan invariants, priorities, reservations/backfill, heterogeneity, baselines."""

from __future__ import annotations

import random

import numpy as np
import pytest
from _placement_support import no_quota, no_quota_on

from gpusched.errors import PlacementError
from gpusched.model import MILLI, DeviceShare, FleetSnapshot
from gpusched.node_builder import make_node
from gpusched.placement import (
    PendingTask,
    PlacementRequest,
    Placer,
    Policy,
    QueueOrder,
    RunningTask,
    WorkloadShape,
    place,
)
from gpusched.placement.index import FreeState, fleet_index
from gpusched.placement.score import FragStats
from gpusched.placement.workload import Workload
from gpusched.request import GPURequest
from gpusched.testing import synthetic_fleet, synthetic_requests

GIB = 1024**3


def _task(key: str, submitted: float = 0.0, job_type: str | None = None, **kwargs: object) -> PendingTask:
    return PendingTask(key, GPURequest.from_dict(kwargs), submitted, job_type=job_type)


def _full(snap: FleetSnapshot, node: str, indexes: list[int]) -> list[DeviceShare]:
    return [
        DeviceShare(d.uuid, d.node, d.index, MILLI, d.memory_bytes)
        for d in snap.node(node).devices
        if d.index in indexes
    ]


def test_two_halves_share_one_device_and_memory_is_respected() -> None:
    snap = FleetSnapshot((make_node("n", "A100-PCIE-40GB", 2),))
    tasks = [_task(f"h{i}", gpus=0.5, memory="16GiB") for i in range(2)]
    plan = place(no_quota(tasks, snap, Policy.named("gpusched"), now=0.0))
    devices = {a.shares[0].uuid for a in plan.assignments}
    assert len(plan.assignments) == 2 and len(devices) == 1
    assert all(a.shares[0].milli == 500 and a.shares[0].memory_bytes == 16 * GIB for a in plan.assignments)
    # 0.25 with 30 GiB cannot join the shared device (only 8 GiB left there): it takes the other.
    plan = place(no_quota([*tasks, _task("q", gpus=0.25, memory="30GiB")],
        snap, Policy.named("gpusched"), now=0.0))
    q = plan.assignment("q")
    assert q is not None and q.shares[0].uuid not in devices


def test_memory_bound_fractions_do_not_overcommit() -> None:
    snap = FleetSnapshot((make_node("n", "T4", 1),))  # 16 GiB
    tasks = [_task(f"f{i}", gpus=0.1, memory="6GiB") for i in range(3)]
    plan = place(no_quota(tasks, snap, Policy.named("best-fit"), now=0.0))
    assert len(plan.assignments) == 2
    assert "waiting for 0.1 of a GPU with ≥6 GiB free: 1 matching devices" in plan.rejections[0].reason


@pytest.mark.parametrize("name", Policy.names())
def test_plans_never_double_book_on_random_fleets(name: str) -> None:
    rng = random.Random(7)
    for trial in range(6):
        snap = synthetic_fleet(rng.randint(3, 12), gpus_per_node=rng.choice((2, 4, 8)), seed=trial)
        pending = synthetic_requests(rng.randint(5, 40), seed=trial + 100)
        pending.append(pending[0])  # a duplicate key is planned once
        plan = place(no_quota(pending, snap, Policy.named(name), now=0.0, seed=trial))
        keys = [a.key for a in plan.assignments] + [r.key for r in plan.rejections]
        assert sorted(keys) == sorted({t.key for t in pending})
        used = {u: (v.used_milli, v.used_memory_bytes) for u, v in snap.usage.items()}
        for a in plan.assignments:
            req = next(t.request for t in pending if t.key == a.key)
            assert len(a.shares) == req.count and len({s.uuid for s in a.shares}) == req.count
            for s in a.shares:
                milli, mem = used.get(s.uuid, (0, 0))
                used[s.uuid] = (milli + s.milli, mem + s.memory_bytes)
        for uuid, (milli, mem) in used.items():
            assert milli <= MILLI and mem <= snap.device(uuid).memory_bytes


def test_priority_then_submission_order() -> None:
    snap = FleetSnapshot((make_node("n", "T4", 1),))
    tasks = [
        _task("old-normal", 0.0, gpus=1),
        _task("new-high", 50.0, gpus=1, priority="high"),
        _task("newer-normal", 60.0, gpus=1),
    ]
    plan = place(no_quota(tasks, snap, Policy.named("gpusched"), now=100.0))
    assert [a.key for a in plan.assignments] == ["new-high"]
    snap2 = FleetSnapshot((make_node("n", "T4", 2),))
    plan = place(no_quota(tasks, snap2, Policy.named("gpusched"), now=100.0))
    assert [a.key for a in plan.assignments] == ["new-high", "old-normal"]


def test_aging_lets_a_long_waiting_task_overtake() -> None:
    snap = FleetSnapshot((make_node("n", "T4", 1),))
    tasks = [_task("waited", 0.0, gpus=1, priority=40), _task("fresh", 36_000.0, gpus=1, priority=50)]
    assert place(no_quota(tasks, snap, Policy.named("gpusched"), now=36_000.0)).assignments[0].key == "fresh"
    aged = Policy.named("gpusched", aging_per_hour=2.0)
    assert place(no_quota(tasks, snap, aged, now=36_000.0)).assignments[0].key == "waited"


def _reservation_fleet() -> tuple[FleetSnapshot, list[RunningTask]]:
    snap = FleetSnapshot((make_node("a", "H100-SXM-80GB", 8), make_node("b", "H100-SXM-80GB", 8)))
    running = [
        RunningTask("r-a", GPURequest.build(gpus=6), tuple(_full(snap, "a", list(range(6)))), 0.0, 1000.0),
        RunningTask("r-b", GPURequest.build(gpus=6), tuple(_full(snap, "b", list(range(6)))), 0.0, 5000.0),
    ]
    snap = snap.with_usage(s for r in running for s in r.shares)
    return snap, running


def test_critical_task_reserves_the_devices_that_free_up_first_and_short_tasks_backfill() -> None:
    snap, running = _reservation_fleet()
    tasks = [
        _task("critical", 10.0, gpus=8, priority="critical"),
        _task("long", 0.0, gpus=2, expected_duration="2h"),
        _task("short", 0.0, gpus=1, expected_duration="5m"),
        _task("unknown", 0.0, gpus=1),
    ]
    # FIFO within a priority, so "long" is planned before "unknown" takes a device on b.
    fifo = Policy.named("gpusched", queue_order=QueueOrder.FIFO)
    plan = place(no_quota(tasks, snap, fifo, now=100.0, running=running))
    (res,) = plan.reservations
    assert res.key == "critical" and res.start == 1000.0
    assert {s.node for s in res.shares} == {"a"}
    rej = plan.rejection("critical")
    assert rej is not None and "reserved 8 device(s) on a" in rej.reason
    # Node a's 2 free devices are held: only the short task (ends at 400 < 1000) may use them.
    placed = {a.key: {s.node for s in a.shares} for a in plan.assignments}
    assert placed["long"] == {"b"}
    assert placed["short"] == {"a"}
    assert "unknown" not in placed
    assert "held for a reservation" in (plan.rejection("unknown") or plan.rejections[0]).reason


def test_baselines_do_not_reserve() -> None:
    snap, running = _reservation_fleet()
    tasks = [_task("critical", 10.0, gpus=8, priority="critical"), _task("long", 0.0, gpus=2)]
    plan = place(no_quota(tasks, snap, Policy.named("first-fit"), now=100.0, running=running))
    assert not plan.reservations and plan.assignment("long") is not None


def test_heterogeneity_uses_the_throughput_table() -> None:
    snap = FleetSnapshot((make_node("v", "V100-SXM2-32GB", 1), make_node("p", "P100-PCIE-16GB", 1)))
    table = {
        "lm": {"V100-SXM2-32GB": 1.0, "P100-PCIE-16GB": 0.4},
        "a3c": {"V100-SXM2-32GB": 1.0, "P100-PCIE-16GB": 1.1},
    }
    policy = Policy.named("gpusched", throughput=table)
    plan = place(no_quota([_task("j", job_type="lm", gpus=1)], snap, policy, now=0.0))
    assert plan.assignments[0].shares[0].node == "v"
    plan = place(no_quota([_task("j", job_type="a3c", gpus=1)], snap, policy, now=0.0))
    assert plan.assignments[0].shares[0].node == "p"


def test_catalog_speed_applies_to_timed_jobs() -> None:
    snap = FleetSnapshot((make_node("t4", "T4", 1), make_node("h", "H100-SXM-80GB", 1)))
    plan = place(no_quota([_task("j", gpus=1, expected_duration="1h")],
        snap, Policy.named("gpusched"), now=0.0))
    assert plan.assignments[0].shares[0].node == "h"


def test_first_fit_takes_the_first_node_and_rounds_fractions_up() -> None:
    snap = FleetSnapshot((make_node("a", "T4", 2), make_node("b", "T4", 2)))
    snap = snap.with_usage(_full(snap, "a", [0]))
    plan = place(no_quota([_task("x", gpus=0.25, memory="1GiB")], snap, Policy.named("first-fit"), now=0.0))
    share = plan.assignments[0].shares[0]
    assert (share.node, share.index, share.milli) == ("a", 1, MILLI)


def test_best_fit_takes_the_fullest_node() -> None:
    snap = FleetSnapshot((make_node("a", "T4", 4), make_node("b", "T4", 4)))
    snap = snap.with_usage(_full(snap, "b", [0, 1]))
    plan = place(no_quota([_task("x", gpus=1)], snap, Policy.named("best-fit"), now=0.0))
    assert plan.assignments[0].shares[0].node == "b"


def test_random_is_seeded() -> None:
    snap = synthetic_fleet(20, seed=4)
    pending = synthetic_requests(10, seed=5)
    one = place(no_quota(pending, snap, Policy.named("random"), now=0.0, seed=1))
    two = place(no_quota(pending, snap, Policy.named("random"), now=0.0, seed=1))
    other = place(no_quota(pending, snap, Policy.named("random"), now=0.0, seed=2))
    assert one == two and one != other


def test_unknown_policy_name_lists_the_known_ones() -> None:
    from gpusched.errors import PlacementError

    with pytest.raises(PlacementError, match="first-fit"):
        Policy.named("fifo")


def _naive_fragmentation(free: list[int], shapes: tuple[WorkloadShape, ...]) -> float:
    total = sum(s.weight for s in shapes)
    out = 0.0
    for s in shapes:
        if s.milli >= MILLI:
            fits = sum(f >= MILLI for f in free) >= s.count
            frag = sum(f for f in free if f < MILLI)
        else:
            fits = any(f >= s.milli for f in free)
            frag = sum(f for f in free if f < s.milli)
        out += s.weight / total * (frag if fits else sum(free))
    return out


def test_fragmentation_deltas_match_the_definition() -> None:
    shapes = (
        WorkloadShape(1, MILLI, 0.3),
        WorkloadShape(1, 460, 0.2),
        WorkloadShape(1, 100, 0.1),
        WorkloadShape(2, MILLI, 0.1),
        WorkloadShape(8, MILLI, 0.1),
        WorkloadShape(1, 700, 0.2),
    )
    snap = synthetic_fleet(12, seed=3, used_fraction=0.6)
    index = fleet_index(snap)
    stats = FragStats(index, FreeState(index, snap), Workload.of(shapes))
    for n in range(len(index.nodes)):
        devs = list(index.node_devices(n))
        free = [MILLI - snap.used(index.devices[d].uuid).used_milli for d in devs]
        base = _naive_fragmentation(free, shapes)
        assert stats.node_fragmentation(np.array([n]))[0] == pytest.approx(base)
        for j, d in enumerate(devs):
            for m in (100, 460, 1000):
                if free[j] >= m:
                    after = free.copy()
                    after[j] -= m
                    got = stats.delta_fraction(np.array([d]), m, np.array([free[j]]))[0]
                    assert got == pytest.approx(_naive_fragmentation(after, shapes) - base)
        full = [j for j, f in enumerate(free) if f >= MILLI]
        for k in (1, 2):
            if len(full) >= k:
                after = free.copy()
                for j in full[:k]:
                    after[j] = 0
                got = stats.delta_whole(np.array([n]), k)[0]
                assert got == pytest.approx(_naive_fragmentation(after, shapes) - base)


def test_fgd_packs_small_fractions_onto_broken_devices() -> None:
    snap = FleetSnapshot((make_node("a", "T4", 2), make_node("b", "T4", 2)))
    half = snap.node("b").devices[0]
    snap = snap.with_usage([DeviceShare(half.uuid, "b", 0, 700, 2 * GIB)])
    plan = place(no_quota([_task("s", gpus=0.2, memory="1GiB")], snap, Policy.named("fgd"), now=0.0))
    assert plan.assignments[0].shares[0].uuid == half.uuid


def test_host_cpu_and_memory_are_respected() -> None:
    snap = FleetSnapshot((make_node("small", "T4", 2, cpu_milli=4000), make_node("big", "T4", 2)))
    task = PendingTask("t", GPURequest.build(gpus=1), 0.0, cpu_milli=8000, host_memory_bytes=GIB)
    plan = place(no_quota([task], snap, Policy.named("first-fit"), now=0.0))
    assert plan.assignments[0].shares[0].node == "big"
    hog = PendingTask("h", GPURequest.build(gpus=1), 0.0, cpu_milli=200_000)
    assert "CPU cores" in place(no_quota([hog], snap, Policy.named("gpusched"), now=0.0)).rejections[0].reason


def test_placer_keeps_state_between_calls_and_commit_false_leaves_it() -> None:
    snap = FleetSnapshot((make_node("n", "T4", 2),))
    placer = Placer(snap, Policy.named("gpusched"))
    trial = placer.place(no_quota_on(placer, [_task("a", gpus=2)], now=0.0), commit=False)
    assert trial.assignments and placer.free_milli("n-gpu0") == MILLI
    first = placer.place(no_quota_on(placer, [_task("a", gpus=1)], now=0.0))
    second = placer.place(no_quota_on(placer, [_task("b", gpus=1)], now=0.0))
    third = placer.place(no_quota_on(placer, [_task("c", gpus=1)], now=0.0))
    assert first.assignments and second.assignments and third.rejections
    placer.release(first.assignments[0].shares)
    assert placer.place(no_quota_on(placer, [_task("c", gpus=1)], now=0.0)).assignments


def test_a_request_needs_its_quota_and_a_kept_engine_only_takes_its_own_fleet() -> None:
    snap = FleetSnapshot((make_node("n", "T4", 2),))
    policy = Policy.named("gpusched")
    with pytest.raises(TypeError, match="quota"):
        PlacementRequest(pending=(), snapshot=snap, policy=policy, now=0.0)  # type: ignore[call-arg]
    placer = Placer(snap, policy)
    other = FleetSnapshot((make_node("m", "T4", 2),))
    with pytest.raises(PlacementError, match="another fleet snapshot or policy"):
        placer.place(no_quota([_task("a", gpus=1)], other, policy, now=0.0))
    with pytest.raises(PlacementError, match="another fleet snapshot or policy"):
        placer.place(no_quota([_task("a", gpus=1)], snap, Policy.named("first-fit"), now=0.0))
    # An equal policy built anew is the same policy.
    assert placer.place(no_quota([_task("a", gpus=1)], snap, Policy.named("gpusched"), now=0.0)).assignments


def test_keep_order_decodes_the_given_order() -> None:
    snap = FleetSnapshot((make_node("n", "T4", 1),))
    tasks = [_task("hi", gpus=1, priority="high"), _task("lo", gpus=1, priority="low")]
    placer = Placer(snap, Policy.named("gpusched"))
    plan = placer.place(no_quota_on(placer, list(reversed(tasks)), now=0.0), keep_order=True, commit=False)
    assert [a.key for a in plan.assignments] == ["lo"]


def test_cpu_only_work_goes_where_it_fragments_least() -> None:
    # Shapes need 1 GPU + 8 cores. Node "full" has no free GPU, so CPU taken there costs nothing;
    # on "free" it would strand GPUs. Host-aware FGD puts a CPU-only task on "full".
    snap = FleetSnapshot((make_node("free", "T4", 2, cpu_milli=16_000), make_node("full", "T4", 2)))
    snap = snap.with_usage(_full(snap, "full", [0, 1]))
    policy = Policy.named("fgd", workload=(WorkloadShape(1, MILLI, 1.0, cpu_milli=8000),))
    placer = Placer(snap, policy)
    assert placer.choose_host_node(12_000, 0) == "full"
    placer.take_host("free", 12_000, 0)
    assert placer.host_free("free")[0] == 4000
    # Now "free" cannot host a shape's 8 cores: both its GPUs count as fragmented.
    assert placer.stats.node_fragmentation(np.array([0]))[0] == pytest.approx(2 * MILLI)
    task = PendingTask("t", GPURequest.build(gpus=1), 0.0, cpu_milli=8000)
    assert placer.place(no_quota_on(placer, [task], now=0.0)).rejections
    placer.take_host("free", 12_000, 0, release=True)
    assert placer.place(no_quota_on(placer, [task], now=0.0)).assignments


def test_cpu_only_work_can_be_judged_by_its_own_shapes() -> None:
    # GPU shapes need 100 GiB of host RAM. A 64 GiB CPU-only task on "small" (128 GiB) would
    # strand its GPUs for them; on "big" (512 GiB) it strands nothing.
    snap = FleetSnapshot((
        make_node("small", "T4", 2, memory_bytes=128 * GIB),
        make_node("big", "T4", 2, memory_bytes=512 * GIB),
    ))
    with_ram = (WorkloadShape(1, MILLI, 1.0, cpu_milli=1000, host_memory_bytes=100 * GIB),)
    without_ram = (WorkloadShape(1, MILLI, 1.0, cpu_milli=1000),)
    by_ram = Placer(snap, Policy.named("fgd-memory", workload=with_ram))
    assert by_ram.choose_host_node(1000, 64 * GIB) == "big"
    # host_task_workload: the CPU-only decision ignores RAM (equal scores: the first node) ...
    placer = Placer(snap, Policy.named("fgd-memory", workload=with_ram, host_task_workload=without_ram))
    assert placer.choose_host_node(1000, 64 * GIB) == "small"
    # ... while GPU decisions still count it: after the task, "small" is fragmented for them.
    placer.take_host("small", 1000, 64 * GIB)
    assert placer.stats.node_fragmentation(np.array([0]))[0] == pytest.approx(2 * MILLI)
    assert placer.host_stats.node_fragmentation(np.array([0]))[0] == pytest.approx(0.0)
    plan = placer.place(no_quota_on(placer, [PendingTask("g", GPURequest.build(gpus=1), 0.0,
                                                         host_memory_bytes=100 * GIB)], now=0.0))
    assert plan.assignments[0].shares[0].node == "big"
    # Both aggregates follow every change, as if built afresh from the state.
    for stats, shapes in ((placer.stats, with_ram), (placer.host_stats, without_ram)):
        fresh = FragStats(placer.index, placer.state, Workload.of(shapes))
        assert np.allclose(stats.expected, fresh.expected)
    # A plan that is not committed leaves both as they were.
    before = placer.host_stats.expected.copy()
    trial = no_quota_on(placer, [PendingTask("h", GPURequest.build(gpus=2), 0.0)], now=0.0)
    placer.place(trial, commit=False)
    assert np.array_equal(placer.host_stats.expected, before)


def test_a_refusal_holds_for_tasks_alike_but_for_owner_and_duration() -> None:
    """On a fleet with two free devices on different nodes, every task asking for two same-node
    GPUs is refused, whatever its tenant, priority, partition or duration, with the reason
    placing it alone gives (the engine reuses a refusal for tasks alike but for those)."""
    snap = FleetSnapshot((make_node("a", "A100-PCIE-40GB", 4), make_node("b", "A100-PCIE-40GB", 4)))
    snap = snap.with_usage([*_full(snap, "a", [0, 1, 2]), *_full(snap, "b", [0, 1, 2])])
    owners = [{"tenant": "vision"}, {"tenant": "nlp", "priority": 50}, {"partition": "burst"},
              {"tenant": "nlp", "expected_duration": "2h"}, {}]
    tasks = [_task(f"t{n}", float(n), gpus=2, **owner) for n, owner in enumerate(owners)]
    policy = Policy.named("gpusched")
    plan = place(no_quota(tasks, snap, policy, now=10.0))
    assert not plan.assignments
    alone = {t.key: place(no_quota([t], snap, policy, now=10.0)).rejections[0].reason for t in tasks}
    assert {r.key: r.reason for r in plan.rejections} == alone
    assert len(set(alone.values())) == 1
    # One of them asks for one GPU instead: it is not alike, and it fits.
    plan = place(no_quota([*tasks, _task("one", 9.0, gpus=1, tenant="vision")], snap, policy, now=10.0))
    assert [a.key for a in plan.assignments] == ["one"]
