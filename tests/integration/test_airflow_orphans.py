"""Which allocations crash recovery releases (pure rules), and process liveness on this host."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from gpusched.airflow.orphans import TaskView, stale_reason
from gpusched.ledger.liveness import current_process, holders_alive, process_alive
from gpusched.records import Allocation, HolderProcess
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

KEY = ti_key("train", "step", "manual__1", 1)


def _alloc(key: str = KEY, processes: tuple[HolderProcess, ...] = ()) -> Allocation:
    return Allocation(key, GPURequest.build(gpus=1), (), "GPUExecutor@h", 0.0, 600.0, processes=processes)


@pytest.mark.parametrize(
    ("task", "alive", "expected"),
    [
        (TaskView(1, "running"), True, None),
        (TaskView(1, "queued"), None, None),
        (TaskView(2, "running"), True, "try 1 superseded by try 2"),
        (TaskView(1, "up_for_retry"), True, "task instance is up_for_retry"),
        (TaskView(1, "failed"), None, "task instance is failed"),
        (TaskView(1, None), None, "task instance is none"),
        (TaskView(1, "running"), False, "holder processes gone"),
        (None, True, "no longer exists"),
    ],
)
def test_stale_reason(task: TaskView | None, alive: bool | None, expected: str | None) -> None:
    reason = stale_reason(_alloc(), task, alive)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason and reason.startswith("reconciled: ")


def test_keys_that_are_not_airflow_tries_are_never_judged() -> None:
    assert stale_reason(_alloc("sim-job-7"), None, False) is None


def test_liveness_of_a_real_process_and_of_a_reused_pid() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        started = psutil.Process(child.pid).create_time()
        record = HolderProcess("worker", socket.gethostname(), child.pid, started)
        assert process_alive(record) is True and holders_alive([record]) is True
        reused = HolderProcess("worker", record.host, child.pid, record.started_at - 3600)
        assert process_alive(reused) is False  # same pid, another process
        elsewhere = HolderProcess("worker", "another-host", child.pid, record.started_at)
        assert process_alive(elsewhere) is None and holders_alive([elsewhere]) is None
    finally:
        child.kill()
        child.wait()
    assert process_alive(record) is False and holders_alive([record]) is False
    assert holders_alive([record, current_process("executor")]) is True
    assert holders_alive([]) is None
