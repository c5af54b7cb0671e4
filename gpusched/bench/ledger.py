"""Ledger throughput and latency: allocate+release cycles and snapshots, SQLite and PostgreSQL.

    .venv/bin/python scripts/bench_ledger.py [--pg-url URL] [--cycles N] [--procs P]

For each backend (SQLite in a temporary folder; PostgreSQL when ``--pg-url`` or
``$GPUSCHED_TEST_PG_URL`` is set) it reports, in the same run:

- single-process allocate+release cycles per second (the baseline);
- the aggregate rate of P processes racing on the same devices, as a ratio to the baseline
  (below 1.0 means the write lock serialises them, as designed);
- snapshot() time on a 64-node × 8-device fleet with 256 active allocations;
- violations: moments of the ledger's whole history, replayed in commit order
  (:mod:`gpusched.ledger.audit`), where a device held more than 1000 milli-GPU or more memory than
  it has or a key held two allocations, plus errors other than AllocationConflictError seen by the
  racing processes (all must be 0).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import uuid

from gpusched.catalog import Vendor
from gpusched.errors import AllocationConflictError
from gpusched.ledger import Ledger
from gpusched.ledger.audit import audit
from gpusched.model import Device, DeviceShare, Node
from gpusched.request import GPURequest

GIB = 2**30


def _fleet(nodes: int, per_node: int) -> list[Node]:
    return [
        Node(f"n{n}", f"r{n // 8}", tuple(
            Device(f"GPU-{n}-{i}", i, f"n{n}", "A100-SXM-80GB", Vendor.NVIDIA, "sm_80", 80 * GIB)
            for i in range(per_node)
        ))
        for n in range(nodes)
    ]


def _cycles(url: str, worker: int, cycles: int) -> tuple[int, int, float, int]:
    request = GPURequest.build(gpus=0.25, memory="10GiB")
    ok = conflicts = errors = 0
    with Ledger(url) as led:
        devices = list(led.snapshot().node("n0").devices)
        start = time.perf_counter()
        for i in range(cycles):
            d = devices[i % len(devices)]
            key = f"b{worker}-{i}"
            try:
                share = DeviceShare(d.uuid, d.node, d.index, 250, 10 * GIB)
                led.allocate(key, request, [share], holder="bench")
                ok += 1
                led.release(key, reason="success")
            except AllocationConflictError:
                conflicts += 1
            except Exception as exc:  # a raw database error is a violation of the contract
                errors += 1
                print(f"worker {worker}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ok, conflicts, time.perf_counter() - start, errors


def _worker(args: tuple[str, int, int]) -> tuple[int, int, float, int]:
    return _cycles(*args)


def _violations(url: str) -> int:
    """Over-commitments and doubly held keys, replaying the whole history in commit order."""

    with Ledger(url) as led:
        found = audit(led)
    for line in found[:5]:
        print(f"violation: {line}", file=sys.stderr)
    return len(found)


def bench(url: str, label: str, cycles: int, procs: int) -> None:
    with Ledger(url) as led:
        led.migrate()
        led.sync_inventory(_fleet(64, 8), "bench")
    cpu0 = time.process_time()
    ok, _, elapsed, _ = _cycles(url, 0, cycles)
    cpu = time.process_time() - cpu0
    base = ok / elapsed
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(procs) as pool:
        started = time.perf_counter()
        results = pool.map(_worker, [(url, w + 1, cycles) for w in range(procs)])
        wall = time.perf_counter() - started
    total_ok = sum(r[0] for r in results)
    conflicts = sum(r[1] for r in results)
    errors = sum(r[3] for r in results)
    rate = total_ok / max(max(r[2] for r in results), 1e-9)
    violations = _violations(url) + errors
    with Ledger(url) as led:
        devices = [d for n in led.snapshot().nodes[1:33] for d in n.devices]
        request = GPURequest.build(gpus=1)
        for i, d in enumerate(devices):
            led.allocate(f"snap-{i}", request, [DeviceShare(d.uuid, d.node, d.index, 1000, d.memory_bytes)],
                         holder="bench")
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            led.snapshot()
            times.append(time.perf_counter() - t0)
    print(f"{label:<11} single: {base:7.0f} cycles/s ({1000 / base:.2f} ms per allocate+release; "
          f"CPU {cpu / max(ok, 1) * 1000:.2f} ms of it in this process)")
    print(f"{label:<11} {procs} procs: {rate:7.0f} cycles/s aggregate = {rate / base:.2f}x single "
          f"({conflicts} conflicts, wall {wall:.1f}s incl. start-up)")
    print(f"{label:<11} violations: {violations} "
          "(over-commits and doubly held keys replayed in commit order, raw errors)")
    print(f"{label:<11} snapshot (512 devices, 256 active): median {statistics.median(times) * 1000:.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default=os.environ.get("GPUSCHED_TEST_PG_URL", ""))
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--procs", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench(f"sqlite:///{tmp}/bench.db", "sqlite", args.cycles, args.procs)
    if args.pg_url:
        import sqlalchemy as sa

        name = f"gs_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(args.pg_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            url = sa.make_url(args.pg_url).set(database=name).render_as_string(hide_password=False)
            bench(url, "postgresql", args.cycles, args.procs)
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.dispose()
    else:
        print("postgresql  skipped: set GPUSCHED_TEST_PG_URL or --pg-url (scripts/start_postgres.sh)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
