"""Pool sync: pure slot computation, writes into a real (migrated) Airflow metadata DB, and both
GPU executors keeping the pools from the ledger's live hosts through their shared hooks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from _ledger_support import lose_silent_hosts

from gpusched.airflow.pool_sync import PoolSyncer, desired_pool_slots, sync_pools, usable_devices
from gpusched.catalog import Vendor
from gpusched.errors import ConfigurationError
from gpusched.model import Device, FleetSnapshot, Health, Node
from gpusched.request import Partition

GIB = 1024**3


def _node(name: str, n: int, *, standby: bool = False, cordoned: bool = False) -> Node:
    devices = tuple(
        Device(
            uuid=f"GPU-{name}-{i}", index=i, node=name, model="a100-sxm4-80gb", vendor=Vendor.NVIDIA,
            architecture="sm_80", memory_bytes=80 * GIB,
        )
        for i in range(n)
    )
    return Node(name=name, rack="r1", devices=devices, standby=standby, cordoned=cordoned)


def _fleet(*nodes: Node) -> FleetSnapshot:
    return FleetSnapshot(nodes=nodes, source="test")


def _slots(snapshot: FleetSnapshot) -> dict[str, int]:
    return {name: spec.slots for name, spec in desired_pool_slots(snapshot).items()}


def test_split_of_ten_devices_is_7_2_1() -> None:
    assert _slots(_fleet(_node("a", 8), _node("b", 2))) == {"gpu_training": 7, "gpu_burst": 2, "gpu_dev": 1}


def test_largest_remainder_keeps_the_total() -> None:
    # 13 devices: exact 9.1 / 2.6 / 1.3 -> 9 / 3 / 1 (burst has the largest remainder)
    slots = _slots(_fleet(_node("a", 8), _node("b", 5)))
    assert slots == {"gpu_training": 9, "gpu_burst": 3, "gpu_dev": 1}
    for n in range(0, 40):
        assert sum(_slots(_fleet(_node("a", n))).values()) == n


def test_unusable_capacity_is_not_counted() -> None:
    a = _node("a", 8)
    faulty = replace(a.devices[0], health=Health.UNHEALTHY)
    cordoned = replace(a.devices[1], cordoned=True)
    degraded = replace(a.devices[2], health=Health.DEGRADED)
    snap = _fleet(a, _node("spare", 8, standby=True), _node("off", 4, cordoned=True))
    snap = snap.with_device(faulty).with_device(cordoned).with_device(degraded)
    assert usable_devices(snap) == 6
    assert _slots(snap) == {"gpu_training": 4, "gpu_burst": 1, "gpu_dev": 1}


def test_custom_split_and_invalid_split() -> None:
    snap = _fleet(_node("a", 10))
    split = {Partition.TRAINING: 500, Partition.BURST: 500, Partition.DEV: 0}
    slots = {k: v.slots for k, v in desired_pool_slots(snap, split).items()}
    assert slots == {"gpu_training": 5, "gpu_burst": 5, "gpu_dev": 0}
    with pytest.raises(ConfigurationError, match="summing to 1000"):
        desired_pool_slots(snap, {Partition.TRAINING: 700, Partition.BURST: 200, Partition.DEV: 50})


# ---- against a real Airflow metadata database ------------------------------------------------


def _pools() -> dict[str, tuple[int, str]]:
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session

    with create_session() as session:
        return {p.pool: (p.slots, p.description) for p in Pool.get_pools(session=session)}


@pytest.mark.airflow
def test_sync_creates_then_updates_only_on_change(airflow_db: str) -> None:
    snap = _fleet(_node("a", 8), _node("b", 2))
    assert sync_pools(snap) == {"gpu_training": 7, "gpu_burst": 2, "gpu_dev": 1}
    pools = _pools()
    assert pools["gpu_training"][0] == 7 and pools["gpu_burst"][0] == 2 and pools["gpu_dev"][0] == 1
    assert "10 usable GPUs" in pools["gpu_training"][1]
    assert "default_pool" in pools  # Airflow's own pool is left alone

    assert sync_pools(snap) == {}  # nothing changed: nothing written

    smaller = snap.with_device(replace(snap.device("GPU-a-0"), health=Health.UNHEALTHY))
    changed = sync_pools(smaller)
    assert changed == {"gpu_training": 6, "gpu_burst": 2, "gpu_dev": 1}
    assert _pools()["gpu_training"][0] == 6


@pytest.mark.airflow
def test_sync_inside_callers_session_and_rate_limit(airflow_db: str) -> None:
    from airflow.utils.session import create_session

    snap = _fleet(_node("c", 20))
    with create_session() as session:
        sync_pools(snap, session)
    assert _pools()["gpu_training"][0] == 14

    syncer = PoolSyncer(interval_s=60)
    assert syncer.maybe_sync(_fleet(_node("c", 30)), now=0.0) is True
    assert _pools()["gpu_training"][0] == 21
    assert syncer.maybe_sync(_fleet(_node("c", 30)), now=10.0) is False  # not due, same capacity
    assert syncer.maybe_sync(_fleet(_node("c", 10)), now=20.0) is True  # capacity changed: at once
    assert _pools()["gpu_training"][0] == 7
    assert syncer.maybe_sync(_fleet(_node("c", 10)), now=90.0) is True  # interval elapsed


@pytest.mark.airflow
def test_sync_follows_the_configured_quota_shares(
    airflow_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quota = tmp_path / "quota.yaml"
    quota.write_text("shares: {training: 50, burst: 30, dev: 20}\n")
    monkeypatch.setenv("GPUSCHED_QUOTA_FILE", str(quota))
    assert sync_pools(_fleet(_node("q", 10))) == {"gpu_training": 5, "gpu_burst": 3, "gpu_dev": 2}
    assert "50.0% of 10 usable GPUs" in _pools()["gpu_training"][1]


FLEET = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets" / "multihost.yaml"


@pytest.mark.airflow
@pytest.mark.parametrize(("module", "name"), [("executor", "GPUExecutor"),
                                              ("celery_executor", "GPUCeleryExecutor")])
def test_both_executors_keep_the_pools_of_the_live_hosts(
    airflow_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, name: str
) -> None:
    import importlib

    from gpusched.airflow.gpu_executor_hooks import GPUExecutorHooks
    from gpusched.hardware.detect import detect_backend
    from gpusched.hardware.host_slice import HostSlice

    monkeypatch.setenv("GPUSCHED_POOL_SYNC", "true")  # as docker-compose.yaml sets it
    monkeypatch.setenv("GPUSCHED_DB_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    monkeypatch.delenv("GPUSCHED_QUOTA_FILE", raising=False)
    cls = getattr(importlib.import_module(f"gpusched.airflow.{module}"), name)
    assert cls.sync_pools is GPUExecutorHooks.sync_pools  # one implementation for every executor
    executor = cls(parallelism=4)
    try:
        executor.ledger.migrate()
        t0 = 1_000_000.0
        for host in ("host-a", "host-b"):  # two GPU hosts with 2 GPUs each
            nodes = HostSlice(detect_backend("simulated", fleet=FLEET), host).discover()
            executor.ledger.register_host(host, nodes, stale_after_s=10, now=t0)
        assert executor.sync_pools(now=t0) is True
        pools = _pools()
        assert (pools["gpu_training"][0], pools["gpu_burst"][0], pools["gpu_dev"][0]) == (3, 1, 0)
        assert "4 usable GPUs" in pools["gpu_training"][1]

        executor.ledger.heartbeat_host("host-a", now=t0 + 60)
        assert lose_silent_hosts(executor.ledger, 30, now=t0 + 60) == ["host-b"]
        assert executor.sync_pools(now=t0 + 5) is False  # checked at most every 10 s
        assert executor.sync_pools(now=t0 + 60) is True  # the fleet shrank: synced at once
        pools = _pools()
        assert (pools["gpu_training"][0], pools["gpu_burst"][0], pools["gpu_dev"][0]) == (2, 0, 0)
    finally:
        executor.ledger.close()


@pytest.mark.airflow
def test_no_pools_without_pool_sync(airflow_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusched.airflow.celery_executor import GPUCeleryExecutor

    monkeypatch.setenv("GPUSCHED_POOL_SYNC", "false")
    monkeypatch.setenv("GPUSCHED_DB_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    executor = GPUCeleryExecutor(parallelism=4)
    try:
        assert executor.sync_pools(now=0.0) is False
    finally:
        executor.ledger.close()
