"""Waiting for a faster GPU type (pure): a typed job with an expected duration waits for a busy
fast device when it would finish sooner there than on a free slow one, and only then; the cycle
then leaves the slow device free; without a throughput table nothing changes."""

from __future__ import annotations

from dataclasses import replace

from gpusched.model import DeviceShare, FleetSnapshot
from gpusched.node_builder import SIM_LAYOUT, make_node
from gpusched.placement import PendingTask, Policy, RunningTask
from gpusched.placement.patience import hold_for_faster
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleRequest, PendingWork, decide

NOW = 10_000.0
V100, K80 = "V100-SXM2-16GB", "K80"
# steps/s: "cnn" runs 4x faster on a V100; "rec" nearly as fast on a K80 (0.9).
POLICY = Policy.named("gpusched", throughput={"cnn": {V100: 4.0, K80: 1.0}, "rec": {V100: 1.0, K80: 0.9}})
HOUR = 3600.0


def _fleet(v100: int, k80: int) -> FleetSnapshot:
    return FleetSnapshot((make_node("v", V100, v100, layout=SIM_LAYOUT, cpu_milli=0, memory_bytes=0),
                          make_node("k", K80, k80, layout=SIM_LAYOUT, cpu_milli=0, memory_bytes=0)))


def _busy_v100(index: int, ends_in_s: float | None, *, started: float = NOW - HOUR) -> RunningTask:
    share = DeviceShare(f"v/gpu{index}", "v", index, 1000, 0)
    end = None if ends_in_s is None else NOW + ends_in_s
    return RunningTask(f"run{index}", GPURequest.build(gpus=1), (share,), started, end)


def _job(key: str, job_type: str | None, hours: float, *, at: float = NOW - 60) -> PendingTask:
    request = GPURequest(count=1, expected_duration_s=int(hours * HOUR))
    return PendingTask(key, request, at, job_type=job_type)


def _decide(pending: list[PendingTask], running: list[RunningTask], policy: Policy = POLICY
            ) -> dict[str, str]:
    """Key → the model it launches on ('' when held)."""
    fleet = _fleet(1, 1).with_usage(s for r in running for s in r.shares)
    reply = decide(CycleRequest(
        pending=tuple(PendingWork(t.key, t.request, t.submitted_at, job_type=t.job_type) for t in pending),
        snapshot=fleet, policy=policy, now=NOW, quota=QuotaState.unlimited(), running=tuple(running)))
    out = dict.fromkeys((t.key for t in pending), "")
    for launch in reply.launches:
        out[launch.key] = fleet.device(launch.shares[0].uuid).model
    return out


def test_a_long_job_waits_for_a_fast_device_that_frees_soon() -> None:
    # 10 h on a V100 (40 h on the free K80); the V100 frees in 1 h: finishes at 11 h, not 40 h.
    running = [_busy_v100(0, HOUR)]
    (held,) = hold_for_faster([_job("a", "cnn", 10)], _fleet(1, 1).with_usage(running[0].shares), running,
                              POLICY, NOW)
    assert held.request.models == frozenset({V100})
    assert _decide([_job("a", "cnn", 10)], running) == {"a": ""}


def test_a_short_job_or_one_that_barely_gains_takes_the_free_slow_device() -> None:
    # 0.2 h on a V100 is 0.8 h on the K80, less than the 1 h wait; "rec" loses only 1.1 h there,
    # less than a 2 h wait (but more than a 1 h one).
    assert _decide([_job("short", "cnn", 0.2)], [_busy_v100(0, HOUR)]) == {"short": K80}
    assert _decide([_job("rec", "rec", 10)], [_busy_v100(0, 2 * HOUR)]) == {"rec": K80}
    assert _decide([_job("rec", "rec", 10)], [_busy_v100(0, HOUR)]) == {"rec": ""}


def test_jobs_ahead_in_the_queue_take_the_fast_slot_first() -> None:
    # The older 30 h job takes the V100 that frees in 1 h (until 31 h); the next 10 h job would
    # finish there at 41 h, on the free K80 at 40 h: it starts on the K80.
    running = [_busy_v100(0, HOUR)]
    plan = _decide([_job("old", "cnn", 30, at=NOW - 600), _job("new", "cnn", 10, at=NOW - 60)], running)
    assert plan == {"old": "", "new": K80}


def test_nothing_held_without_a_table_a_type_a_duration_or_an_expected_end() -> None:
    running = [_busy_v100(0, HOUR)]
    plain = Policy.named("gpusched")
    assert _decide([_job("a", "cnn", 10)], running, plain) == {"a": K80}
    assert _decide([_job("a", None, 10)], running) == {"a": K80}
    assert _decide([_job("a", "cnn", 0)], running) == {"a": K80}
    assert _decide([_job("a", "cnn", 10)], [_busy_v100(0, None)]) == {"a": K80}


def test_a_task_past_its_expected_end_is_expected_to_run_as_long_again() -> None:
    # Expected to end 1 s ago after 1 h of run: taken to free in 1 h (long job waits), but one
    # that has overrun by 100 h is taken to run 100 h more (it goes to the K80).
    fleet = _fleet(1, 1)
    recent = _busy_v100(0, -1.0)
    (held,) = hold_for_faster([_job("a", "cnn", 10)], fleet.with_usage(recent.shares), [recent], POLICY, NOW)
    assert held.request.models == frozenset({V100})
    stale = _busy_v100(0, -1.0, started=NOW - 100 * HOUR)
    (free,) = hold_for_faster([_job("a", "cnn", 10)], fleet.with_usage(stale.shares), [stale], POLICY, NOW)
    assert free.request.models == frozenset()


def test_a_held_job_says_it_waits_for_a_faster_type() -> None:
    running = [_busy_v100(0, HOUR)]
    fleet = _fleet(1, 1).with_usage(running[0].shares)
    job = _job("a", "cnn", 10)
    reply = decide(CycleRequest(
        pending=(PendingWork(job.key, job.request, job.submitted_at, job_type=job.job_type),),
        snapshot=fleet, policy=POLICY, now=NOW, quota=QuotaState.unlimited(), running=tuple(running)))
    (hold,) = reply.holds
    assert V100 in hold.reason and "held for a faster GPU type" in hold.reason, hold.reason
    assert not hold.permanent


def test_only_devices_placement_could_give_are_slots() -> None:
    # The V100's node is cordoned (e.g. its worker's slots are full): its free device is no slot,
    # nor is a busy one there. Counted as one, the first job would take it in the schedule and the
    # second be held for a V100 that no job can get.
    fleet = _fleet(1, 2)
    cordoned = fleet.with_nodes([replace(fleet.nodes[0], cordoned=True)])
    jobs = [_job("a", "cnn", 10, at=NOW - 600), _job("b", "cnn", 10, at=NOW - 60)]
    assert hold_for_faster(jobs, cordoned, [], POLICY, NOW) == tuple(jobs)
    busy = _busy_v100(0, HOUR)
    assert hold_for_faster(jobs[:1], cordoned.with_usage(busy.shares), [busy], POLICY, NOW) == tuple(jobs[:1])
    # in service, the same V100 holds the first job back (the control)
    (held,) = hold_for_faster(jobs[:1], fleet.with_usage(busy.shares), [busy], POLICY, NOW)
    assert held.request.models == frozenset({V100})
