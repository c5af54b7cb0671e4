#!/usr/bin/env python3
"""Device check for the NVIDIA backend on a real GPU host.

Runs :class:`gpusched.hardware.nvidia.NvidiaBackend` discovery and three samples on the real
devices, cross-checks them with ``nvidia-smi``, checks that ``detect_backend()`` picks NVIDIA (not
the simulated fleet) and that ``gpusched inventory --json`` reports the same devices, then turns
an allocation of device 0 into ``CUDA_VISIBLE_DEVICES`` (``gpusched.envexport.devices_env``, by
index and by UUID) and asks the CUDA driver in a child process which devices it sees: exactly
the allocated one, and none for an unknown UUID.

Prints one JSON report on stdout (also written to ``$OUT/device_check_nvml.json`` when ``OUT``
is set) and exits 1 when any check fails, 0 otherwise. Needs Python ≥ 3.11 and pynvml
(nvidia-ml-py); if pynvml is not importable it is taken from the repository's ``.venv``.

    python3 scripts/device_check_nvml.py
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import ctypes, json, os
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    print(json.dumps({"error": f"libcuda.so.1: {exc}"})); raise SystemExit(0)
rc = lib.cuInit(0)
out = {"init": rc, "count": 0, "uuids": [], "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
if rc == 0:
    count = ctypes.c_int()
    lib.cuDeviceGetCount(ctypes.byref(count))
    out["count"] = count.value
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid
    for i in range(count.value):
        dev = ctypes.c_int()
        lib.cuDeviceGet(ctypes.byref(dev), i)
        raw = (ctypes.c_ubyte * 16)()
        get_uuid(raw, dev)
        h = bytes(raw).hex()
        out["uuids"].append(f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}")
print(json.dumps(out))
"""

problems: list[str] = []
warnings: list[str] = []


def check(condition: bool, message: str) -> bool:
    if not condition:
        problems.append(message)
    return condition


def ensure_pynvml() -> str | None:
    """Import pynvml, falling back to the copy in .venv; returns a folder to put on PYTHONPATH."""
    try:
        import pynvml  # noqa: F401
        return None
    except ImportError:
        pass
    found = sorted(glob.glob(str(ROOT / ".venv" / "lib" / "python*" / "site-packages" / "pynvml.py")))
    if not found:
        raise SystemExit("pynvml is not importable and .venv has none: pip install nvidia-ml-py")
    folder = tempfile.mkdtemp(prefix="pynvml-")
    shutil.copy(found[-1], folder)
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("pynvml", Path(folder) / "pynvml.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["pynvml"] = module
    spec.loader.exec_module(module)
    return folder


def child_env(extra: dict[str, str], pythonpath: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_child(extra: dict[str, str], pythonpath: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                         env=child_env(extra, pythonpath))
    try:
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"error": f"child failed rc={out.returncode}: {out.stderr.strip()[-500:]}"}


def nvidia_smi() -> list[dict[str, str]] | None:
    if not shutil.which("nvidia-smi"):
        warnings.append("nvidia-smi not on PATH: no cross-check")
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total,pci.bus_id",
         "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=60,
    )
    if out.returncode != 0:
        problems.append(f"nvidia-smi failed: {out.stderr.strip()}")
        return None
    keys = ("index", "uuid", "name", "memory_mib", "bus_id")
    return [dict(zip(keys, (p.strip() for p in line.split(",")), strict=True))
            for line in out.stdout.strip().splitlines()]


