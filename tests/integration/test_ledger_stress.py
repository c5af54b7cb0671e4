"""Several real processes allocate overlapping capacity from one database at once.

The claim under test: no device is ever over-committed (active milli ≤ 1000 and memory ≤ device
memory at every moment), and every attempt either made exactly one allocation or raised
AllocationConflictError — also when all processes race for the same key.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections import defaultdict
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from _ledger_support import fleet, migrate_worker, share, stress_worker

from gpusched.errors import AllocationConflictError
from gpusched.ledger import Allocation, Ledger
from gpusched.ledger.migrate import current_revision, head_revision
from gpusched.ledger.schema import ALLOCATIONS, EVENTS, SHARES
from gpusched.model import MILLI
from gpusched.request import GPURequest

WORKERS = 5
ITERATIONS = 60
SHARED_EVERY = 6


def _run(target: object, args_for: list[tuple[object, ...]]) -> list[object]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(len(args_for), timeout=180)
    procs = [ctx.Process(target=target, args=(*args, barrier, results)) for args in args_for]
    for p in procs:
        p.start()
    try:
        collected = [results.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return collected


def test_concurrent_first_migration(url: str) -> None:
    outcomes = _run(migrate_worker, [(url,)] * 4)
    assert outcomes == ["ok"] * 4
    with Ledger(url) as led:
        assert current_revision(led.engine) == head_revision()


@pytest.mark.slow
def test_concurrent_allocators_never_overcommit(url: str) -> None:
    with Ledger(url) as led:
        led.migrate()
        led.sync_inventory(fleet(1, 4), "test")
        memory = {d.uuid: d.memory_bytes for d in led.snapshot().devices()}
    reports = _run(
        stress_worker,
        [(url, wid, ITERATIONS, SHARED_EVERY, 7) for wid in range(WORKERS)],
    )
    errors = [e for r in reports for e in r["errors"]]  # type: ignore[index]
    assert errors == []

    with Ledger(url) as led, led.engine.connect() as conn:
        rows_per_key: dict[str, int] = defaultdict(int)
        for (key,) in conn.execute(sa.select(ALLOCATIONS.c.key)):
            rows_per_key[key] += 1
        shares: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
        for key, uuid, milli, mem in conn.execute(
            sa.select(ALLOCATIONS.c.key, SHARES.c.device_uuid, SHARES.c.milli, SHARES.c.memory_bytes)
            .join(SHARES, SHARES.c.allocation_id == ALLOCATIONS.c.id)
        ):
            shares[key].append((uuid, milli, mem))
        events = conn.execute(
            sa.select(EVENTS.c.kind, EVENTS.c.subject)
            .where(EVENTS.c.kind.in_(["allocate", "release", "expire"]))
            .order_by(EVENTS.c.id)
        ).all()
        final = led.snapshot()

    # Every attempt: exactly one allocation row if it succeeded, none if it conflicted.
    oks = conflicts = 0
    shared_ok: dict[str, set[float]] = defaultdict(set)
    for report in reports:
        for key, outcome in report["outcomes"].items():  # type: ignore[index]
            if key.startswith("shared-"):
                continue
            assert rows_per_key.get(key, 0) == (1 if outcome == "ok" else 0), key
            oks += outcome == "ok"
            conflicts += outcome == "conflict"
        for key, created in report["shared_created"].items():  # type: ignore[index]
            shared_ok[key].add(created)
    shared_keys = {k for r in reports for k in r["outcomes"] if k.startswith("shared-")}  # type: ignore[index]
    for key in shared_keys:
        assert rows_per_key.get(key, 0) == (1 if key in shared_ok else 0), key
        assert len(shared_ok.get(key, {0.0})) == 1, f"{key}: winners saw different allocations"
    assert oks > 20 and conflicts > 20, (oks, conflicts)  # the contention was real
    assert shared_ok, "no shared race was ever won"

    # Replay allocate/release in commit order: capacity is never exceeded at any moment.
    used_milli: dict[str, int] = defaultdict(int)
    used_mem: dict[str, int] = defaultdict(int)
    for kind, key in events:
        sign = 1 if kind == "allocate" else -1
        for uuid, milli, mem in shares[key]:
            used_milli[uuid] += sign * milli
            used_mem[uuid] += sign * mem
            assert 0 <= used_milli[uuid] <= MILLI, (kind, key, uuid, used_milli[uuid])
            assert 0 <= used_mem[uuid] <= memory[uuid], (kind, key, uuid, used_mem[uuid])
    for uuid in memory:
        assert final.used(uuid).used_milli == used_milli[uuid]
        assert final.used(uuid).used_memory_bytes == used_mem[uuid]


def _race(count: int, action: Callable[[int], object]) -> list[object]:
    """Run ``action(0..count-1)`` in threads released together; their results (or exceptions)."""
    barrier = threading.Barrier(count)
    results: list[object] = [None] * count

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = action(index)
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_threads_racing_for_one_key_get_one_allocation(url: str) -> None:
    """Same key, different devices, at the same instant: one wins, the others conflict.

    On PostgreSQL the racers lock different device rows, so only the unique index on the active
    key separates them; on SQLite the write lock does. Then all release at once: one ends it.
    """
    with Ledger(url) as led:
        led.migrate()
        led.sync_inventory(fleet(1, 4), "test")
        devices = list(led.snapshot().devices())
        request = GPURequest.build(gpus=1)
        for round_no in range(8):
            key = f"race-{round_no}"
            won = _race(len(devices), lambda i, key=key: led.allocate(
                key, request, [share(devices[i])], holder=f"t{i}"
            ))
            winners = [r for r in won if isinstance(r, Allocation)]
            assert len(winners) == 1, won
            assert all(isinstance(r, AllocationConflictError) for r in won if r is not winners[0]), won
            assert led.active() == winners
            ended = _race(len(devices), lambda _i, key=key: led.release(key, reason="success"))
            assert sum(isinstance(r, Allocation) for r in ended) == 1, ended
            assert sum(r is None for r in ended) == len(devices) - 1, ended
            assert led.active() == []
        assert len(led.events(200, kinds=["release"])) == 8
