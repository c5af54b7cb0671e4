"""The cycle's incremental read: a long-lived ``Ledger`` reads only the allocation rows changed
since its last ``cycle_view`` and must still return exactly what a fresh read returns.

Random sequences of every allocation write (allocate, release, renew, holder processes,
quarantine and its end, lease expiry, reconcile) and of inventory changes, made through the
reader itself and through a second ``Ledger`` (another process's writer), are compared after
every step with a new ``Ledger`` on the same database (a full read) and with the usage query of
the shares table. Concurrent writers check the change feed's ordering: each incremental read
equals a full read taken in the same transaction.
"""

from __future__ import annotations

import random
import threading
from contextlib import suppress
from pathlib import Path

import pytest
import sqlalchemy as sa
from _ledger_support import GIB, fleet, share

from gpusched.errors import AllocationConflictError, UnknownAllocationError
from gpusched.ledger import Ledger
from gpusched.ledger.active_view import ActiveView
from gpusched.ledger.allocations import active_allocations
from gpusched.ledger.capacity import active_usage, usage_of
from gpusched.ledger.engine import read_tx
from gpusched.ledger.schema import ALLOCATIONS
from gpusched.model import Device, DeviceUsage, FleetSnapshot, Health
from gpusched.records import HolderProcess
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import RunningTasks, running_tasks

_SHAPES = [(1, 1000, None), (1, 500, 20 * GIB), (1, 250, 8 * GIB), (2, 1000, None)]


def _assert_same_as_fresh(url: str, reader: Ledger, now: float) -> None:
    """``reader``'s cycle view equals a new Ledger's (a full read) and the usage query's."""
    snapshot, active = reader.cycle_view(now)
    with Ledger(url) as fresh:
        fresh_snapshot, fresh_active = fresh.cycle_view(now)
        queried = fresh.snapshot(now)
    assert active == fresh_active
    assert dict(snapshot.usage) == dict(fresh_snapshot.usage) == dict(queried.usage)
    assert snapshot.nodes == fresh_snapshot.nodes and snapshot.source == fresh_snapshot.source
    assert snapshot.taken_at == now
    for device in snapshot.devices():  # never a device shown freer than its committed holders leave it
        assert snapshot.free_milli(device.uuid) == fresh_snapshot.free_milli(device.uuid)


def _try_allocate(ledger: Ledger, rng: random.Random, key: str, devices: list[Device], now: float) -> None:
    count, milli, memory = rng.choice(_SHAPES)
    picked = rng.sample(devices, count)
    request = GPURequest.build(gpus=count if milli == 1000 else milli / 1000,
                               memory=f"{memory // GIB}GiB" if memory else None)
    with suppress(AllocationConflictError):  # full, cordoned, unhealthy or gone: nothing written
        ledger.allocate(key, request, [share(d, milli, memory) for d in picked], holder=rng.choice("ab"),
                        lease_s=rng.choice((5, 50, 500)), now=now)


def _random_step(
    ledger: Ledger, rng: random.Random, step: int, now: float, devices: list[Device], *,
    inventory: bool = True,
) -> None:
    """One random write through ``ledger`` (of the allocations only unless ``inventory``)."""
    active = ledger.active()
    keys = [a.key for a in active if a.status == "active"]
    kinds = ["allocate"] * 4 + ["release", "release", "renew", "process", "start", "quarantine",
                                "end_quarantine", "expire", "reconcile"]
    kind = rng.choice(kinds + ["inventory"] * inventory)
    if kind == "allocate" or (not keys and kind in ("release", "renew", "process", "start", "quarantine")):
        _try_allocate(ledger, rng, f"task-{step}", devices, now)
    elif kind == "release":
        ledger.release(rng.choice(keys), reason="done", now=now, succeeded=rng.random() < 0.5)
    elif kind == "renew":
        ledger.renew(rng.choice(keys), lease_s=rng.choice((5, 500)), now=now)
    elif kind == "process":
        ledger.attach_process(rng.choice(keys), HolderProcess("worker", "h", rng.randint(1, 9), now))
    elif kind == "start":  # a task process on a GPU host: its launch, then its process recorded
        key = rng.choice(keys)
        ledger.record_event("launch", key, env={}, host="h")
        ledger.start_on_host(key, "h", HolderProcess("task", "h", rng.randint(1, 9), now))
    elif kind == "quarantine":
        ledger.quarantine(rng.choice(keys), host="h1", reason="host lost", now=now)
    elif kind == "end_quarantine":
        fenced = ledger.quarantined("h1")
        if fenced:
            ledger.end_quarantine(rng.choice(fenced).key, host="h1", reason="confirmed", now=now)
    elif kind == "expire":
        ledger.expire_leases(now)
    elif kind == "reconcile":
        ledger.reconcile([k for k in keys if rng.random() < 0.7], holder=rng.choice("ab"), now=now)
    else:
        _change_inventory(ledger, rng, now)


