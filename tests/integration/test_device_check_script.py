"""The real-device check script is ready to run: it imports, its MIG check accepts a correct MIG
layout and flags a wrong one, and on a host without NVIDIA GPUs it fails with a JSON report (it
can only pass on real hardware)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpusched.fleetfile import load_fleet
from gpusched.hardware.simulated import default_fleet_path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check_nvml.py"


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_check_nvml", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.problems.clear()
    module.warnings.clear()
    return module


def _mig_node_devices() -> list[Any]:
    (node,) = [n for n in load_fleet(default_fleet_path()) if n.name == "a-a100mig-1"]
    return list(node.devices)


def test_mig_check_accepts_what_nvidia_smi_lists(script: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    devices = _mig_node_devices()
    slices = [d for d in devices if d.parent]
    listing = "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5c9e2c5a-0000-0000-0000-000000000000)\n" + "".join(
        f"  MIG {d.profile} Device {k}: (UUID: {d.uuid})\n" for k, d in enumerate(slices)
    )
    monkeypatch.setattr(script, "nvidia_smi_mig", lambda: script.parse_mig_listing(listing))
    monkeypatch.setattr(
        script, "run_child", lambda env, path: {"count": 1, "uuids": [env["CUDA_VISIBLE_DEVICES"]]}
    )
    result = script.check_mig(devices, [])
    assert script.problems == [], script.problems
    assert len(result["instances"]) == 4 and result["child_sees"]["count"] == 1


def test_mig_check_flags_a_missing_instance(script: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    devices = _mig_node_devices()
    monkeypatch.setattr(script, "nvidia_smi_mig", lambda: {})
    monkeypatch.setattr(script, "run_child", lambda env, path: {"count": 0})
    script.check_mig(devices, [])
    assert any("differ from nvidia-smi" in p for p in script.problems)
    assert any("saw" in p for p in script.problems)


def test_without_a_gpu_the_script_fails_with_a_json_report() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] is False and "NVML" in report["crash"]


def test_dynamic_mig_sequence_re_partitions_an_idle_mig_gpu_and_puts_its_layout_back(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The simulated fleet stands in for NVML: the local provider changes what discovery shows.
    from gpusched.hardware.mig_provider import LocalMigProvider
    from gpusched.hardware.simulated import SimulatedBackend

    backend = SimulatedBackend(default_fleet_path(), state_folder=tmp_path)
    devices = _mig_node_devices()
    monkeypatch.setattr(
        script, "run_child", lambda env, path: {"count": 1, "uuids": [env["CUDA_VISIBLE_DEVICES"]]}
    )
    provider = LocalMigProvider(tmp_path / "mig_layouts.json")
    result = script.check_mig_repartition(devices, [], backend.discover, provider=provider, busy=set)
    assert script.problems == [], script.problems
    assert result["ran"] and result["gpu"] == "GPU-sim-a-a100mig-1-0"
    assert result["trial"] == ["1g.10gb", "1g.10gb"]
    assert [a["profile"] for a in result["after"]] == result["trial"]
    assert result["restored"] == sorted(result["original"]) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
    assert result["child_sees"]["count"] == 1


def test_dynamic_mig_sequence_skips_with_the_reason(script: ModuleType) -> None:
    (plain,) = [n for n in load_fleet(default_fleet_path()) if n.name == "a-h100-1"]
    result = script.check_mig_repartition(list(plain.devices), [], lambda: [], busy=set)
    assert not result["ran"] and "no GPU is in MIG mode" in result["skipped"]
    assert "reset" in result["skipped"]
    devices = _mig_node_devices()
    result = script.check_mig_repartition(devices, [], lambda: [], busy=lambda: {"GPU-sim-a-a100mig-1-0"})
    assert not result["ran"] and "runs compute processes" in result["skipped"]
    result = script.check_mig_repartition(devices, [], lambda: [], busy=lambda: None)
    assert not result["ran"] and "NVML cannot list" in result["skipped"]
    assert script.problems == []
