"""GPUExecutor in-process under ledger faults: a frozen writer, one task's unexpected error.

The scheduler calls the executor's ``heartbeat`` (``trigger_tasks`` then ``sync``) every loop; here
the test calls the same two methods and times them while another process holds the SQLite
ledger's write lock and is frozen with SIGSTOP.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _airflow_support import queue_reading_executor
from test_airflow_executor import _drain, _key, _submit, _workload

pytestmark = [pytest.mark.airflow, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 1.0
FREEZER = """
import os, signal, sys
from gpusched.ledger import Ledger
from gpusched.ledger.engine import write_tx
with write_tx(Ledger(sys.argv[1]).engine) as conn:
    conn.exec_driver_sql("UPDATE gpusched_devices SET updated_at = updated_at")
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.fixture
def executor(airflow_db: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("AIRFLOW__GPUSCHED__LEDGER_WAIT_SECONDS", str(WAIT_S))
    monkeypatch.setenv("AIRFLOW__GPUSCHED__RECONCILE_SECONDS", "0")
    yield from queue_reading_executor(monkeypatch)


def test_frozen_ledger_writer_does_not_stall_the_heartbeat(executor: Any, tmp_path: Path) -> None:
    from airflow.utils.state import TaskInstanceState

    running = _workload("running", {"gpus": 1})
    _submit(executor, running)
    assert len(_drain(executor)) == 1 and executor.gpu_running
    script = tmp_path / "freezer.py"
    script.write_text(FREEZER)
    frozen = subprocess.Popen([sys.executable, str(script), executor.ledger.url], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert frozen.stdout is not None and frozen.stdout.readline().strip() == "locked"
        waiting = [_workload(f"w{i}", {"gpus": 1}) for i in range(3)]
        for w in waiting:
            executor.queue_workload(w, session=None)
        durations = []
        executor.gpu._last_renew = 0.0  # make this heartbeat renew leases (a write) too
        for _ in range(6):
            started = time.monotonic()
            executor.trigger_tasks(executor.parallelism)
            executor.sync()
            durations.append(time.monotonic() - started)
            time.sleep(0.3)
        # Each heartbeat gives up on the ledger within its bound; nothing was dispatched.
        assert max(durations) <= WAIT_S + 2.0, durations
        assert all(w.key in executor.queued_tasks for w in waiting) and _drain(executor) == []
        # A task ending meanwhile is not lost: its devices are released once the ledger is back.
        executor.change_state(running.key, TaskInstanceState.SUCCESS)
    finally:
        frozen.kill()
        frozen.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and executor.queued_tasks:
        executor.trigger_tasks(executor.parallelism)
        executor.sync()
        time.sleep(0.3)
    assert not executor.queued_tasks and len(_drain(executor)) == 3
    released = executor.ledger.get(_key(running))
    assert released is not None and not released.active


def test_one_tasks_unexpected_error_does_not_abort_the_others(
    executor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad, good = _workload("bad", {"gpus": 1}), _workload("good", {"gpus": 1})
    real_allocate = executor.ledger.allocate

    def allocate(key: str, *args: Any, **kwargs: Any) -> Any:
        if key == _key(bad):
            raise RuntimeError("injected: this one task's allocation blew up")
        return real_allocate(key, *args, **kwargs)

    monkeypatch.setattr(executor.ledger, "allocate", allocate)
    _submit(executor, bad, good)
    sent = [item[0].key for item in _drain(executor)]
    assert sent == [good.key]
    assert bad.key in executor.queued_tasks  # it stays queued and is offered again
