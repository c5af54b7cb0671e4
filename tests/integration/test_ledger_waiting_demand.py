"""Demand that waited: the ledger counts queued GPUs, and the forecast's series adds them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _ledger_support import BACKENDS, fleet_ledger, share

from gpusched.capacity.demand import demand_from_history
from gpusched.gang import GangMember
from gpusched.ledger import Ledger
from gpusched.request import GPURequest


@pytest.fixture(params=BACKENDS)
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    yield from fleet_ledger(request.param, tmp_path)


def test_waiting_demand_counts_queued_and_late_placed_gpus(ledger: Ledger) -> None:
    """Before: demand history counted allocated GPUs only, so a fleet whose tasks queued for
    hours read as idle as one without work, and the forecast never asked for more."""
    d = list(ledger.snapshot().devices())
    two = GPURequest.build(gpus=2)
    # "late" waited from t=0 and got 2 GPUs at t=150; "placed" never waited.
    ledger.allocate("late", two, [share(d[0]), share(d[1])], holder="s", now=150.0, queued_at=0.0)
    ledger.allocate("placed", GPURequest.build(gpus=1), [share(d[2])], holder="s", now=20.0, queued_at=20.0)
    # "queued" (4 GPUs) waits from t=250 and is still waiting; a gang member counts as its GPUs.
    ledger.record_queue("queued", GPURequest.build(gpus=4), "all devices busy", now=250.0)
    ledger.record_queue("member", GPURequest.build(gpus=1), "gang", now=250.0,
                        gang=GangMember("d/r/-1/g", 2, 0))
    waited = ledger.waiting_history(0.0, 300.0, step_s=100)
    assert waited == [(0.0, 2000), (100.0, 1000), (200.0, 2500)]
    allocated = ledger.demand_history(0.0, 300.0, step_s=100)
    assert allocated == [(0.0, 800), (100.0, 2000), (200.0, 3000)]
    series = demand_from_history(allocated, step_s=100, waiting=waited)
    assert series.values == (2.8, 3.0, 5.5)
    # No step reads more than the whole fleet: no scaling serves more than that.
    assert demand_from_history(allocated, step_s=100, waiting=waited, capacity=4.0).values == (2.8, 3.0, 4.0)
    assert ledger.waiting_history(300.0, 300.0) == []