def _change_inventory(ledger: Ledger, rng: random.Random, now: float) -> None:
    """Cordons, health and a node leaving and coming back: the nodes shown change, so the
    snapshot is rebuilt (and a node's usage hidden while it is gone)."""
    shown = ledger.snapshot().nodes
    names, uuids = [n.name for n in shown], [d.uuid for n in shown for d in n.devices]
    choice = rng.randrange(4)
    if choice == 0:
        ledger.cordon(rng.choice([*names, rng.choice(uuids)]), "test", now=now)
    elif choice == 1:
        for target in (*names, *uuids):
            ledger.uncordon(target, now=now)
    elif choice == 2:
        ledger.set_health(rng.choice(uuids), rng.choice([Health.HEALTHY, Health.UNHEALTHY]), "test", now=now)
    else:
        ledger.sync_inventory(fleet(nodes=rng.choice((2, 3))), "test", now=now)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_long_lived_reader_sees_what_a_fresh_read_sees_after_every_write(url: str, seed: int) -> None:
    rng = random.Random(seed)
    with Ledger(url) as reader, Ledger(url) as writer:
        reader.migrate()
        reader.sync_inventory(fleet(nodes=3), "test")
        devices = [d for n in reader.snapshot().nodes for d in n.devices]
        _assert_same_as_fresh(url, reader, 0.0)
        for step in range(70):
            now = float(step)
            _random_step(rng.choice([reader, writer]), rng, step, now, devices)
            if rng.random() < 0.8:  # sometimes two writes between reads
                _assert_same_as_fresh(url, reader, now)
        _assert_same_as_fresh(url, reader, 100.0)
        assert reader._active_view.full_reads == 1  # the first read only: every later one followed the feed


def test_the_snapshot_is_reused_while_nothing_changed_and_rebuilt_when_nodes_change(ledger: Ledger) -> None:
    device = ledger.snapshot().node("n0").devices[0]
    first, _ = ledger.cycle_view(1.0)
    second, _ = ledger.cycle_view(2.0)
    assert second.usage is first.usage and second.taken_at == 2.0  # nothing changed: shared
    ledger.allocate("a", GPURequest.build(gpus=1), [share(device)], holder="t")
    third, _ = ledger.cycle_view(3.0)
    assert third.nodes is first.nodes and third.used(device.uuid).used_milli == 1000
    assert first.used(device.uuid).used_milli == 0  # an earlier snapshot never changes
    ledger.cordon("n1", "maintenance")
    fourth, _ = ledger.cycle_view(4.0)
    assert fourth.nodes is not first.nodes and fourth.node("n1").cordoned
    assert fourth.used(device.uuid).used_milli == 1000


