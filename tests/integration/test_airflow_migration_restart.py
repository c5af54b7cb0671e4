"""Moves of ``[gpusched] preemption = migrate`` survive an executor restart, with a real SQLite
ledger: the move intent is in the ledger (``gpusched_moves``); a new executor core over the same
ledger (same holder) resumes it — the held target kept for the next try, the old try stopped after
its grace if this executor still runs it, the pin written again if it was missing — or abandons it
cleanly (hold released, pin removed) when its next try does not come or the mode is no longer
``migrate``. No device is ever held by two allocations at once.

``tests/system/test_airflow_executor_migration.py`` restarts the real ``GPUExecutor``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _core_support import StubCore
from _ledger_support import assert_whole_devices_never_shared

from gpusched.airflow import gpu_migration, gpu_preemption
from gpusched.airflow.gpu_migration import MIGRATION_REQUEUE_WAIT_S, Migrator
from gpusched.airflow.gpu_preemption import Preemptor
from gpusched.faults.failures import load_overrides
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare
from gpusched.node_builder import make_node
from gpusched.placement import Policy
from gpusched.request import GPURequest
from gpusched.scheduler.keys import ti_key

NOW = 50_000.0
RUN = "manual__r"
OLD, NEXT = ti_key("d", "big", RUN, 1), ti_key("d", "big", RUN, 2)
POLICY = Policy.named("gpusched", throughput={"big": {"A100-SXM-80GB": 10.0, "T4": 1.0}})
SETTINGS = {"preemption": "migrate", "preemption_grace_seconds": "20",
            "preemption_min_runtime_seconds": "60", "migration_interval_seconds": "360",
            "migration_restart_seconds": "60"}


class _Core(StubCore):
    def __init__(self, ledger: Ledger, **settings: str) -> None:
        super().__init__(ledger, {**SETTINGS, **settings})
        self.holder = "sched-1"
        self.process = None
        self.preemption = Preemptor(self)


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    cleared: list[Any] = []
    for module in (gpu_preemption, gpu_migration):
        monkeypatch.setattr(module, "append_task_log", lambda k, m, **kw: None)
        monkeypatch.setattr(module, "save_task_event", lambda ex, **kw: None)
    monkeypatch.setattr(gpu_preemption, "requeue", lambda key, reason: cleared.append(key) or "cleared")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.migrate()
    ledger.sync_inventory([make_node("fast", "A100-SXM-80GB", 1), make_node("slow", "T4", 1)], source="test")
    yield url, ledger, cleared
    ledger.close()


def _airflow_key(key: str) -> Any:
    from airflow.models.taskinstancekey import TaskInstanceKey

    from gpusched.scheduler.keys import parse_ti_key

    p = parse_ti_key(key)
    assert p is not None
    return TaskInstanceKey(p.dag_id, p.task_id, p.run_id, p.try_number, p.map_index)


def _moved_before_restart(ledger: Ledger) -> Migrator:
    """The first executor: "big" runs on the T4, the A100 is free; a round moves it (held)."""
    core = _Core(ledger)
    slow = ledger.snapshot().node("slow").devices[0]
    ledger.allocate(OLD, GPURequest.build(gpus=1, job_type="big"),
                    [DeviceShare(slow.uuid, "slow", 0, 1000, 0)], holder=core.holder, now=NOW - 3600)
    core.gpu_running[_airflow_key(OLD)] = OLD
    migrator = Migrator(core)
    (moving,) = migrator.consider(POLICY, NOW)
    assert moving.held and moving.next_key == NEXT
    (intent,) = ledger.moves("sched-1")
    assert (intent.old_key, intent.next_key, intent.to_model) == (OLD, NEXT, "A100-SXM-80GB")
    assert intent.request.models == frozenset({"A100-SXM-80GB"}) and intent.author.models == frozenset()
    return migrator


def _restarted(url: str, **settings: str) -> tuple[_Core, Migrator]:
    """A new executor over the same ledger, same holder (its own connections)."""
    core = _Core(Ledger(url), **settings)
    return core, Migrator(core)


def _pinned(ledger: Ledger) -> Any:
    return load_overrides(ledger).pinned("d", "big", RUN, 2)


def test_a_move_in_flight_completes_after_a_restart(setup: Any) -> None:
    url, ledger, cleared = setup
    _moved_before_restart(ledger)
    core, migrator = _restarted(url)
    # The old try still runs under the new executor (adopted): it is stopped after its grace.
    core.gpu_running[_airflow_key(OLD)] = OLD
    assert migrator.held_keys() == {NEXT}  # read back before the first reconcile: the hold is kept
    assert [e.subject for e in ledger.events(10, kinds=["migration_resumed"])] == [OLD]
    migrator.claim(NOW + 5)
    assert list(core.preemption.evictions) == [OLD]
    assert core.preemption.release_reason(OLD).startswith("moving to A100-SXM-80GB")  # type: ignore[union-attr]
    core.preemption.advance(NOW + 10)
    assert cleared == []  # within its grace
    core.preemption.advance(NOW + 21)
    assert [k.try_number for k in cleared] == [1]
    # It ends; the executor releases it; the next try is launched on the held A100.
    ledger.release(core.gpu_running.pop(_airflow_key(OLD)), reason="moving …; requeued", now=NOW + 25)
    migrator.claim(NOW + 25)
    held = ledger.get(NEXT)
    assert held is not None and held.active and held.shares[0].node == "fast"
    core.gpu_running[_airflow_key(NEXT)] = NEXT
    migrator.claim(NOW + 30)
    assert migrator.moving == {} and ledger.moves() == [] and _pinned(ledger) is None
    assert ledger.get(NEXT).created_at == held.created_at  # type: ignore[union-attr]
    assert_whole_devices_never_shared(ledger.history(0, 4e9))
    core.ledger.close()


def test_a_move_whose_next_try_never_comes_is_abandoned_after_a_restart(setup: Any) -> None:
    url, ledger, _ = setup
    _moved_before_restart(ledger)
    ledger.release(OLD, reason="reconciled: holder processes gone", now=NOW + 2)  # it died with the executor
    core, migrator = _restarted(url)
    migrator.claim(NOW + 100)  # resumed; the wait for the next try starts now (not when the old one died)
    assert set(migrator.moving) == {NEXT} and _pinned(ledger) is not None
    migrator.claim(NOW + 100 + MIGRATION_REQUEUE_WAIT_S)
    assert set(migrator.moving) == {NEXT}
    migrator.claim(NOW + 101 + MIGRATION_REQUEUE_WAIT_S)
    assert migrator.moving == {} and ledger.moves() == [] and _pinned(ledger) is None
    gone = ledger.get(NEXT)
    assert gone is not None and not gone.active and str(gone.release_reason).startswith("migration abandoned")
    assert ledger.snapshot().used(gone.shares[0].uuid).used_milli == 0  # not leaked
    assert_whole_devices_never_shared(ledger.history(0, 4e9))
    core.ledger.close()


def test_a_lost_hold_is_taken_again_and_a_missing_pin_written_again(setup: Any) -> None:
    url, ledger, _ = setup
    _moved_before_restart(ledger)
    ledger.expire_leases(NOW + 10_000)  # both leases ran out while no executor ran
    parts = ("d", "big", RUN, 2)
    ledger.unpin_try(*parts, reason="as if the executor stopped before pinning")
    core, migrator = _restarted(url)
    assert migrator.held_keys() == set()  # the hold is gone ...
    assert _pinned(ledger) is not None  # ... the pin is back
    migrator.claim(NOW + 10_001)
    held = ledger.get(NEXT)
    assert held is not None and held.active and held.shares[0].node == "fast"  # held again
    assert migrator.held_keys() == {NEXT}
    assert_whole_devices_never_shared(ledger.history(0, 4e9))
    core.ledger.close()


def test_a_move_whose_next_try_had_started_is_just_forgotten(setup: Any) -> None:
    url, ledger, _ = setup
    _moved_before_restart(ledger)
    from gpusched.ledger import HolderProcess

    ledger.release(OLD, reason="moving …; requeued", now=NOW + 25)
    ledger.attach_process(NEXT, HolderProcess("worker", "h", 4242, NOW + 30))  # try 2 started on it
    core, migrator = _restarted(url)
    assert migrator.held_keys() == set() and migrator.moving == {}
    assert ledger.moves() == [] and _pinned(ledger) is None
    assert ledger.get(NEXT).active  # type: ignore[union-attr]  # try 2's devices: reconcile decides as for any try
    core.ledger.close()


def test_moves_are_abandoned_when_the_mode_is_no_longer_migrate(setup: Any) -> None:
    url, ledger, _ = setup
    _moved_before_restart(ledger)
    core, migrator = _restarted(url, preemption="priority")
    assert migrator.held_keys() == set() and migrator.moving == {}
    assert ledger.moves() == [] and _pinned(ledger) is None
    gone = ledger.get(NEXT)
    assert gone is not None and not gone.active
    (event,) = ledger.events(10, kinds=["migration_abandoned"])
    assert "no longer migrate" in event.detail["reason"]
    core.ledger.close()


def test_another_holders_moves_are_left_alone(setup: Any) -> None:
    url, ledger, _ = setup
    _moved_before_restart(ledger)
    core = _Core(Ledger(url))
    core.holder = "sched-2"
    migrator = Migrator(core)
    assert migrator.held_keys() == set() and len(ledger.moves()) == 1
    assert ledger.get(NEXT).active  # type: ignore[union-attr]
    core.ledger.close()
