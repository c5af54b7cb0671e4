"""The GPU-time a task instance's earlier tries attained (``preemption = service``): only the
earlier tries of the same dag, task, run and map index count, each at its own request's GPUs; a
move's abandoned hold never ran; the sum is final once every earlier allocation is released."""

from __future__ import annotations

from gpusched.model import DeviceShare
from gpusched.records import Allocation
from gpusched.request import GPURequest
from gpusched.scheduler.attained import attained_before
from gpusched.scheduler.keys import ti_key

SHARE = (DeviceShare("u0", "n0", 0, 1000, 0),)
ONE, TWO, HALF = GPURequest.build(gpus=1), GPURequest.build(gpus=2), GPURequest.build(gpus=0.5, memory="8GiB")


def _alloc(key: str, request: GPURequest, start: float, end: float | None, reason: str = "x") -> Allocation:
    return Allocation(key, request, SHARE, "h", start, start + 600, end, reason if end is not None else None)


def test_earlier_tries_of_the_same_task_instance_count_at_their_own_gpus() -> None:
    key = ti_key("d", "t", "r/1", 3, 2)
    allocations = [
        _alloc(ti_key("d", "t", "r/1", 1, 2), TWO, 0.0, 100.0),  # 200 GPU-s
        _alloc(ti_key("d", "t", "r/1", 2, 2), HALF, 200.0, 400.0, "preempted; requeued"),  # 100 GPU-s
        _alloc(ti_key("d", "t", "r/1", 3, 2), ONE, 500.0, 900.0),  # the try itself
        _alloc(ti_key("d", "t", "r/1", 4, 2), ONE, 0.0, 50.0),  # a later try
        _alloc(ti_key("d", "t", "r/1", 1, 3), ONE, 0.0, 50.0),  # another map index
        _alloc(ti_key("d", "t", "r/2", 1, 2), ONE, 0.0, 50.0),  # another run
        _alloc(ti_key("d", "u", "r/1", 1, 2), ONE, 0.0, 50.0),  # another task
        _alloc("trace-job-7", ONE, 0.0, 50.0),  # not an Airflow try
    ]
    assert attained_before(key, allocations, now=1000.0) == (300.0, True)


def test_a_still_active_earlier_try_counts_until_now_and_is_not_final() -> None:
    key = ti_key("d", "t", "r", 2)
    total, final = attained_before(key, [_alloc(ti_key("d", "t", "r", 1), ONE, 100.0, None)], now=160.0)
    assert (total, final) == (60.0, False)


def test_an_abandoned_move_hold_never_ran() -> None:
    key = ti_key("d", "t", "r", 3)
    allocations = [_alloc(ti_key("d", "t", "r", 1), ONE, 0.0, 10.0),
                   _alloc(ti_key("d", "t", "r", 2), ONE, 5.0, 300.0, "migration abandoned: it did not start")]
    assert attained_before(key, allocations, now=400.0) == (10.0, True)
    assert attained_before(ti_key("d", "t", "r", 1), allocations, now=400.0) == (0.0, True)
    assert attained_before("trace-job-7", allocations, now=400.0) == (0.0, True)