def test_a_database_behind_the_same_url_that_went_back_is_read_in_full(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(url) as reader:
        reader.migrate()
        reader.sync_inventory(fleet(), "test")
        devices = [d for n in reader.snapshot().nodes for d in n.devices]
        for i, device in enumerate(devices[:3]):
            reader.allocate(f"t{i}", GPURequest.build(gpus=1), [share(device)], holder="t")
        assert [a.key for a in reader.cycle_view()[1]] == ["t0", "t1", "t2"]
        with reader.engine.begin() as conn:  # as if another, older database replaced it
            conn.execute(sa.update(ALLOCATIONS).values(change=0))
            conn.execute(sa.update(ALLOCATIONS).where(ALLOCATIONS.c.key != "t0").values(released_at=1.0))
        _, active = reader.cycle_view()
        assert [a.key for a in active] == ["t0"] and reader._active_view.full_reads == 2


def test_a_row_id_that_names_another_key_is_read_in_full(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(url) as reader:
        reader.migrate()
        reader.sync_inventory(fleet(), "test")
        device = reader.snapshot().node("n0").devices[0]
        reader.allocate("t0", GPURequest.build(gpus=1), [share(device)], holder="t")
        reader.cycle_view()
        with reader.engine.begin() as conn:  # another database whose row 1 is another allocation
            conn.execute(sa.update(ALLOCATIONS).values(key="other", change=ALLOCATIONS.c.change + 1))
        _, active = reader.cycle_view()
        assert [a.key for a in active] == ["other"] and reader._active_view.full_reads == 2


def test_each_incremental_read_equals_a_full_read_in_the_same_transaction_under_concurrent_writers(
    url: str,
) -> None:
    """Writers in threads commit in any order; every read that follows the feed must equal the
    full read of the same snapshot (a change committed late but numbered early is never lost)."""
    with Ledger(url) as setup:
        setup.migrate()
        setup.sync_inventory(fleet(nodes=4), "test")
        devices = [d for n in setup.snapshot().nodes for d in n.devices]
    stop = threading.Event()
    failures: list[BaseException] = []

    def write(worker: int) -> None:
        rng = random.Random(worker)
        try:
            with Ledger(url) as writer:
                step = 0
                while not stop.is_set():
                    step += 1
                    with suppress(UnknownAllocationError):  # renewed as another writer released it
                        _random_step(writer, rng, worker * 100000 + step, float(step), devices,
                                     inventory=False)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(3)]
    for thread in threads:
        thread.start()
    view = ActiveView()
    try:
        with Ledger(url) as reader:
            for _ in range(60):
                with read_tx(reader.engine) as conn:
                    followed = view.read(conn)
                    full = active_allocations(conn)
                    assert followed == full
                    assert dict(view.usage) == usage_of(full) == active_usage(conn)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not failures, failures
    assert view.full_reads == 1


def test_retaken_holds_what_a_new_snapshot_holds() -> None:
    nodes = tuple(fleet())
    devices = [d for n in nodes for d in n.devices]
    first = FleetSnapshot(nodes, {devices[0].uuid: DeviceUsage(1000, 0)}, "test", 1.0)
    same = first.retaken(2.0)
    assert same.usage is first.usage and same.taken_at == 2.0 and same.nodes is nodes
    used = {devices[1].uuid: DeviceUsage(500, GIB), devices[2].uuid: DeviceUsage(1000, 0)}
    replaced = first.retaken(3.0, used)
    assert replaced == FleetSnapshot(nodes, used, "test", 3.0)
    changed = replaced.retaken(4.0, changed={devices[1].uuid: None, devices[3].uuid: DeviceUsage(250, 0)})
    assert dict(changed.usage) == {devices[2].uuid: DeviceUsage(1000, 0),
                                   devices[3].uuid: DeviceUsage(250, 0)}
    assert dict(replaced.usage) == used  # the snapshot it came from is unchanged
    assert changed.device(devices[3].uuid) is replaced.device(devices[3].uuid)


def test_running_tasks_are_converted_once_per_allocation_the_reader_keeps(ledger: Ledger) -> None:
    devices = [d for n in ledger.snapshot().nodes for d in n.devices]
    kept_running = RunningTasks()
    hour = GPURequest.build(gpus=1, expected_duration="1h")
    for i, device in enumerate(devices[:4]):
        ledger.allocate(f"t{i}", hour, [share(device)], holder="t")
    ledger.quarantine("t3", host="h1", reason="host lost")
    first = kept_running(ledger.cycle_view()[1])
    assert first == running_tasks(ledger.cycle_view()[1]) and [t.key for t in first] == ["t0", "t1", "t2"]
    ledger.release("t0", reason="done")
    ledger.renew("t2", lease_s=9999)
    ledger.allocate("t4", GPURequest.build(gpus=1), [share(devices[4])], holder="t")
    second = kept_running(ledger.cycle_view()[1])
    assert second == running_tasks(ledger.cycle_view()[1]) and [t.key for t in second] == ["t1", "t2", "t4"]
    assert second[0] is first[1]  # t1's row did not change: its task is the one converted before
