"""Ledger core: migrations, inventory, allocate/release/renew/expire/reconcile, conflicts, restarts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa
from _ledger_support import GIB, fleet, share

from gpusched.errors import AllocationConflictError, LedgerError, UnknownAllocationError
from gpusched.ledger import Allocation, Ledger
from gpusched.ledger.migrate import current_revision, head_revision
from gpusched.model import MILLI, Health
from gpusched.request import GPURequest

WHOLE2 = GPURequest.build(gpus=2)
HALF = GPURequest.build(gpus=0.5, memory="30GiB")


def _devices(led: Ledger, node: str = "n0") -> list:
    return list(led.snapshot().node(node).devices)


def test_default_url_is_sqlite_wal_under_state_dir(tmp_path: Path) -> None:
    with Ledger() as led:
        led.migrate()
        assert led.engine.dialect.name == "sqlite"
        db = tmp_path / "airflow_home" / "gpusched" / "ledger.db"
        assert db.exists()
        with led.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000


def test_env_url_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "elsewhere" / "x.db"
    monkeypatch.setenv("GPUSCHED_DB_URL", f"sqlite:///{target}")
    with Ledger() as led:
        led.migrate()
    assert target.exists()


def test_migrate_twice_is_a_no_op(url: str) -> None:
    with Ledger(url) as led:
        assert current_revision(led.engine) is None
        led.migrate()
        led.sync_inventory(fleet(1, 2), "test")
        led.migrate()
        assert current_revision(led.engine) == head_revision()
        assert led.snapshot().total_devices() == 2
        tables = set(sa.inspect(led.engine).get_table_names())
        assert {"gpusched_allocations", "gpusched_allocation_shares", "gpusched_alembic_version"} <= tables


def test_snapshot_reflects_inventory_cordons_and_health(ledger: Ledger) -> None:
    snap = ledger.snapshot(now=123.0)
    assert snap.taken_at == 123.0 and snap.source == "test"
    assert [n.name for n in snap.nodes] == ["n0", "n1"]
    assert snap.node("n0").label("zone") == "a"
    assert snap.device("GPU-n0-2").pcie_switch == "n0-sw1"
    ledger.cordon("GPU-n0-1", "flaky fan")
    ledger.cordon("n1", "maintenance")
    ledger.set_health("GPU-n0-2", Health.UNHEALTHY, "Xid 79")
    snap = ledger.snapshot()
    assert snap.device("GPU-n0-1").cordoned and not snap.device("GPU-n0-0").cordoned
    assert snap.node("n1").cordoned
    assert snap.device("GPU-n0-2").health is Health.UNHEALTHY
    # A later sync (healthy report) keeps the cordon and the override.
    ledger.sync_inventory(fleet(), "test")
    snap = ledger.snapshot()
    assert snap.device("GPU-n0-1").cordoned and snap.node("n1").cordoned
    assert snap.device("GPU-n0-2").health is Health.UNHEALTHY
    ledger.uncordon("GPU-n0-1")
    ledger.uncordon("n1")
    ledger.set_health("GPU-n0-2", Health.HEALTHY, "replaced")
    snap = ledger.snapshot()
    assert not snap.device("GPU-n0-1").cordoned and not snap.node("n1").cordoned
    assert snap.device("GPU-n0-2").health is Health.HEALTHY
    kinds = [e.kind for e in ledger.events(20)]
    assert kinds.count("cordon") == 2 and kinds.count("uncordon") == 2 and "health" in kinds
    with pytest.raises(LedgerError, match="neither a device uuid nor a node name"):
        ledger.cordon("nope", "x")


def test_reported_health_is_combined_with_override(ledger: Ledger) -> None:
    nodes = fleet()
    sick = replace(nodes[0].devices[3], health=Health.DEGRADED)
    nodes[0] = replace(nodes[0], devices=(*nodes[0].devices[:3], sick))
    ledger.sync_inventory(nodes, "test")
    assert ledger.snapshot().device("GPU-n0-3").health is Health.DEGRADED
    ledger.set_health("GPU-n0-3", Health.HEALTHY, "fault chain says fine")
    assert ledger.snapshot().device("GPU-n0-3").health is Health.DEGRADED  # the worse one wins


def test_sync_removes_vanished_nodes_of_the_same_source_only(ledger: Ledger) -> None:
    ledger.sync_inventory(fleet(3, 1)[2:], "other")
    ledger.sync_inventory(fleet(1, 4), "test")
    snap = ledger.snapshot()
    assert {n.name for n in snap.nodes} == {"n0", "n2"}
    assert not snap.has_device("GPU-n1-0") and snap.has_device("GPU-n2-0")
    assert snap.source == "other+test"
    assert "inventory" in [e.kind for e in ledger.events(5)]


def test_allocate_release_and_usage(ledger: Ledger) -> None:
    d = _devices(ledger)
    a = ledger.allocate("t1", WHOLE2, [share(d[1]), share(d[0])], holder="s1", lease_s=60, now=1000.0)
    assert a.devices == ("GPU-n0-0", "GPU-n0-1") and a.active
    assert a.lease_expires_at == 1060.0 and a.total_milli == 2 * MILLI
    snap = ledger.snapshot()
    assert snap.free_milli("GPU-n0-0") == 0 and snap.free_memory("GPU-n0-1") == 0
    assert snap.free_milli("GPU-n0-2") == MILLI
    assert ledger.get("t1") == a and ledger.active() == [a]
    released = ledger.release("t1", reason="success", now=1010.0)
    assert released is not None and released.released_at == 1010.0 and released.status == "released"
    assert ledger.release("t1", reason="success") is None  # idempotent
    assert ledger.active() == []
    assert ledger.snapshot().free_milli("GPU-n0-0") == MILLI
    assert ledger.get("t1") == released  # the last one is still visible
    assert ledger.get("never") is None


def test_fractions_share_a_device_until_milli_or_memory_runs_out(ledger: Ledger) -> None:
    d = _devices(ledger)[0]
    ledger.allocate("f1", HALF, [share(d, 500, 30 * GIB)], holder="s")
    ledger.allocate("f2", HALF, [share(d, 400, 30 * GIB)], holder="s")
    with pytest.raises(AllocationConflictError) as milli_err:
        ledger.allocate("f3", HALF, [share(d, 200, 1 * GIB)], holder="s")
    assert milli_err.value.devices == (d.uuid,) and "re-plan and retry" in str(milli_err.value)
    with pytest.raises(AllocationConflictError, match="bytes free"):
        ledger.allocate("f4", HALF, [share(d, 100, 30 * GIB)], holder="s")
    ledger.allocate("f5", HALF, [share(d, 100, 20 * GIB)], holder="s")
    used = ledger.snapshot().used(d.uuid)
    assert used.used_milli == MILLI and used.used_memory_bytes == 80 * GIB
    assert {a.key for a in ledger.active()} == {"f1", "f2", "f5"}


def test_conflict_writes_nothing_and_names_every_bad_device(ledger: Ledger) -> None:
    d = _devices(ledger)
    ledger.allocate("a", WHOLE2, [share(d[0]), share(d[1])], holder="s")
    before = len(ledger.events(100))
    with pytest.raises(AllocationConflictError) as err:
        ledger.allocate("b", WHOLE2, [share(d[1]), share(d[2])], holder="s")
    assert err.value.devices == ("GPU-n0-1",)
    assert ledger.get("b") is None and len(ledger.events(100)) == before
    assert ledger.snapshot().free_milli("GPU-n0-2") == MILLI


@pytest.mark.parametrize("how", ["cordon-device", "cordon-node", "unhealthy", "unknown"])
def test_allocate_refuses_unusable_devices(ledger: Ledger, how: str) -> None:
    d = _devices(ledger)[0]
    target = share(d)
    if how == "cordon-device":
        ledger.cordon(d.uuid, "x")
    elif how == "cordon-node":
        ledger.cordon("n0", "x")
    elif how == "unhealthy":
        ledger.set_health(d.uuid, Health.UNHEALTHY, "ECC")
    else:
        target = replace(target, uuid="GPU-gone")
    with pytest.raises(AllocationConflictError, match="re-plan and retry"):
        ledger.allocate("k", GPURequest.build(gpus=1), [target], holder="s")


def test_allocate_is_idempotent_per_key(ledger: Ledger) -> None:
    d = _devices(ledger)
    first = ledger.allocate("k", WHOLE2, [share(d[0]), share(d[1])], holder="s", now=5.0)
    again = ledger.allocate("k", WHOLE2, [share(d[1]), share(d[0])], holder="s", now=9.0)
    assert again == first and len(ledger.active()) == 1
    with pytest.raises(AllocationConflictError, match="already holds"):
        ledger.allocate("k", WHOLE2, [share(d[2]), share(d[3])], holder="s")
    assert ledger.active() == [first]


def test_malformed_shares_are_refused(ledger: Ledger) -> None:
    d = _devices(ledger)
    req = GPURequest.build(gpus=1)
    with pytest.raises(LedgerError, match="no device shares"):
        ledger.allocate("k", req, [], holder="s")
    with pytest.raises(LedgerError, match="names a device twice"):
        ledger.allocate("k", req, [share(d[0], 500, 1), share(d[0], 500, 1)], holder="s")
    with pytest.raises(LedgerError, match="milli must be"):
        ledger.allocate("k", req, [share(d[0], 1500)], holder="s")


def test_renew_and_expire_leases(ledger: Ledger) -> None:
    d = _devices(ledger)
    req = GPURequest.build(gpus=1)
    ledger.allocate("short", req, [share(d[0])], holder="s", lease_s=10, now=100.0)
    ledger.allocate("long", req, [share(d[1])], holder="s", lease_s=10, now=100.0)
    ledger.renew("long", 100, now=105.0)
    assert ledger.get("long") is not None and ledger.get("long").lease_expires_at == 205.0  # type: ignore[union-attr]
    assert ledger.expire_leases(now=109.0) == []
    expired = ledger.expire_leases(now=111.0)
    assert [a.key for a in expired] == ["short"]
    assert expired[0].status == "expired" and expired[0].release_reason == "lease expired"
    assert [a.key for a in ledger.active()] == ["long"]
    assert ledger.snapshot().free_milli(d[0].uuid) == MILLI
    with pytest.raises(UnknownAllocationError, match="no active allocation"):
        ledger.renew("short")
    assert "expire" in [e.kind for e in ledger.events(10)]


def test_reconcile_releases_only_dead_tasks_of_this_holder(ledger: Ledger) -> None:
    d = _devices(ledger)
    req = GPURequest.build(gpus=1)
    for i, (key, holder) in enumerate([("a", "s1"), ("b", "s1"), ("c", "s2")]):
        ledger.allocate(key, req, [share(d[i])], holder=holder)
    released = ledger.reconcile({"a"}, holder="s1")
    assert [a.key for a in released] == ["b"]
    assert sorted(a.key for a in ledger.active()) == ["a", "c"]
    assert ledger.reconcile({"a"}, holder="s1") == []
    assert [a.key for a in ledger.active(holder="s2")] == ["c"]


def test_a_try_starting_on_a_host_is_recorded_only_where_its_launch_sent_it(ledger: Ledger) -> None:
    from gpusched.records import HolderProcess

    d = _devices(ledger)
    ledger.allocate("t", GPURequest.build(gpus=1), [share(d[0])], holder="s")
    here = HolderProcess("task", "host-a", 41, 1.0)
    early = ledger.start_on_host("t", "host-a", here)  # the executor has not recorded the launch yet
    assert early.allocation is not None and early.launch is None and not early.recorded
    ledger.record_event("launch", "t", env={"CUDA_VISIBLE_DEVICES": "0"}, host="host-a")
    elsewhere = ledger.start_on_host("t", "host-b", HolderProcess("task", "host-b", 42, 1.0))
    assert elsewhere.launch is not None and not elsewhere.recorded
    assert ledger.get("t").processes == ()  # type: ignore[union-attr]
    started = ledger.start_on_host("t", "host-a", here)
    assert started.recorded and started.launch is not None
    assert started.launch.detail["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert started.allocation is not None and started.allocation.shares == (share(d[0]),)
    assert ledger.start_on_host("t", "host-a", here).recorded  # the same process is not repeated
    assert ledger.get("t").processes == (here,)  # type: ignore[union-attr]
    ledger.release("t", reason="done")
    gone = ledger.start_on_host("t", "host-a", here)
    assert gone.allocation is None and not gone.recorded


def test_allocations_survive_reopening(url: str) -> None:
    with Ledger(url) as first:
        first.migrate()
        first.sync_inventory(fleet(1, 2), "test")
        d = list(first.snapshot().devices())
        made = first.allocate("keep", HALF, [share(d[0], 500, 30 * GIB)], holder="s", now=50.0)
    with Ledger(url) as second:
        second.migrate()
        assert second.get("keep") == made
        assert second.active() == [made]
        assert second.snapshot().used(d[0].uuid).used_milli == 500
        assert isinstance(second.release("keep", reason="killed"), Allocation)
    with Ledger(url) as third:
        assert third.active() == []


def test_migrations_build_exactly_the_declared_schema(url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from gpusched.ledger.schema import METADATA, VERSION_TABLE

    with Ledger(url) as led:
        led.migrate()
        with led.engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            assert compare_metadata(context, METADATA) == []


def test_a_forked_child_gets_its_own_connections(ledger: Ledger) -> None:
    import multiprocessing

    d = _devices(ledger)
    ledger.allocate("parent", GPURequest.build(gpus=1), [share(d[0])], holder="p")  # pool now warm
    ctx = multiprocessing.get_context("fork")
    seen = ctx.Queue()
    child = ctx.Process(target=_allocate_in_child, args=(ledger, share(d[1]), seen))
    child.start()
    child_identity = seen.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    assert sorted(a.key for a in ledger.active()) == ["child", "parent"]
    if ledger.engine.dialect.name == "postgresql":
        assert child_identity != _connection_identity(ledger)  # not the parent's server session


def _connection_identity(ledger: Ledger) -> object:
    with ledger.engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            return conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        return None


def _allocate_in_child(ledger: Ledger, target: object, seen: object) -> None:
    seen.put(_connection_identity(ledger))  # type: ignore[attr-defined]
    ledger.allocate("child", GPURequest.build(gpus=1), [target], holder="c")  # type: ignore[list-item]


def test_an_unmigrated_database_says_to_migrate(url: str) -> None:
    with Ledger(url) as led, pytest.raises(LedgerError, match="gpusched ledger migrate"):
        led.snapshot()


def test_syncs_and_allocations_at_once_neither_deadlock_nor_overcommit(url: str) -> None:
    """An agent re-syncing the inventory while allocators work (PostgreSQL: row-lock order)."""
    import threading

    with Ledger(url) as led:
        led.migrate()
        nodes = fleet(2, 4)
        led.sync_inventory(nodes, "test")
        devices = sorted(led.snapshot().devices(), key=lambda d: d.uuid)
        request = GPURequest.build(gpus=2)
        failures: list[BaseException] = []

        def sync_loop() -> None:
            try:
                for _ in range(15):
                    led.sync_inventory(list(reversed(nodes)), "test")
            except BaseException as exc:
                failures.append(exc)

        syncer = threading.Thread(target=sync_loop)
        syncer.start()
        for i in range(30):
            pair = [share(devices[-1 - (i % 4)]), share(devices[i % 4])]  # first and last uuids
            try:
                ledger_alloc = led.allocate(f"k{i}", request, pair, holder="s")
                led.release(ledger_alloc.key, reason="success")
            except AllocationConflictError as exc:
                failures.append(exc)
        syncer.join(120)
        assert failures == []
        assert led.active() == [] and len(led.events(500, kinds=["allocate"])) == 30


def test_in_memory_ledger_keeps_one_database() -> None:
    with Ledger("sqlite://") as led:
        led.migrate()
        led.sync_inventory(fleet(1, 1), "test")
        d = next(led.snapshot().devices())
        led.allocate("k", GPURequest.build(gpus=1), [share(d)], holder="s")
        assert [a.key for a in led.active()] == ["k"]


def test_history_of_matches_prefix_and_suffix_literally(ledger: Ledger) -> None:
    d = _devices(ledger)
    keys = ["a/t/-1/1/run_%x", "a/t/-1/2/run_%x", "a/t/-1/1/runA%x", "a/t/-1/1/other", "a/u/-1/1/run_%x",
            "a\\t/-1/1/run_%x"]
    for n, key in enumerate(keys):
        ledger.allocate(key, GPURequest.build(gpus=1), [share(d[n % len(d)])], holder="h", now=100.0 + n)
        ledger.release(key, reason="done", now=101.0 + n)
    # '%' and '_' are not wildcards; '\\' is not an escape; released allocations are included.
    found = ledger.history_of([("a/t/", "/run_%x")])
    assert [a.key for a in found] == ["a/t/-1/1/run_%x", "a/t/-1/2/run_%x"]
    assert all(not a.active for a in found)
    both = ledger.history_of([("a/t/", "/run_%x"), ("a/u/", "/run_%x"), ("a\\t/", "/run_%x")])
    assert [a.key for a in both] == [
        "a/t/-1/1/run_%x", "a/t/-1/2/run_%x", "a/u/-1/1/run_%x", "a\\t/-1/1/run_%x"]
    assert ledger.history_of([]) == []


def test_upgrade_rewrites_a_move_stored_by_0008_as_device_share_dicts(url: str) -> None:
    from gpusched.ledger.migrate import upgrade
    from gpusched.model import DeviceShare

    request = GPURequest.build(gpus=1).to_dict()
    with Ledger(url) as led:
        upgrade(led.engine, "0008_moves")
        with led.engine.begin() as conn:  # a row as 0008's code wrote it: shares as lists
            conn.execute(sa.text(
                "INSERT INTO gpusched_moves (next_key, old_key, holder, from_model, to_model, shares, "
                "placement, gain, request, author, reason, notice_at, deadline) VALUES (:n, :o, :h, :f, "
                ":t, :s, :p, 1.5, :r, :r, 'faster', 10.0, 40.0)"),
                {"n": "k/2", "o": "k/1", "h": "GPUExecutor@a", "f": "K80", "t": "V100",
                 "s": '[["n0-gpu0", "n0", 0, 1000, 0]]', "p": '[["n1-gpu1", "n1", 1, 500, 1024]]',
                 "r": json.dumps(request)})
        led.migrate()
        (move,) = led.moves()
        assert move.shares == (DeviceShare("n0-gpu0", "n0", 0, 1000, 0),)
        assert move.placement == (DeviceShare("n1-gpu1", "n1", 1, 500, 1024),)
        with led.engine.connect() as conn:
            stored = conn.execute(sa.text("SELECT placement FROM gpusched_moves")).scalar_one()
        stored = stored if isinstance(stored, list) else json.loads(stored)
        assert stored == [DeviceShare("n1-gpu1", "n1", 1, 500, 1024).to_dict()]


def test_upgrade_to_0012_records_the_outcome_of_runs_released_before(url: str) -> None:
    from gpusched.ledger.migrate import upgrade

    request = GPURequest.build(gpus=1).to_dict()
    rows = [("a", "task succeeded"), ("b", "task process ended (task success)"),
            ("c", "task process ended (task failed)"), ("d", "preempted for x; requeued")]
    with Ledger(url) as led:
        upgrade(led.engine, "0011_inventory_revision")
        with led.engine.begin() as conn:  # rows as the code before 0012 wrote them
            for key, reason in rows:
                conn.execute(sa.text(
                    "INSERT INTO gpusched_allocations (key, request, holder, created_at, "
                    "lease_expires_at, released_at, release_reason, status) "
                    "VALUES (:k, :r, 'x', 1.0, 2.0, 3.0, :why, 'released')"),
                    {"k": key, "r": json.dumps(request), "why": reason})
        led.migrate()
        assert {a.key: a.status for a in led.history(0.0)} == {
            "a": "succeeded", "b": "succeeded", "c": "released", "d": "released"}
