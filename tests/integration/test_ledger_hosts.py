"""GPU hosts in the ledger: registration, name clashes, heartbeats, lost and re-admitted hosts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _ledger_support import lose_silent_hosts

from gpusched.errors import ConfigurationError, HostConflictError, WrongHostError
from gpusched.hardware.detect import detect_backend
from gpusched.hardware.host_slice import HostSlice
from gpusched.ledger import Ledger
from gpusched.model import DeviceShare

FLEET = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets" / "multihost.yaml"


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as led:
        led.migrate()
        yield led


def _slice(host: str) -> HostSlice:
    return HostSlice(detect_backend("simulated", fleet=FLEET), host)


def test_registered_hosts_make_the_snapshot_and_a_silent_one_leaves_it(ledger: Ledger) -> None:
    for host in ("host-a", "host-b"):
        ledger.register_host(host, _slice(host).discover(), stale_after_s=10, now=100.0)
    assert {n.name for n in ledger.snapshot().nodes} == {"host-a", "host-b"}
    assert ledger.node_hosts() == {"host-a": ("host-a", "live"), "host-b": ("host-b", "live")}
    ledger.heartbeat_host("host-a", now=115.0)
    assert lose_silent_hosts(ledger, 10, now=116.0) == ["host-b"]
    lost = ledger.host("host-b")
    assert lost is not None and "no heartbeat" in (lost.reason or "")
    assert {n.name for n in ledger.snapshot().nodes} == {"host-a"}
    assert lose_silent_hosts(ledger, 10, now=117.0) == []  # reported once
    ledger.heartbeat_host("host-b", now=120.0)  # it came back: re-admitted
    assert {n.name for n in ledger.snapshot().nodes} == {"host-a", "host-b"}
    kinds = [(e.subject, e.detail.get("state")) for e in ledger.events(kinds=["host"])]
    assert ("host-b", "lost") in kinds and ("host-b", "readmitted") in kinds


def test_a_name_registered_by_a_live_host_with_other_devices_is_refused(ledger: Ledger) -> None:
    ledger.register_host("host-a", _slice("host-a").discover(), stale_after_s=10, now=100.0)
    other = [n for n in _slice("host-b").discover()]
    with pytest.raises(HostConflictError, match="already registered with other devices"):
        ledger.register_host("host-a", other, stale_after_s=10, now=105.0)
    # the same devices again (agent restart) are fine, and so is a new fingerprint once it went silent
    ledger.register_host("host-a", _slice("host-a").discover(), stale_after_s=10, now=106.0)
    ledger.register_host("host-a", other, stale_after_s=10, now=200.0)


def test_a_host_slice_names_the_missing_node() -> None:
    with pytest.raises(ConfigurationError, match=r"no node of that name.*host-a, host-b"):
        _slice("host-z").discover()
    assert {s.uuid for s in _slice("host-b").sample()} == {"GPU-sim-host-b-0", "GPU-sim-host-b-1"}


def test_listener_refuses_devices_of_another_host() -> None:
    from gpusched.airflow.listener import check_host

    share = DeviceShare("GPU-sim-host-a-0", "host-a", 0, 1000, 0)
    check_host("host-a", [share], ["host-a"])
    with pytest.raises(WrongHostError, match="devices are on host-a but it landed on GPU host host-b"):
        check_host("host-b", [share], ["host-b"])
