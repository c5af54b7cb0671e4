"""The fault chain's request overrides in their own ledger table, and the cycle's one-read view."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from _ledger_support import fleet, share

from gpusched.faults.failures import clear_override, load_overrides, refuse_retry, set_override
from gpusched.ledger import Ledger
from gpusched.ledger.migrate import upgrade
from gpusched.ledger.overrides import OVERRIDE, OVERRIDE_CLEARED, REFUSED
from gpusched.ledger.schema import EVENTS
from gpusched.request import GPURequest


@pytest.fixture
def ledger(url: str) -> Iterator[Ledger]:
    with Ledger(url) as led:
        led.migrate()
        led.sync_inventory(fleet(1, 4), "test", now=0.0)
        yield led


def _events(ledger: Ledger, kind: str, count: int, start: float) -> None:
    with ledger.engine.begin() as conn:
        conn.execute(sa.insert(EVENTS), [
            {"at": start + i, "kind": kind, "subject": f"other/t{i}",
             "detail": {"dag_id": "other", "task_id": f"t{i}", "run_id": "r", "try_number": 1, "reason": "x"}}
            for i in range(count)
        ])


def test_an_override_older_than_5000_later_events_still_applies(ledger: Ledger) -> None:
    big = GPURequest.build(gpus=1, memory="60GiB")
    set_override(ledger, "train", "fit", big, reason="oom", run_id="r1", now=1.0)
    refuse_retry(ledger, "train", "fit", "r1", 3, reason="code error", now=2.0)
    _events(ledger, REFUSED, 5001, start=10.0)  # a busy chain: the old 5,000-event scan lost both
    table = load_overrides(ledger)
    assert table.lookup("train", "fit", "r1") == big
    assert table.reason("train", "fit", "r1") == "oom"
    assert table.refusal("train", "fit", "r1", 3) == "code error"


def test_latest_write_per_scope_wins_and_clear_keeps_refusals(ledger: Ledger) -> None:
    small, big = GPURequest.build(gpus=1, memory="20GiB"), GPURequest.build(gpus=1, memory="60GiB")
    set_override(ledger, "train", "fit", big, reason="first", now=1.0)
    set_override(ledger, "train", "fit", small, reason="task-wide", now=2.0)
    set_override(ledger, "train", "fit", big, reason="oom in r1", run_id="r1", now=3.0)
    refuse_retry(ledger, "train", "fit", "r1", 2, reason="leak", now=4.0)
    refuse_retry(ledger, "train", "fit", "r1", 2, reason="code error", now=5.0)
    rows = ledger.request_overrides()
    assert len(rows) == 3  # one row per scope, however often it was written
    table = load_overrides(ledger)
    assert table.lookup("train", "fit", "r2") == small and table.reason("train", "fit", "r2") == "task-wide"
    assert table.lookup("train", "fit", "r1") == big
    assert table.refusal("train", "fit", "r1", 2) == "code error"
    assert table.refusal("train", "fit", "r1", 3) is None
    assert load_overrides(ledger, tasks=[("train", "other")]).lookup("train", "fit", "r1") is None
    assert load_overrides(ledger, tasks=[]).refusal("train", "fit", "r1", 2) is None
    clear_override(ledger, "train", "fit", now=6.0)
    table = load_overrides(ledger)
    assert table.lookup("train", "fit", "r1") is None
    assert table.refusal("train", "fit", "r1", 2) == "code error"
    # every write is still in the event log the UI shows
    kinds = [e.kind for e in ledger.events(10, kinds=(OVERRIDE, OVERRIDE_CLEARED, REFUSED))]
    assert kinds == [OVERRIDE_CLEARED, REFUSED, REFUSED, OVERRIDE, OVERRIDE, OVERRIDE]


def test_upgrade_copies_the_overrides_in_force_from_the_event_log(url: str) -> None:
    big, small = GPURequest.build(gpus=1, memory="60GiB"), GPURequest.build(gpus=1, memory="20GiB")
    with Ledger(url) as led:
        upgrade(led.engine, "0005_hosts")
        for at, kind, detail in [
            (1.0, OVERRIDE, {"dag_id": "d", "task_id": "gone", "run_id": None, "request": big.to_dict(),
                             "reason": "cleared later"}),
            (2.0, OVERRIDE_CLEARED, {"dag_id": "d", "task_id": "gone"}),
            (3.0, OVERRIDE, {"dag_id": "d", "task_id": "t", "run_id": "r1", "request": big.to_dict(),
                             "reason": "old"}),
            (4.0, OVERRIDE, {"dag_id": "d", "task_id": "t", "run_id": None, "request": small.to_dict(),
                             "reason": "wide"}),
            (5.0, OVERRIDE, {"dag_id": "d", "task_id": "t", "run_id": "r1", "request": big.to_dict(),
                             "reason": "new"}),
            (6.0, REFUSED, {"dag_id": "d", "task_id": "t", "run_id": "r1", "try_number": 2,
                            "reason": "leak"}),
            (7.0, OVERRIDE, {"dag_id": "d", "task_id": "bad", "reason": "no request"}),
        ]:
            led.record_event(kind, f"{detail['dag_id']}/{detail['task_id']}", now=at, **detail)
        led.migrate()
        table = load_overrides(led)
        assert table.lookup("d", "gone", "r1") is None
        assert table.lookup("d", "t", "r1") == big and table.reason("d", "t", "r1") == "new"
        assert table.lookup("d", "t", "r2") == small
        assert table.refusal("d", "t", "r1", 2) == "leak"
        assert table.lookup("d", "bad", "r1") is None
        assert len(led.request_overrides()) == 3


def test_cycle_view_is_the_snapshot_and_the_running_tasks_of_one_read(ledger: Ledger) -> None:
    devices = [d for n in ledger.snapshot().nodes for d in n.devices]
    ledger.allocate("a", GPURequest.build(gpus=1), [share(devices[0])], holder="h", now=1.0)
    ledger.allocate("b", GPURequest.build(gpus=0.5, memory="8GiB"),
                    [share(devices[1], milli=500, memory_bytes=8 * 2**30)], holder="h", now=1.0)
    ledger.release("a", reason="done", now=2.0)
    snapshot, active = ledger.cycle_view(now=3.0)
    assert snapshot == ledger.snapshot(now=3.0)
    assert active == ledger.active()
    assert [a.key for a in active] == ["b"]
    assert snapshot.taken_at == 3.0


def test_a_pin_applies_to_exactly_one_try_beside_the_chains_overrides(ledger: Ledger) -> None:
    from gpusched.ledger.overrides import PIN_CLEARED, PINNED

    big = GPURequest.build(gpus=1, memory="60GiB")
    pinned = GPURequest.build(gpus=1, models=["A100-SXM-80GB"], job_type="resnet")
    set_override(ledger, "train", "fit", big, reason="oom", run_id="r1", now=1.0)
    ledger.pin_try("train", "fit", "r1", 2, pinned, reason="moved from K80", now=2.0)
    table = load_overrides(ledger)
    assert table.pinned("train", "fit", "r1", 2) == pinned
    assert table.pinned("train", "fit", "r1", 3) is None and table.pinned("train", "fit", "r2", 2) is None
    assert table.lookup("train", "fit", "r1") == big  # the chain's override stays for the other tries
    assert table.refusal("train", "fit", "r1", 2) is None  # a pin is no refusal
    assert [e.kind for e in ledger.events(10, kinds=[PINNED])] == [PINNED]
    assert ledger.unpin_try("train", "fit", "r1", 2, reason="given up", now=3.0) is True
    assert ledger.unpin_try("train", "fit", "r1", 2, reason="again", now=4.0) is False
    after = load_overrides(ledger)
    assert after.pinned("train", "fit", "r1", 2) is None and after.lookup("train", "fit", "r1") == big
    (cleared,) = ledger.events(10, kinds=[PIN_CLEARED])
    assert cleared.detail["reason"] == "given up" and cleared.detail["try_number"] == 2
