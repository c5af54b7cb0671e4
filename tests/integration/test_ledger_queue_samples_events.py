"""Ledger concepts besides allocations: pending queue, telemetry samples, demand history, events."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _ledger_support import BACKENDS, GIB, fleet_ledger, share

from gpusched.errors import LedgerError
from gpusched.ledger import Ledger
from gpusched.ledger.capacity import demand_series
from gpusched.model import DeviceSample
from gpusched.request import GPURequest


@pytest.fixture(params=BACKENDS)
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    yield from fleet_ledger(request.param, tmp_path)


def test_queue_keeps_first_sighting_and_latest_reason(ledger: Ledger) -> None:
    big = GPURequest.build(gpus=8)
    small = GPURequest.build(gpus=1, tenant="team-a")
    ledger.record_queue("big", big, "needs 8 devices on one node; largest node has 4", now=10.0)
    ledger.record_queue("small", small, "all devices busy", now=20.0)
    ledger.record_queue("big", big, "still too big", now=30.0)
    entries = ledger.queue()
    assert [e.key for e in entries] == ["big", "small"]
    assert entries[0].since == 10.0 and entries[0].updated_at == 30.0 and entries[0].reason == "still too big"
    assert entries[0].request == big and entries[1].request.tenant == "team-a"
    ledger.clear_queue("big")
    ledger.clear_queue("never-queued")
    assert [e.key for e in ledger.queue()] == ["small"]
    device = next(iter(ledger.snapshot().devices()))
    ledger.allocate("small", small, [share(device)], holder="s", now=40.0)  # placed: it waits no more
    assert ledger.queue() == []


def test_samples_round_trip_filter_and_prune(ledger: Ledger) -> None:
    ledger.record_samples([])
    batch = [
        DeviceSample(f"GPU-n0-{i}", t, 50 + i, i * GIB, 80 * GIB, 60_000, 300_000, i, (79,) if i == 3 else ())
        for t in (100.0, 200.0)
        for i in range(4)
    ]
    ledger.record_samples(batch)
    assert ledger.samples(None, 0.0) == sorted(batch, key=lambda s: s.taken_at)
    one = ledger.samples("GPU-n0-3", 150.0)
    assert one == [batch[7]] and one[0].xid_errors == (79,)
    assert ledger.prune_samples(before=150.0) == 4
    assert {s.taken_at for s in ledger.samples(None, 0.0)} == {200.0}


def test_demand_history_integrates_allocations_per_step(ledger: Ledger) -> None:
    d = list(ledger.snapshot().devices())
    two = GPURequest.build(gpus=2)
    quarter = GPURequest.build(gpus=0.25, memory="8GiB")
    # 2000 milli from t=0 to t=150; 250 milli from t=50, still active.
    ledger.allocate("a", two, [share(d[0]), share(d[1])], holder="s", now=0.0)
    ledger.release("a", reason="success", now=150.0)
    ledger.allocate("b", quarter, [share(d[2], 250, 8 * GIB)], holder="s", now=50.0)
    history = ledger.demand_history(0.0, 300.0, step_s=100)
    assert history == [(0.0, 2000 + 125), (100.0, 1000 + 250), (200.0, 250)]
    assert ledger.demand_history(300.0, 300.0) == []
    # A window that starts after "a" ended only sees "b".
    assert ledger.demand_history(160.0, 260.0, step_s=50) == [(160.0, 250), (210.0, 250)]
    with pytest.raises(LedgerError, match="step_s"):
        ledger.demand_history(0.0, 10.0, step_s=0)


def test_demand_series_partial_last_step() -> None:
    assert demand_series([(0.0, 90.0, 1000)], 0.0, 90.0, 60) == [(0.0, 1000), (60.0, 1000)]
    assert demand_series([(30.0, 45.0, 1000)], 0.0, 60.0, 60) == [(0.0, 250)]
    assert demand_series([(-50.0, 500.0, 500)], 0.0, 120.0, 60) == [(0.0, 500), (60.0, 500)]


def test_events_newest_first_with_filters(ledger: Ledger) -> None:
    d = list(ledger.snapshot().devices())
    ledger.allocate("k", GPURequest.build(gpus=1), [share(d[0])], holder="s", now=1.0)
    ledger.cordon(d[1].uuid, "fan", now=2.0)
    ledger.release("k", reason="failed", now=3.0)
    ledger.record_event("fault", d[0].uuid, now=4.0, classification="oom", retry=True)
    events = ledger.events(10)
    assert [e.kind for e in events][:4] == ["fault", "release", "cordon", "allocate"]
    assert events[0].detail == {"classification": "oom", "retry": True}
    assert events[1].detail["reason"] == "failed" and events[1].subject == "k"
    assert [e.kind for e in ledger.events(2)] == ["fault", "release"]
    assert [e.kind for e in ledger.events(10, kinds=["cordon"])] == ["cordon"]
    assert [e.at for e in ledger.events(10, since=3.0)] == [4.0, 3.0]


def test_history_lists_released_and_active(ledger: Ledger) -> None:
    d = list(ledger.snapshot().devices())
    one = GPURequest.build(gpus=1)
    ledger.allocate("old", one, [share(d[0])], holder="s", now=0.0)
    ledger.release("old", reason="success", now=10.0)
    ledger.allocate("new", one, [share(d[0])], holder="s", now=20.0)
    assert [a.key for a in ledger.history(5.0)] == ["old", "new"]
    assert [a.key for a in ledger.history(15.0)] == ["new"]
    assert [a.key for a in ledger.history(0.0, until=15.0)] == ["old"]
    assert ledger.history(0.0)[0].to_dict()["release_reason"] == "success"
