"""Helpers shared by the ledger tests: database URLs per backend and a small test fleet."""

from __future__ import annotations

import importlib.util
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from gpusched.catalog import LinkKind, Vendor
from gpusched.model import Device, DeviceShare, Node

GIB = 2**30
PG_URL = os.environ.get("GPUSCHED_TEST_PG_URL", "").strip()

_PG_SKIP = (
    "GPUSCHED_TEST_PG_URL is not set; start a throwaway server with "
    "`export GPUSCHED_TEST_PG_URL=$(bash scripts/start_postgres.sh $(mktemp -d))`"
    if not PG_URL
    else "the psycopg driver is not installed (pip install 'psycopg[binary]')"
    if importlib.util.find_spec("psycopg") is None
    else ""
)
BACKENDS = [
    "sqlite",
    pytest.param("postgresql", marks=pytest.mark.skipif(bool(_PG_SKIP), reason=_PG_SKIP)),
]


def database_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database for one test: a SQLite file, or a new PostgreSQL database."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    name = f"gs_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield sa.make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def gpu(node: str, index: int, memory_gib: int = 80, island: str | None = None) -> Device:
    """One NVIDIA device of the test fleet."""
    return Device(
        uuid=f"GPU-{node}-{index}",
        index=index,
        node=node,
        model="A100-SXM-80GB",
        vendor=Vendor.NVIDIA,
        architecture="sm_80",
        memory_bytes=memory_gib * GIB,
        numa_node=index // 2,
        pcie_switch=f"{node}-sw{index // 2}",
        island=island,
        link=LinkKind.NVLINK if island else LinkKind.PCIE,
    )


def fleet(nodes: int = 2, per_node: int = 4, memory_gib: int = 80) -> list[Node]:
    """``nodes`` nodes of ``per_node`` devices each, named n0, n1, …"""
    return [
        Node(
            name=f"n{n}",
            rack=f"r{n // 2}",
            devices=tuple(gpu(f"n{n}", i, memory_gib, island=f"n{n}-nvl") for i in range(per_node)),
            labels=(("zone", "a"),),
            cpu_milli=64000,
            memory_bytes=512 * GIB,
        )
        for n in range(nodes)
    ]


def share(device: Device, milli: int = 1000, memory_bytes: int | None = None) -> DeviceShare:
    """A share of ``device`` (the whole memory for a whole device unless told otherwise)."""
    memory = device.memory_bytes if memory_bytes is None else memory_bytes
    return DeviceShare(device.uuid, device.node, device.index, milli, memory)


