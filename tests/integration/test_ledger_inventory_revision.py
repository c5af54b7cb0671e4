"""The inventory's revision: a scheduling cycle reuses the nodes it loaded until the inventory changes.

Every change a snapshot must show (a sync that changes a value, health overrides, cordons, lost
and re-admitted hosts, another process's write) reaches the next snapshot of a long-lived
``Ledger``; a sync that changes nothing keeps the loaded nodes (same tuple, so the placement
engine's per-fleet index is reused too).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from _ledger_support import fleet, lose_silent_hosts, share

from gpusched.hardware.detect import detect_backend
from gpusched.hardware.host_slice import HostSlice
from gpusched.ledger import Ledger
from gpusched.ledger.inventory import revision
from gpusched.model import Health
from gpusched.placement.index import fleet_index
from gpusched.request import GPURequest

FLEET = Path(__file__).resolve().parents[2] / "gpusched" / "include" / "fleets" / "multihost.yaml"


def _revision(led: Ledger) -> int:
    with led.engine.connect() as conn:
        return revision(conn)


def test_an_unchanged_inventory_is_loaded_once_and_usage_still_moves(ledger: Ledger) -> None:
    first = ledger.snapshot()
    device = first.node("n0").devices[0]
    ledger.allocate("a", GPURequest.build(gpus=1), [share(device, 1000, device.memory_bytes)], holder="t")
    second, active = ledger.cycle_view()
    assert second.nodes is first.nodes  # the same tuple: nothing reloaded
    assert fleet_index(second) is fleet_index(first)
    assert second.usage[device.uuid].used_milli == 1000 and [a.key for a in active] == ["a"]
    half = GPURequest.build(gpus=0.25, memory="8GiB")
    other = first.node("n1").devices[0]
    for key in ("b", "c"):  # two fractions of one device: their usage adds up
        ledger.allocate(key, half, [share(other, 250, 8 << 30)], holder="t")
    view, _ = ledger.cycle_view()  # usage summed from the allocations it read ...
    assert view.usage == ledger.snapshot().usage  # ... equals the usage query's
    assert view.usage[other.uuid].used_milli == 500 and view.usage[other.uuid].used_memory_bytes == 16 << 30
    ledger.release("a", reason="done")
    assert device.uuid not in ledger.snapshot().usage and device.uuid not in ledger.cycle_view()[0].usage


def test_a_sync_that_changes_nothing_keeps_the_revision_and_one_that_does_bumps_it(ledger: Ledger) -> None:
    before = _revision(ledger)
    nodes = ledger.snapshot().nodes
    ledger.sync_inventory(fleet(), "test", now=1e9)  # only the time stamps differ
    assert _revision(ledger) == before
    assert ledger.snapshot().nodes is nodes
    changed = fleet()
    changed[1] = replace(changed[1], devices=tuple(
        replace(d, health=Health.DEGRADED) if d.index == 0 else d for d in changed[1].devices
    ))
    ledger.sync_inventory(changed, "test")
    assert _revision(ledger) == before + 1
    assert ledger.snapshot().node("n1").devices[0].health is Health.DEGRADED
    ledger.sync_inventory(fleet(nodes=3), "test")  # a node added
    assert [n.name for n in ledger.snapshot().nodes] == ["n0", "n1", "n2"]
    ledger.sync_inventory(fleet(nodes=1), "test")  # two removed
    assert [n.name for n in ledger.snapshot().nodes] == ["n0"]


def test_health_overrides_and_cordons_reach_the_next_snapshot(ledger: Ledger) -> None:
    uuid = ledger.snapshot().node("n0").devices[1].uuid
    ledger.set_health(uuid, Health.UNHEALTHY, "Xid 79")
    assert ledger.snapshot().node("n0").devices[1].health is Health.UNHEALTHY
    ledger.cordon("n1", "maintenance")
    assert ledger.snapshot().node("n1").cordoned
    ledger.cordon(uuid, "bad")
    assert ledger.snapshot().node("n0").devices[1].cordoned
    ledger.uncordon("n1")
    ledger.uncordon(uuid)
    snap = ledger.snapshot()
    assert not snap.node("n1").cordoned and not snap.node("n0").devices[1].cordoned


def test_another_process_writes_reach_a_long_lived_reader(url: str, ledger: Ledger) -> None:
    reader_nodes = ledger.snapshot().nodes
    with Ledger(url) as other:  # another process's ledger (its own pool, its own cache)
        other.cordon("n0", "from elsewhere")
        other.sync_inventory(fleet(nodes=3), "test")
    snap = ledger.snapshot()
    assert snap.nodes is not reader_nodes
    assert snap.node("n0").cordoned and [n.name for n in snap.nodes] == ["n0", "n1", "n2"]


def test_lost_hosts_leave_the_view_and_come_back(tmp_path: Path) -> None:
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as led:
        led.migrate()
        for host in ("host-a", "host-b"):
            led.register_host(host, HostSlice(detect_backend("simulated", fleet=FLEET), host).discover(),
                              stale_after_s=10, now=100.0)
        both = led.snapshot().nodes
        assert {n.name for n in both} == {"host-a", "host-b"}
        led.heartbeat_host("host-a", now=115.0)
        assert lose_silent_hosts(led, 10, now=116.0) == ["host-b"]
        assert {n.name for n in led.snapshot().nodes} == {"host-a"}
        led.heartbeat_host("host-b", now=120.0)
        again = led.snapshot().nodes
        assert {n.name for n in again} == {"host-a", "host-b"}
        assert again == both


def test_the_allocations_a_cycle_reads_equal_a_fresh_read_as_they_come_and_go(ledger: Ledger) -> None:
    devices = [d for n in ledger.snapshot().nodes for d in n.devices]
    whole = GPURequest.build(gpus=1)
    for step in range(6):  # each cycle: two tasks end (from the third on), two start
        if step >= 2:
            for part in "ab":
                ledger.release(f"t{step - 2}-{part}", reason="done")
        for part in "ab":
            d = devices[(2 * step + (part == "b")) % len(devices)]
            ledger.allocate(f"t{step}-{part}", whole, [share(d)], holder="t")
        _, active = ledger.cycle_view()  # shares of allocations seen before come from its memory
        assert [(a.key, a.shares, a.lease_expires_at) for a in active] == \
            [(a.key, a.shares, a.lease_expires_at) for a in ledger.active()]
    ledger.renew("t5-b", lease_s=9999)  # a renewed lease is read again, not remembered
    renewed = {a.key: a for a in ledger.cycle_view()[1]}["t5-b"]
    assert renewed.lease_expires_at == ledger.get("t5-b").lease_expires_at
