#!/usr/bin/env python3
"""Device check for the NVIDIA backend on a real GPU host.

Runs :class:`gpusched.hardware.nvidia.NvidiaBackend` discovery and three samples on the real
devices, cross-checks them with ``nvidia-smi``, checks that ``detect_backend()`` picks NVIDIA (not
the simulated fleet) and that ``gpusched inventory --json`` reports the same devices, then turns
an allocation of device 0 into ``CUDA_VISIBLE_DEVICES`` (``gpusched.hardware.envexport.devices_env``, by
index and by UUID) and asks the CUDA driver in a child process which devices it sees: exactly
the allocated one, and none for an unknown UUID.

MIG: every GPU in MIG mode must list its MIG instances (``MIG-…`` UUIDs, profile, memory, SM
share) exactly as ``nvidia-smi -L`` does, and a child given one instance's UUID must see exactly
one device. The script never changes MIG mode or resets a GPU (with no GPU in MIG mode it reports
that MIG discovery found nothing, as it should).

Dynamic MIG for real (``mig_repartition`` in the report): on a GPU already in MIG mode with no
compute process on it, the NVML provider the agent uses (``NvmlMigProvider.apply``) destroys its
instances and creates a trial layout (the smallest catalog profile, twice), discovery must show
exactly that layout and a child given the new instance's UUID must see one device; then the
original layout is created again (same profiles; the instances get new ``MIG-…`` UUIDs). Skipped,
with the reason, when no GPU is MIG-capable, none is in MIG mode, every one runs processes, or
the current layout has a profile the catalog does not name (it could not be put back exactly).

End to end: a task is placed by the placement engine on the real fleet (a whole GPU, and a
hard-isolated fraction when a MIG instance exists), its environment exported by
``devices_env``, and a child process does real work on what it sees (CUDA driver API: context,
256 MiB allocation, memset, copy back, verify) while NVML is asked which GPU runs the child.

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

WORK = r"""
import ctypes, json, os, sys, time
lib = ctypes.CDLL("libcuda.so.1")
def ok(rc, what):
    if rc != 0:
        print(json.dumps({"error": f"{what} failed with CUDA error {rc}"})); sys.exit(0)