def stress_worker(
    url: str, wid: int, iterations: int, shared_every: int, seed: int, barrier: Any, results: Any
) -> None:
    """One allocator process of the stress test; puts its outcomes on ``results``.

    Unique keys ``w{wid}-{i}`` ask for random shares of the four devices of node n0 and are
    released at random; every ``shared_every`` iterations all workers race for the same key with
    the same shares at once (after a barrier). Outcome per key: "ok" or "conflict"; anything else
    is reported as an error. After each success the worker checks a fresh snapshot for over-commit.
    """
    import random

    from gpusched.errors import AllocationConflictError
    from gpusched.ledger import Ledger
    from gpusched.request import GPURequest

    rng = random.Random(seed * 1000 + wid)
    outcomes: dict[str, str] = {}
    shared_created: dict[str, float] = {}
    errors: list[str] = []
    requests = {m: GPURequest.build(gpus=m / 1000, memory="1GiB") for m in (250, 500)}
    requests[1000] = GPURequest.build(gpus=1)
    requests[2000] = GPURequest.build(gpus=2)
    held: list[str] = []
    led = Ledger(url)
    try:
        devices = list(led.snapshot().node("n0").devices)
        barrier.wait()
        for i in range(iterations):
            if i % shared_every == 0:
                key = f"shared-{i}"
                pick = devices[(i // shared_every) % len(devices)]
                barrier.wait()
                try:
                    got = led.allocate(key, requests[1000], [share(pick, 1000, 40 * GIB)], holder="shared")
                    outcomes[key] = "ok"
                    shared_created[key] = got.created_at
                except AllocationConflictError:
                    outcomes[key] = "conflict"
                barrier.wait()
                if wid == 0:
                    led.release(key, reason="success")
                barrier.wait()
                continue
            key = f"w{wid}-{i}"
            count = rng.choice((1, 1, 2))
            milli = 1000 if count == 2 else rng.choice((250, 500, 1000))
            memory = rng.choice((10, 20, 40, 80)) * GIB
            shares = [share(d, milli, memory) for d in rng.sample(devices, count)]
            request = requests[2000 if count == 2 else milli]
            try:
                got = led.allocate(key, request, shares, holder=f"w{wid}", lease_s=3600)
                outcomes[key] = "ok"
                held.append(key)
                if rng.random() < 0.2 and led.allocate(key, request, shares, holder=f"w{wid}") != got:
                    errors.append(f"{key}: idempotent allocate returned a different allocation")
                snap = led.snapshot()
                for d in devices:
                    used = snap.used(d.uuid)
                    if used.used_milli > 1000 or used.used_memory_bytes > d.memory_bytes:
                        errors.append(f"{key}: over-commit seen on {d.uuid}: {used}")
            except AllocationConflictError:
                outcomes[key] = "conflict"
            if held and (len(held) > 3 or rng.random() < 0.4):
                gone = held.pop(rng.randrange(len(held)))
                if led.release(gone, reason=rng.choice(("success", "failed", "killed"))) is None:
                    errors.append(f"{gone}: release found no active allocation")
    except Exception as exc:  # report, so the parent fails with the cause instead of hanging
        errors.append(f"worker {wid}: {type(exc).__name__}: {exc}")
        barrier.abort()
    finally:
        led.close()
        results.put({"wid": wid, "outcomes": outcomes, "shared_created": shared_created, "errors": errors})


def migrate_worker(url: str, barrier: Any, results: Any) -> None:
    """Migrate the same fresh database as several processes do at once."""
    from gpusched.ledger import Ledger

    try:
        with Ledger(url) as led:
            barrier.wait()
            led.migrate()
        results.put("ok")
    except Exception as exc:
        results.put(f"{type(exc).__name__}: {exc}")


def assert_whole_devices_never_shared(history: Any) -> None:
    """No two allocations of whole devices in ``history`` (``Ledger.history``) overlap in time on
    one device (``released_at`` exclusive; still active = open)."""
    import itertools

    spans: dict[str, list[tuple[float, float, str]]] = {}
    for alloc in history:
        for s in alloc.shares:
            end = alloc.released_at or float("inf")
            spans.setdefault(s.uuid, []).append((alloc.created_at, end, alloc.key))
    for device, rows in spans.items():
        for (_, end, key), (start, _, other) in itertools.pairwise(sorted(rows)):
            assert start >= end, f"{device} held by {key} and {other} at once"


def record_finished_runs(
    ledger: Any, dag_id: str, task_id: str, request: Any, device: DeviceShare, run_seconds: list[float],
    *, end: float,
) -> None:
    """Write succeeded past runs of task ``dag_id.task_id`` into ``ledger`` — what the duration
    predictor and the service index (``preemption = service``) learn from: one run per entry of
    ``run_seconds`` (that long), one after another on ``device``, the last released at ``end``."""
    from gpusched.scheduler.keys import ti_key

    at = end - sum(run_seconds) - len(run_seconds)
    for n, run_s in enumerate(run_seconds):
        key = ti_key(dag_id, task_id, f"scheduled__history{n}", 1)
        # A lease that outlasts the write: the past run's lease must not run out before it is
        # released here, or a live agent's lease check releases it now (overlapping later runs).
        lease_s = int(time.time() - at) + 3600
        ledger.allocate(key, request, [device], holder="history", lease_s=lease_s, now=at)
        ledger.release(key, reason="task succeeded", now=at + run_s, succeeded=True)
        at += run_s + 1


def lose_silent_hosts(ledger: Any, timeout_s: float, now: float) -> list[str]:
    """The executors' lost-host rule on hosts none of whose tries runs
    (:func:`gpusched.scheduler.hosts.record_verdicts`, nothing heard): the names it marked lost."""
    from gpusched.scheduler.hosts import record_verdicts

    return [v.name for v in record_verdicts(ledger, ledger.hosts(), now, timeout_s, {}) if v.state == "lost"]


def fleet_ledger(backend: str, tmp_path: Path) -> Iterator[Any]:
    """A migrated ledger on a fresh ``backend`` database (:func:`database_url`) holding one node of
    four GPUs (:func:`fleet`). Use as the body of a fixture (``yield from``)."""
    from gpusched.ledger import Ledger

    for url in database_url(backend, tmp_path):
        with Ledger(url) as led:
            led.migrate()
            led.sync_inventory(fleet(1, 4), "test", now=0.0)
            yield led


def budget_period_around(now: float, back_s: float, ahead_s: float) -> tuple[int, str]:
    """A quota ``period_s`` whose one period holds all of ``[now - back_s, now + ahead_s]``, and
    the name the reasons give it (``"this week"`` when a week does).

    Periods are aligned on Monday 00:00 UTC, so a test that charges usage "45 minutes ago" and
    runs early on a Monday would see it fall into the previous week; a period a few hours longer
    than a week puts its boundaries elsewhere.
    """
    from gpusched.quota.usage import period_start

    for hours in range(49):
        period_s = 7 * 86400 + 3600 * hours
        if period_start(now - back_s, period_s) == period_start(now + ahead_s, period_s):
            return period_s, "this week" if hours == 0 else "this period"
    raise AssertionError(f"no period of 7 to 9 days holds [{now - back_s}, {now + ahead_s}]")
