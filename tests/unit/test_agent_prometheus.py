"""Prometheus exposition: DCGM names and labels, valid text format, served over HTTP."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

from gpusched.agent.prometheus import CONTENT_TYPE, MetricsServer, metric_families, render_metrics
from gpusched.catalog import Vendor
from gpusched.ledger import Allocation
from gpusched.model import Device, DeviceSample, DeviceShare, FleetSnapshot, Health, Node
from gpusched.request import GPURequest

GIB = 2**30
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(rf"^({_NAME})(\{{(?:{_LABEL})(?:,{_LABEL})*\}})? (\S+)$")
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def parse_exposition(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A strict reader of the text format 0.0.4: TYPE before samples, one TYPE per family."""
    assert text.endswith("\n")
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in {"gauge", "counter", "untyped", "histogram", "summary"}, line
            assert name not in types, f"duplicate TYPE for {name}"
            types[name] = kind
            families[name] = []
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a valid sample line: {line!r}"
        name, labels, value = match.groups()
        assert name in types, f"sample of {name} before its TYPE"
        families[name].append((dict(_LABEL_PAIR.findall(labels or "")), float(value)))
    return families


def _fleet() -> FleetSnapshot:
    devices = (
        Device("GPU-aaa", 0, "host-1", "H100-SXM-80GB", Vendor.NVIDIA, "sm_90", 80 * GIB),
        Device("AMD-bbb", 1, "host-1", "MI300X", Vendor.AMD, "gfx942", 192 * GIB,
               health=Health.UNHEALTHY, cordoned=True),
    )
    return FleetSnapshot((Node("host-1", "rack", devices),), source="simulated")


def test_dcgm_metrics_have_dcgm_names_labels_and_units() -> None:
    samples = [
        DeviceSample("GPU-aaa", 1.0, 10, 10 * GIB, 80 * GIB, 40_000, 100_000),
        DeviceSample("GPU-aaa", 2.0, 87, 20 * GIB, 80 * GIB, 71_500, 612_250, 0, ()),
        DeviceSample("AMD-bbb", 2.0, 0, GIB, 192 * GIB, 50_000, 90_000, 3, (48, 79)),
    ]
    share = DeviceShare("GPU-aaa", "host-1", 0, 500, 8 * GIB)
    alloc = Allocation('k"1', GPURequest.build(gpus=0.5, memory="8GiB"), (share,), "h", 0.0, 600.0)
    text = render_metrics(samples, _fleet(), [alloc], counters={("xid_hardware", "cordon"): 2})
    families = parse_exposition(text)
    util = families["DCGM_FI_DEV_GPU_UTIL"]
    nvidia = next(labels for labels, _ in util if labels["UUID"] == "GPU-aaa")
    assert nvidia == {"gpu": "0", "UUID": "GPU-aaa", "device": "nvidia0", "modelName": "H100-SXM-80GB",
                      "Hostname": "host-1"}
    value = {n: {lab["UUID"]: v for lab, v in families[n]} for n in families if n.startswith("DCGM_")}
    assert value["DCGM_FI_DEV_GPU_UTIL"]["GPU-aaa"] == 87  # the newest sample wins
    assert value["DCGM_FI_DEV_FB_USED"]["GPU-aaa"] == 20 * 1024  # MiB
    assert value["DCGM_FI_DEV_FB_FREE"]["GPU-aaa"] == 60 * 1024
    assert value["DCGM_FI_DEV_GPU_TEMP"]["GPU-aaa"] == 71.5
    assert value["DCGM_FI_DEV_POWER_USAGE"]["GPU-aaa"] == 612.25
    assert value["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == {"GPU-aaa": 0, "AMD-bbb": 3}
    assert value["DCGM_FI_DEV_XID_ERRORS"] == {"GPU-aaa": 0, "AMD-bbb": 79}  # last Xid, as DCGM
    assert families["gpusched_allocations"] == [({}, 1.0)]
    milli = {lab["UUID"]: v for lab, v in families["gpusched_device_allocated_milli"]}
    assert milli == {"GPU-aaa": 500, "AMD-bbb": 0}
    health = {(lab["UUID"], lab["state"]): v for lab, v in families["gpusched_device_health"]}
    assert health[("AMD-bbb", "unhealthy")] == 1 and health[("AMD-bbb", "healthy")] == 0
    assert {lab["UUID"]: v for lab, v in families["gpusched_device_cordoned"]} == {"GPU-aaa": 0, "AMD-bbb": 1}
    assert families["gpusched_alert_actions_total"] == [({"rule": "xid_hardware", "action": "cordon"}, 2)]
    assert families["gpusched_fleet_info"] == [({"source": "simulated"}, 1)]


def test_metrics_server_serves_the_library_exposition_on_loopback() -> None:
    server = MetricsServer(lambda: metric_families([], _fleet()), port=0)
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            assert response.headers["Content-Type"] == CONTENT_TYPE
            families = parse_exposition(response.read().decode())
        assert "DCGM_FI_DEV_GPU_TEMP" in families and families["gpusched_allocations"] == [({}, 0.0)]
        # prometheus_client's server negotiates the format: OpenMetrics for a scraper that asks.
        wants = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics",
                                       headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(wants, timeout=5) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            assert response.read().decode().rstrip().endswith("# EOF")
    finally:
        server.stop()
