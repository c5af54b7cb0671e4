"""Ledger faults on real databases: racing callers, a frozen writer, a killed database server.

- Callers racing to allocate and release the same key only ever see AllocationConflictError (never
  a raw ``IntegrityError``), and the key never has two active allocations.
- A writer frozen (SIGSTOP) inside its transaction makes another caller fail within its wait
  bound with LedgerUnavailableError instead of waiting 60 s; once the writer is gone, all is well.
- A PostgreSQL server killed with SIGKILL: operations fail with LedgerUnavailableError (one line,
  bounded); after a restart the allocations are all still there and none is doubled.
- The agent expires leases when no executor runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from _fault_support import PrivatePostgres, postgres_binaries
from _ledger_support import fleet, share

from gpusched.errors import AllocationConflictError, LedgerUnavailableError
from gpusched.ledger import Ledger
from gpusched.ledger.schema import ALLOCATIONS
from gpusched.request import GPURequest

pytestmark = [pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]


def _ledger(url: str, **kwargs: float) -> Ledger:
    ledger = Ledger(url, **kwargs)
    ledger.migrate()
    ledger.sync_inventory(fleet(1, 4), source="test")
    return ledger


def test_racing_allocate_and_release_of_one_key_only_conflicts(url: str) -> None:
    """Each racer allocates the key (its own device) and releases it at once, many times over."""
    ledger = _ledger(url)
    devices = list(ledger.snapshot().node("n0").devices)
    request = GPURequest.build(gpus=1)
    rounds, racers = 60, len(devices)
    outcomes: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(racers)

    def racer(i: int) -> None:
        mine = [share(devices[i])]
        for n in range(rounds):
            barrier.wait()
            key = f"hot-{n % 3}"
            try:
                ledger.allocate(key, request, mine, holder=f"r{i}")
                ledger.release(key, reason="done")
                result = "ok"
            except AllocationConflictError:
                result = "conflict"
            except Exception as exc:  # the defect: a raw database error
                result = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    raw = [o for o in outcomes if o not in ("ok", "conflict")]
    assert not raw, raw[:3]
    assert len(outcomes) == rounds * racers and "ok" in outcomes
    with ledger.engine.connect() as conn:
        doubled = conn.execute(
            sa.select(ALLOCATIONS.c.key).where(ALLOCATIONS.c.released_at.is_(None))
            .group_by(ALLOCATIONS.c.key).having(sa.func.count() > 1)
        ).all()
    assert doubled == [] and ledger.active() == []
    from gpusched.ledger.audit import audit

    assert audit(ledger) == []
    ledger.close()


_FREEZER = """
import os, signal, sys
import sqlalchemy as sa
from gpusched.ledger import Ledger
from gpusched.ledger.engine import write_tx
led = Ledger(sys.argv[1])
with write_tx(led.engine) as conn:
    # SQLite: BEGIN IMMEDIATE holds the write lock; PostgreSQL: hold the device rows.
    conn.execute(sa.text("UPDATE gpusched_devices SET updated_at = updated_at"))
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_frozen_writer_makes_others_fail_within_their_bound(url: str, tmp_path: Path) -> None:
    ledger = _ledger(url, lock_wait_s=1.0)
    device = ledger.snapshot().node("n0").devices[0]
    script = tmp_path / "freezer.py"
    script.write_text(_FREEZER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    frozen = subprocess.Popen([sys.executable, str(script), url], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert frozen.stdout is not None and frozen.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with pytest.raises(LedgerUnavailableError) as caught:
            ledger.allocate("k1", GPURequest.build(gpus=1), [share(device)], holder="t")
        waited = time.monotonic() - started
        assert waited < 1.0 + 4.0, f"waited {waited:.1f} s for a 1 s bound"
        message = str(caught.value)
        assert "\n" not in message and "no stuck process holds it" in message
        # Reads are not blocked by the frozen writer.
        assert ledger.active() == []
    finally:
        frozen.kill()
        frozen.wait(timeout=30)
    # The writer is gone (its transaction rolled back): the ledger works again.
    deadline = time.monotonic() + 20
    while True:
        try:
            ledger.allocate("k1", GPURequest.build(gpus=1), [share(device)], holder="t")
            break
        except LedgerUnavailableError:
            assert time.monotonic() < deadline, "the ledger stayed locked after the writer died"
            time.sleep(0.2)
    assert [a.key for a in ledger.active()] == ["k1"]
    ledger.close()


@pytest.mark.skipif(not postgres_binaries(), reason="PostgreSQL server binaries are not installed")
def test_killed_postgres_server_fails_cleanly_and_loses_nothing() -> None:
    """SIGKILL the server under the ledger, then restart it on the same data directory."""
    with PrivatePostgres() as server:
        ledger = _ledger(server.url, lock_wait_s=2.0)
        devices = list(ledger.snapshot().node("n0").devices)
        for i, device in enumerate(devices[:2]):
            ledger.allocate(f"k{i}", GPURequest.build(gpus=1), [share(device)], holder="t")
        server.kill()
        started = time.monotonic()
        with pytest.raises(LedgerUnavailableError) as caught:
            ledger.allocate("k9", GPURequest.build(gpus=1), [share(devices[3])], holder="t")
        assert time.monotonic() - started < 15.0
        assert "\n" not in str(caught.value) and "GPUSCHED_DB_URL" in str(caught.value)
        server.start()
        # The pool notices the dead connections (pre-ping) and reconnects.
        active = ledger.active()
        assert sorted(a.key for a in active) == ["k0", "k1"]
        ledger.allocate("k9", GPURequest.build(gpus=1), [share(devices[3])], holder="t")
        with pytest.raises(AllocationConflictError):
            ledger.allocate("k8", GPURequest.build(gpus=1), [share(devices[0])], holder="t")
        for key in ("k0", "k1", "k9"):
            assert ledger.release(key, reason="done") is not None
        assert ledger.active() == []
        ledger.close()


def test_agent_cycle_expires_leases_without_any_executor(tmp_path: Path) -> None:
    from gpusched.agent.telemetry import TelemetryAgent
    from gpusched.hardware.simulated import SimulatedBackend

    backend = SimulatedBackend()
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        ledger.migrate()
        ledger.sync_inventory(backend.discover(), source="simulated")
        device = backend.discover()[0].devices[0]
        now = time.time()
        ledger.allocate("crashed", GPURequest.build(gpus=1), [share(device)], holder="gone",
                        lease_s=30, now=now - 60)
        ledger.allocate("alive", GPURequest.build(gpus=0.5, memory="1GiB"),
                        [share(backend.discover()[0].devices[1], 500, 2**30)], holder="here", lease_s=600)
        result = TelemetryAgent(backend, ledger).cycle(now)
        assert result.expired == ("crashed",)
        assert [a.key for a in ledger.active()] == ["alive"]
        assert ledger.get("crashed").status == "expired"  # type: ignore[union-attr]



def test_audit_finds_an_overcommit_written_behind_the_ledgers_back(tmp_path: Path) -> None:
    """The replay used by the fault suite and the benchmark can fail: forge a second holder."""
    from gpusched.ledger.audit import audit
    from gpusched.ledger.schema import EVENTS, SHARES

    with _ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        device = ledger.snapshot().node("n0").devices[0]
        ledger.allocate("a", GPURequest.build(gpus=1), [share(device)], holder="t")
        assert audit(ledger) == []
        with ledger.engine.begin() as conn:  # what a buggy writer might do: bypass the checks
            row_id = conn.execute(sa.insert(ALLOCATIONS).values(
                key="b", request=GPURequest.build(gpus=1).to_dict(), holder="t", created_at=1.0,
                lease_expires_at=2.0, status="active")).inserted_primary_key[0]
            conn.execute(sa.insert(SHARES).values(allocation_id=row_id, device_uuid=device.uuid, node="n0",
                                                  idx=0, milli=1000, memory_bytes=0))
            conn.execute(sa.insert(EVENTS).values(at=1.0, kind="allocate", subject="b", detail={}))
        found = audit(ledger)
        assert len(found) == 1 and device.uuid in found[0] and "over-committed by b" in found[0]