ok(lib.cuInit(0), "cuInit")
count = ctypes.c_int(); ok(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
dev = ctypes.c_int(); ok(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ok(lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
size = 256 * 2**20
ptr = ctypes.c_uint64(); ok(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
ok(lib.cuMemsetD8_v2(ptr, ctypes.c_ubyte(0x5A), ctypes.c_size_t(size)), "cuMemsetD8")
host = (ctypes.c_ubyte * size)()
ok(lib.cuMemcpyDtoH_v2(host, ptr, ctypes.c_size_t(size)), "cuMemcpyDtoH")
good = all(host[i] == 0x5A for i in range(0, size, 4096))
print(json.dumps({"ready": True, "pid": os.getpid(), "count": count.value, "verified": good,
                  "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)
time.sleep(3)
lib.cuMemFree_v2(ptr); lib.cuCtxDestroy_v2(ctx)
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


def nvidia_smi_mig() -> dict[str, str] | None:
    """MIG UUID → profile from ``nvidia-smi -L`` ("  MIG 3g.40gb Device 0: (UUID: MIG-…)")."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return parse_mig_listing(out.stdout)


def parse_mig_listing(text: str) -> dict[str, str]:
    """MIG UUID → profile from ``nvidia-smi -L`` text."""
    found = re.findall(r"MIG\s+(\S+)\s+Device\s+\d+:\s+\(UUID:\s+(MIG-[^)\s]+)\)", text)
    return {uuid: profile for profile, uuid in found}


def check_mig(devices: list[Any], pythonpath: list[str]) -> dict[str, Any]:
    """MIG instances as discovered, cross-checked with nvidia-smi -L and a child's view."""
    gpus = [d for d in devices if d.parent is None]
    slices = [d for d in devices if d.parent is not None]
    result: dict[str, Any] = {
        "gpus_in_mig_mode": [g.uuid for g in gpus if g.mig_enabled],
        "instances": [{"uuid": d.uuid, "parent": d.parent, "profile": d.profile,
                       "memory_bytes": d.memory_bytes, "compute_milli": d.compute_milli} for d in slices],
    }
    if not result["gpus_in_mig_mode"]:
        check(not slices, "MIG instances discovered on GPUs that are not in MIG mode")
        warnings.append("no GPU is in MIG mode: MIG discovery found nothing, as expected (MIG mode is "
                        "left as it is; enable it with nvidia-smi -mig 1 to check instances)")
        return result
    for d in slices:
        check(d.uuid.startswith("MIG-"), f"MIG instance {d.uuid}: not a MIG-… UUID")
        check(0 < d.compute_milli <= 1000 and d.memory_bytes > 0,
              f"MIG instance {d.uuid}: bad share or memory")
        check(any(g.uuid == d.parent and g.mig_enabled for g in gpus),
              f"MIG instance {d.uuid}: unknown parent")
    listed = nvidia_smi_mig()
    if listed is not None:
        result["nvidia_smi"] = listed
        check(set(listed) == {d.uuid for d in slices},
              f"MIG UUIDs differ from nvidia-smi -L: {sorted(listed)}")
        for d in slices:
            if d.uuid in listed and d.profile is not None:
                check(d.profile.split(".")[-2:] == listed[d.uuid].split(".")[-2:],
                      f"{d.uuid}: profile {d.profile} vs nvidia-smi {listed[d.uuid]}")
    if slices:
        seen = run_child({"CUDA_VISIBLE_DEVICES": slices[0].uuid}, pythonpath)
        result["child_sees"] = seen
        check(seen.get("count") == 1, f"a child given {slices[0].uuid} saw {seen}")
    return result


def gpus_with_processes() -> set[str] | None:
    """UUIDs of the GPUs with a compute process on them or on one of their MIG instances; None
    when NVML cannot say (then nothing is re-partitioned)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        busy: set[str] = set()
        answered = False
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            raw = pynvml.nvmlDeviceGetUUID(handle)
            uuid = raw.decode() if isinstance(raw, bytes) else str(raw)
            handles = [handle]
            try:
                if pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
                    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                        try:
                            handles.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))
                        except pynvml.NVMLError:
                            continue
            except pynvml.NVMLError:
                pass  # not MIG-capable
            for h in handles:
                try:
                    processes = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                except pynvml.NVMLError:
                    continue
                answered = True
                if processes:
                    busy.add(uuid)
        return busy if answered else None
    finally:
        pynvml.nvmlShutdown()


def check_mig_repartition(
    devices: list[Any], pythonpath: list[str], discover: Any, provider: Any = None, busy: Any = None
) -> dict[str, Any]:
    """Dynamic MIG's destroy-and-create sequence on a real idle MIG GPU, then the layout put back.

    ``discover`` returns the backend's nodes afresh; ``provider`` defaults to the NVML provider the
    agent runs; ``busy`` to :func:`gpus_with_processes` (both replaced in tests).
    """
    from gpusched.catalog import default_catalog
    from gpusched.model import MigStep

    result: dict[str, Any] = {"ran": False}

    def skip(reason: str) -> dict[str, Any]:
        result["skipped"] = reason
        warnings.append(f"dynamic MIG check skipped: {reason}")
        return result

    catalog = default_catalog()
    gpus = [d for d in devices if d.parent is None]
    capable = [g for g in gpus if (m := catalog.find(g.model)) is not None and "mig" in m.partitioning]
    if not capable:
        return skip(f"no MIG-capable GPU here ({', '.join(sorted({g.model for g in gpus})) or 'no GPU'})")
    in_mig = [g for g in capable if g.mig_enabled]
    if not in_mig:
        return skip("no GPU is in MIG mode; enabling it needs a GPU reset, which this check never does "
                    "(nvidia-smi -i <gpu> -mig 1 while the GPU is idle, then run the check again)")
    running = (busy or gpus_with_processes)()
    if running is None:
        return skip("NVML cannot list the compute processes, so no GPU is known to be idle")
    target = next((g for g in in_mig if g.uuid not in running), None)
    if target is None:
        return skip(f"every GPU in MIG mode runs compute processes ({', '.join(sorted(running))})")
    model = catalog.get(target.model)
    original = tuple(d.profile for d in devices if d.parent == target.uuid)
    if any(p is None or model.slice_profile(p) is None for p in original):
        return skip(f"{target.uuid}'s layout {list(original)} has a profile the catalog does not name, "
                    "so it could not be put back exactly")
    smallest = min(model.slice_profiles, key=lambda p: (p.compute_milli, p.memory_bytes))
    trial = (smallest.name,) * min(2, smallest.max_count)
    if sorted(trial) == sorted(str(p) for p in original):
        trial = (smallest.name,)
    if provider is None:
        from gpusched.hardware.mig_provider import NvmlMigProvider

        provider = NvmlMigProvider()
    result.update(ran=True, gpu=target.uuid, original=list(original), trial=list(trial))

    def slices_now() -> list[Any]:
        return [d for n in discover() for d in n.devices if d.parent == target.uuid]

    try:
        applied = provider.apply([MigStep(target.uuid, target.node, target.model, trial, "device check")])
        result["apply"] = {"applied": list(applied.applied), "detail": list(applied.detail),
                           "failed": list(getattr(applied, "failed", ()))}
        check(applied.applied == (target.uuid,), f"re-partitioning {target.uuid} into {list(trial)} failed: "
              f"{list(applied.detail)}")
        after = slices_now()
        result["after"] = [{"uuid": d.uuid, "profile": d.profile} for d in after]
        check(sorted(str(d.profile) for d in after) == sorted(trial),
              f"after the re-partition discovery shows {[d.profile for d in after]}, not {list(trial)}")
        if after:
            seen = run_child({"CUDA_VISIBLE_DEVICES": after[0].uuid}, pythonpath)
            result["child_sees"] = seen
            check(seen.get("count") == 1, f"a child given the new instance {after[0].uuid} saw {seen}")
    finally:
        back = provider.apply([MigStep(target.uuid, target.node, target.model, original, "restore")])
        result["restore"] = {"applied": list(back.applied), "detail": list(back.detail)}
        restored = sorted(str(d.profile) for d in slices_now())
        result["restored"] = restored
        check(back.applied == (target.uuid,) and restored == sorted(str(p) for p in original),
              f"{target.uuid}: the original layout {list(original)} is not back ({restored}); recreate it "
              f"with nvidia-smi mig -i <gpu> -cgi {','.join(str(p) for p in original)} -C")
    return result


def end_to_end(nodes: list[Any], pythonpath: list[str]) -> list[dict[str, Any]]:
    """Place tasks on the real fleet, export their environment, run real CUDA work in a child."""
    from gpusched.hardware.envexport import devices_env
    from gpusched.model import FleetSnapshot
    from gpusched.placement import PendingTask, PlacementRequest, Policy, place
    from gpusched.quota.policy import QuotaState
    from gpusched.request import GPURequest

    snapshot = FleetSnapshot(tuple(nodes), source="device-check")
    requests = [("whole GPU", GPURequest.build(gpus=1, vendor="nvidia"))]
    if any(d.parent is not None for d in snapshot.devices()):
        hard = GPURequest.build(gpus=0.1, memory="1GiB", isolation="hard")
        requests.append(("hard-isolated fraction", hard))
    runs = []
    for name, request in requests:
        plan = place(PlacementRequest(pending=[PendingTask(name, request, 0.0)], snapshot=snapshot,
                                      policy=Policy(), now=0.0, quota=QuotaState.unlimited()))
        if not plan.assignments:
            problems.append(f"end to end: {name} was not placed: {plan.rejections[0].reason}")
            continue
        shares = plan.assignments[0].shares
        env = devices_env(shares, snapshot, key=f"device-check/{name}")
        run: dict[str, Any] = {"task": name, "shares": [dataclasses.asdict(s) for s in shares],
                               "CUDA_VISIBLE_DEVICES": env["CUDA_VISIBLE_DEVICES"]}
        proc = subprocess.Popen([sys.executable, "-c", WORK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=child_env(env, pythonpath))
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            run["child"] = json.loads(line) if line.strip() else {"error": "no output"}
            run["running_on"] = gpus_running(int(run["child"].get("pid", -1)))
            proc.wait(timeout=60)
        except (ValueError, subprocess.TimeoutExpired) as exc:
            run["child"] = {"error": repr(exc)}
            proc.kill()
        child = run["child"]
        check(child.get("verified") is True and child.get("count") == 1,
              f"end to end: {name} with CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: {child}")
        target = snapshot.device(shares[0].uuid)
        physical = target.parent or target.uuid
        if run["running_on"]:
            check(run["running_on"] == [physical],
                  f"end to end: {name} ran on {run['running_on']}, not {physical}")
        else:
            warnings.append(f"end to end: NVML did not list the child's pid for {name} (pid namespace?)")
        runs.append(run)
    return runs


def gpus_running(pid: int) -> list[str]:
    """UUIDs of the GPUs whose compute processes include ``pid`` (NVML, host pid namespace)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            except pynvml.NVMLError:
                continue
            if pid in pids:
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                found.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        return found
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    report: dict[str, Any] = {"python": sys.version.split()[0], "problems": problems, "warnings": warnings}
    if sys.version_info < (3, 11):  # noqa: UP036 - the device host's python may be older
        problems.append("gpusched needs Python >= 3.11")
        print(json.dumps(report, indent=2))
        return 1
    extra_path = ensure_pynvml()
    pythonpath = [str(ROOT)] + ([extra_path] if extra_path else [])

    from gpusched.catalog import arch_rank, default_catalog
    from gpusched.hardware.detect import detect_backend
    from gpusched.hardware.envexport import devices_env
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
         "mig_enabled": d.mig_enabled, "parent": d.parent, "profile": d.profile}
        for d in devices
    ]
    check(bool(devices), "no device discovered")
    gpus = [d for d in devices if d.parent is None]
    check("topology" in backend.features, "feature 'topology' missing")
    catalog = default_catalog()
    for position, d in enumerate(gpus):
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
        check(set(by_uuid) == {d.uuid for d in gpus}, "sample() does not cover the discovered GPUs")
        for d in gpus:
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
        check([r["uuid"] for r in smi] == [d.uuid for d in gpus], "UUIDs/order differ from nvidia-smi")
        for row, d in zip(smi, gpus, strict=False):
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
    target = gpus[0]
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
        check(everything.get("uuids") == [d.uuid for d in gpus if not d.mig_enabled],
              f"child without CUDA_VISIBLE_DEVICES saw {everything}")
    report["visibility"] = visibility
    report["mig"] = check_mig(devices, pythonpath)
    report["mig_repartition"] = check_mig_repartition(devices, pythonpath, backend.discover)
    if report["mig_repartition"].get("ran"):
        nodes = backend.discover()  # the restored layout's instances have new MIG UUIDs
    report["end_to_end"] = end_to_end(nodes, pythonpath)
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
