"""Backend selection (simulated only as a declared fallback) and the ``gpusched inventory`` command."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpusched.errors import BackendUnavailableError, ConfigurationError, FleetFileError
from gpusched.hardware import detect
from gpusched.hardware.simulated import SimulatedBackend

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "gpusched" / "include" / "fleets" / "small.yaml"


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSCHED_BACKEND", raising=False)
    monkeypatch.delenv("GPUSCHED_FLEET", raising=False)


def _no_real_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make sure 'auto' sees no device even on a GPU host (the fallback is what is tested)."""
    import gpusched.hardware.amd as amd
    import gpusched.hardware.ascend as ascend
    import gpusched.hardware.nvidia as nvidia

    def absent(*args: Any, **kwargs: Any) -> Any:
        raise BackendUnavailableError("no device in this test")

    monkeypatch.setattr(nvidia, "NvidiaBackend", absent)
    monkeypatch.setattr(amd, "AmdBackend", absent)
    monkeypatch.setattr(ascend, "AscendBackend", absent)


def test_auto_falls_back_to_simulated_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    _no_real_devices(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="gpusched.hardware.detect"):
        backend = detect.detect_backend()
    assert isinstance(backend, SimulatedBackend)
    assert backend.name == "simulated"
    assert backend.description == "simulated fleet (include/fleets/default.yaml)"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "simulated fleet (include/fleets/default.yaml)" in record.getMessage()
    assert "no NVIDIA, AMD or Ascend device found" in record.getMessage()


def test_auto_prefers_real_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpusched.hardware.nvidia as nvidia

    sentinel = object()
    monkeypatch.setattr(nvidia, "NvidiaBackend", lambda: sentinel)
    assert detect.detect_backend("auto") is sentinel


def test_env_selects_simulated_and_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCHED_BACKEND", "simulated")
    monkeypatch.setenv("GPUSCHED_FLEET", str(SMALL))
    backend = detect.detect_backend()
    assert backend.name == "simulated"
    assert "small.yaml" in backend.description  # type: ignore[attr-defined]
    assert sum(len(n.devices) for n in backend.discover()) == 12


def test_unknown_kind_names_the_accepted_values() -> None:
    with pytest.raises(ConfigurationError, match="auto, nvidia, amd, ascend, simulated"):
        detect.detect_backend("cuda")


def test_explicit_vendor_never_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_real_devices(monkeypatch)
    with pytest.raises(BackendUnavailableError):
        detect.detect_backend("nvidia")
    with pytest.raises(BackendUnavailableError):
        detect.detect_backend("amd")


def test_bad_fleet_file_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("racks: nope\n")
    with pytest.raises(FleetFileError, match=r"bad\.yaml"):
        detect.detect_backend("simulated", fleet=bad)


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSCHED_BACKEND", "GPUSCHED_FLEET")}
    env["GPUSCHED_BACKEND"] = "simulated"  # this host may have a GPU; the simulated view is tested
    return subprocess.run([sys.executable, "-m", "gpusched.cli", "inventory", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, check=check, timeout=120)


def test_inventory_json_lists_the_default_fleet() -> None:
    out = _cli("--json")
    data = json.loads(out.stdout)
    assert data["simulated"] is True
    assert data["source"] == "simulated fleet (include/fleets/default.yaml)"
    devices = [d for node in data["nodes"] for d in node["devices"]]
    assert len({d["model"] for d in devices}) >= 5
    assert {d["vendor"] for d in devices} == {"nvidia", "amd", "ascend"}
    node = next(n for n in data["nodes"] if n["name"] == "a-a100-1")
    assert {"name", "rack", "labels", "standby", "devices"} <= set(node)
    first = node["devices"][0]
    assert {"uuid", "index", "model", "vendor", "architecture", "memory_bytes", "numa", "pcie_switch",
            "island", "links", "health"} <= set(first)
    assert first["island"] == "a-a100-1/nvlink0" and len(first["links"]) == 3
    assert any(n["standby"] for n in data["nodes"])
    assert "simulated fleet" in out.stderr  # the warning that it is not real hardware


def test_inventory_text_shows_topology_and_injected_faults() -> None:
    SimulatedBackend(SMALL).inject_fault("GPU-sim-n1-2", "ecc")
    out = _cli("--fleet", str(SMALL))
    assert "simulated fleet" in out.stdout and "SIMULATED" in out.stdout
    assert "rack r1" in out.stdout and "node n5  (standby)" in out.stdout
    line = next(li for li in out.stdout.splitlines() if "GPU-sim-n1-2" in li)
    assert "island=n1/nvlink1" in line and "numa=" in line and "switch=n1/pcie1" in line
    assert "[unhealthy]" in line


def test_inventory_bad_fleet_exits_2_with_the_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("racks:\n  - name: r\n    nodes: [{name: n, devices: {model: H900}}]\n")
    out = _cli("--fleet", str(bad), check=False)
    assert out.returncode == 2
    assert "gpusched inventory: error: fleet file" in out.stderr
    assert "H900" in out.stderr and "fix:" in out.stderr