def main() -> int:
    report: dict[str, Any] = {"python": sys.version.split()[0], "problems": problems, "warnings": warnings}
    if sys.version_info < (3, 11):  # noqa: UP036 - the device host's python may be older
        problems.append("gpusched needs Python >= 3.11")
        print(json.dumps(report, indent=2))
        return 1
    extra_path = ensure_pynvml()
    pythonpath = [str(ROOT)] + ([extra_path] if extra_path else [])

    from gpusched.catalog import arch_rank, default_catalog
    from gpusched.envexport import devices_env
    from gpusched.hardware.detect import detect_backend
    from gpusched.hardware.nvidia import NvidiaBackend
    from gpusched.model import MILLI, DeviceShare, FleetSnapshot, Health

    started = time.perf_counter()
    backend = NvidiaBackend()
    report["init_ms"] = round((time.perf_counter() - started) * 1000, 1)
    report["description"] = backend.description
    report["features"] = sorted(backend.features)
    started = time.perf_counter()
    nodes = backend.discover()
    report["discover_ms"] = round((time.perf_counter() - started) * 1000, 1)
    check(len(nodes) == 1, f"expected one node, got {len(nodes)}")
    devices = list(nodes[0].devices)
    node = nodes[0]
    report["node"] = {"name": node.name, "cpu_milli": node.cpu_milli, "memory_bytes": node.memory_bytes}
    report["devices"] = [
        {"uuid": d.uuid, "index": d.index, "model": d.model, "architecture": d.architecture,
         "memory_bytes": d.memory_bytes, "numa": d.numa_node, "pcie_switch": d.pcie_switch,
         "island": d.island, "link": str(d.link), "peers": list(d.peers), "health": str(d.health),
         "mig_enabled": d.mig_enabled}
        for d in devices
    ]
    check(bool(devices), "no device discovered")
    check("topology" in backend.features, "feature 'topology' missing")
    catalog = default_catalog()
    for position, d in enumerate(devices):
        tag = f"device {d.index} ({d.uuid})"
        check(d.uuid.startswith("GPU-") and len(d.uuid) == 40, f"{tag}: uuid is not a GPU-… UUID")
        check(d.index == position, f"{tag}: index {d.index} != position {position}")
        check(d.memory_bytes > 0, f"{tag}: memory_bytes is {d.memory_bytes}")
        check(bool(re.fullmatch(r"sm_\d{2,3}", d.architecture)) and arch_rank(d.architecture) >= 50,
              f"{tag}: architecture {d.architecture!r} is not a real compute capability")
        check(d.numa_node >= -1, f"{tag}: numa {d.numa_node}")
        check((d.pcie_switch or "").startswith(nodes[0].name + "/"), f"{tag}: pcie_switch {d.pcie_switch}")
        check(d.node == nodes[0].name, f"{tag}: node name mismatch")
        model = catalog.find(d.model)
        if model is None:
            warnings.append(f"{tag}: NVML name {d.model!r} is not in the catalog (add an alias)")
        else:
            check(abs(d.memory_bytes - model.memory_bytes) <= model.memory_bytes * 0.1,
                  f"{tag}: memory {d.memory_bytes} far from catalog {model.memory_bytes} for {model.name}")
            check(model.architecture == d.architecture,
                  f"{tag}: catalog says {model.architecture}, NVML says {d.architecture}")
        if d.health is not Health.HEALTHY:
            warnings.append(f"{tag}: health {d.health}")
        if d.island is not None:
            check(bool(d.peers), f"{tag}: island {d.island} without peers")

    rounds = []
    for _ in range(3):
        started = time.perf_counter()
        samples = backend.sample()
        rounds.append({"ms": round((time.perf_counter() - started) * 1000, 1),
                       "samples": [dataclasses.asdict(s) for s in samples]})
        by_uuid = {s.uuid: s for s in samples}
        check(set(by_uuid) == {d.uuid for d in devices}, "sample() does not cover the discovered devices")
        for d in devices:
            s = by_uuid.get(d.uuid)
            if s is None:
                continue
            tag = f"sample {d.uuid}"
            check(0 <= s.utilization_pct <= 100, f"{tag}: utilization {s.utilization_pct}")
            check(s.memory_total_bytes == d.memory_bytes, f"{tag}: total memory differs from discovery")
            check(0 <= s.memory_used_bytes <= s.memory_total_bytes, f"{tag}: used {s.memory_used_bytes} B")
            check(10_000 < s.temperature_mc < 110_000, f"{tag}: temperature {s.temperature_mc} m°C")
            check(s.power_mw > 0, f"{tag}: power {s.power_mw} mW")
            counters_ok = s.ecc_uncorrected >= 0 and all(isinstance(x, int) for x in s.xid_errors)
            check(counters_ok, f"{tag}: counters")
        time.sleep(0.5)
    report["sample_rounds"] = rounds

    smi = nvidia_smi()
    if smi is not None:
        report["nvidia_smi"] = smi
        check([r["uuid"] for r in smi] == [d.uuid for d in devices], "UUIDs/order differ from nvidia-smi")
        for row, d in zip(smi, devices, strict=False):
            check(int(row["memory_mib"]) == d.memory_bytes // 2**20,
                  f"{d.uuid}: nvidia-smi memory {row['memory_mib']} MiB vs {d.memory_bytes // 2**20} MiB")
    backend.close()

    chosen = detect_backend("auto")
    check(chosen.name == "nvidia", f"detect_backend('auto') chose {chosen.name!r} on a GPU host")
    chosen.close()
    cli = subprocess.run([sys.executable, "-m", "gpusched.cli", "inventory", "--json"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT,
                         env=child_env({"GPUSCHED_BACKEND": "auto"}, pythonpath))
    try:
        inventory = json.loads(cli.stdout)
        check(inventory["simulated"] is False, "gpusched inventory says simulated on a GPU host")
        listed = [dev["uuid"] for node in inventory["nodes"] for dev in node["devices"]]
        check(listed == [d.uuid for d in devices], "gpusched inventory lists other devices")
    except (ValueError, KeyError) as exc:
        problems.append(f"gpusched inventory --json failed ({exc}): {cli.stderr.strip()[-500:]}")

    visibility = []
    target = devices[0]
    if target.mig_enabled:
        warnings.append("MIG is enabled on device 0: CUDA needs MIG-… UUIDs; child visibility check skipped")
    else:
        snapshot = FleetSnapshot(tuple(nodes), source="device-check")
        share = DeviceShare(target.uuid, target.node, target.index, MILLI, target.memory_bytes)
        for use_uuids in (False, True):
            env = devices_env([share], snapshot, key="device-check", use_uuids=use_uuids)
            seen = run_child({k: env[k] for k in env}, pythonpath)
            visibility.append({"use_uuids": use_uuids, "env": env.get("CUDA_VISIBLE_DEVICES"), "seen": seen})
            check(seen.get("uuids") == [target.uuid],
                  f"child with CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')} saw {seen}")
        bogus = run_child({"CUDA_VISIBLE_DEVICES": "GPU-00000000-0000-0000-0000-000000000000"}, pythonpath)
        visibility.append({"env": "unknown uuid", "seen": bogus})
        check("error" not in bogus and bogus.get("count") == 0, f"child with an unknown UUID saw {bogus}")
        everything = run_child({}, pythonpath)
        visibility.append({"env": None, "seen": everything})
        check(everything.get("uuids") == [d.uuid for d in devices if not d.mig_enabled],
              f"child without CUDA_VISIBLE_DEVICES saw {everything}")
    report["visibility"] = visibility
    report["ok"] = not problems

    text = json.dumps(report, indent=2, default=str)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "device_check_nvml.json").write_text(text)
    return 0 if not problems else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except SystemExit:
        raise
    except BaseException as exc:  # any crash is a failed check, reported as JSON too
        print(json.dumps({"ok": False, "crash": repr(exc), "problems": problems, "warnings": warnings}))
        raise SystemExit(1) from exc
