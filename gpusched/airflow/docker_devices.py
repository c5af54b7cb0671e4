"""Which host devices, device requests and variables a container needs for one allocation.

Pure (no Docker, no Airflow): :func:`container_gpu_spec` maps the shares of one allocation on
one host to a :class:`GpuContainerSpec`; :mod:`gpusched.airflow.docker` turns that into Docker
API arguments.

Per vendor:

* NVIDIA — no device nodes; a device request ``device_ids=[uuids], capabilities=[["gpu"]]``
  that the NVIDIA container runtime resolves (it also mounts the driver libraries).
  ``CUDA_VISIBLE_DEVICES`` lists UUIDs, which stay valid inside the container. A MIG instance is
  requested by its ``MIG-…`` UUID (the runtime exposes just that instance: hard isolation) and
  needs neither MPS nor the host IPC namespace.
* AMD — ``/dev/kfd`` plus each device's DRM render node (``/dev/dri/renderD<128+index>`` unless
  ``render_nodes`` names it). ROCm numbers the devices it sees from 0, so inside the container
  ``HIP_VISIBLE_DEVICES`` / ``ROCR_VISIBLE_DEVICES`` are the container ordinals ``0..n-1``. An
  AMD compute partition (CPX …) is a logical device with its own index and render node, so it
  maps like a whole device and the container sees only that partition.
* Ascend — ``/dev/davinci<index>`` per device plus ``/dev/davinci_manager``, ``/dev/devmm_svm``
  and ``/dev/hisi_hdc``; ``ASCEND_RT_VISIBLE_DEVICES`` = container ordinals.

``GPUSCHED_ALLOCATION`` keeps the host view (host indices and uuids) for the task's records.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpusched.catalog import Vendor
from gpusched.errors import ConfigurationError
from gpusched.hardware.envexport import devices_env
from gpusched.model import MILLI, DeviceShare

__all__ = [
    "AMD_RENDER_BASE",
    "ASCEND_CONTROL_NODES",
    "DEV_ROOT_VAR",
    "GpuContainerSpec",
    "container_gpu_spec",
    "profiles_from_allocation",
    "shares_from_allocation",
]

DEV_ROOT_VAR = "GPUSCHED_DEV_ROOT"
"""Environment variable naming the host folder that holds the device nodes (default ``/dev``)."""

AMD_RENDER_BASE = 128
"""DRM render minors start at 128: device index i is ``renderD<128+i>`` unless told otherwise."""

ASCEND_CONTROL_NODES: tuple[str, ...] = ("davinci_manager", "devmm_svm", "hisi_hdc")
"""Ascend control devices every NPU container needs besides its ``davinciN`` nodes."""

_VISIBLE_VARS: Mapping[Vendor, tuple[str, ...]] = {
    Vendor.AMD: ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    Vendor.ASCEND: ("ASCEND_RT_VISIBLE_DEVICES",),
}


@dataclass(frozen=True, slots=True)
class GpuContainerSpec:
    """What a container needs to see exactly its allocated devices.

    Attributes:
        vendor: the allocation's vendor.
        node: the host the shares are on.
        gpu_device_ids: NVIDIA uuids for a ``DeviceRequest`` (empty for other vendors).
        devices: ``host_path:container_path:rwm`` entries for ``HostConfig.Devices``.
        environment: variables for the container (visible devices, fractions, allocation JSON).
        ipc_host: the container must share the host IPC namespace (NVIDIA MPS for a fraction).
        bind_mounts: (host path, container path) pairs the container needs (MPS pipe folder).
    """

    vendor: Vendor
    node: str
    gpu_device_ids: tuple[str, ...]
    devices: tuple[str, ...]
    environment: Mapping[str, str]
    ipc_host: bool = False
    bind_mounts: tuple[tuple[str, str], ...] = ()


def container_gpu_spec(
    shares: Sequence[DeviceShare],
    vendor: Vendor | str,
    *,
    key: str | None = None,
    models: Mapping[str, str] | None = None,
    dev_root: str | None = None,
    render_nodes: Mapping[str, str] | None = None,
    mps_pipe_dir: str = "/tmp/nvidia-mps",
    profiles: Mapping[str, str | None] | None = None,
) -> GpuContainerSpec:
    """The container spec for ``shares`` (all on one host, one vendor).

    Args:
        shares: the allocation's device shares.
        vendor: the allocation's vendor (``Vendor`` or its value).
        key: the allocation key, recorded in ``GPUSCHED_ALLOCATION``.
        models: uuid → model name for the allocation record.
        dev_root: host folder holding the device nodes (default ``$GPUSCHED_DEV_ROOT`` or ``/dev``);
            container paths are always under ``/dev``.
        render_nodes: AMD uuid → host render node path (e.g. from AMD SMI's DRM render minor),
            overriding the ``renderD<128+index>`` convention.
        mps_pipe_dir: host folder of the NVIDIA MPS control pipe (bound for fractional shares).
        profiles: uuid → slice profile (MIG instance / AMD partition) from the allocation record.

    Raises:
        ConfigurationError: no shares, shares on several hosts, or an unknown vendor.
    """
    if not shares:
        raise ConfigurationError("no device shares to give the container; pass the task's allocation")
    nodes = sorted({s.node for s in shares})
    if len(nodes) > 1:
        raise ConfigurationError(
            f"the allocation spans hosts {nodes}; one container runs on one host — start one "
            "container per host (one task per node of the gang)"
        )
    try:
        the_vendor = Vendor(str(vendor).lower())
    except ValueError:
        raise ConfigurationError(
            f"unknown vendor {vendor!r}; use one of {', '.join(v.value for v in Vendor)}"
        ) from None
    ordered = sorted(shares, key=lambda s: s.index)
    root = dev_root or os.environ.get(DEV_ROOT_VAR) or "/dev"
    env = devices_env(ordered, vendor=the_vendor, models=models, key=key, use_uuids=True, profiles=profiles)
    devices: list[str] = []
    gpu_ids: tuple[str, ...] = ()
    ipc_host = False
    binds: tuple[tuple[str, str], ...] = ()
    if the_vendor is Vendor.NVIDIA:
        gpu_ids = tuple(s.uuid for s in ordered)
        if len(ordered) == 1 and ordered[0].milli < MILLI:
            ipc_host = True
            binds = ((mps_pipe_dir, mps_pipe_dir),)
            env["CUDA_MPS_PIPE_DIRECTORY"] = mps_pipe_dir
    elif the_vendor is Vendor.AMD:
        devices.append(_map(root, "kfd"))
        for s in ordered:
            host = (render_nodes or {}).get(s.uuid)
            inside = f"dri/renderD{AMD_RENDER_BASE + s.index}"
            if host:
                inside = "dri/" + posixpath.basename(host)
                devices.append(f"{host}:/dev/{inside}:rwm")
            else:
                devices.append(_map(root, inside))
    else:
        devices.extend(_map(root, f"davinci{s.index}") for s in ordered)
        devices.extend(_map(root, name) for name in ASCEND_CONTROL_NODES)
    ordinals = ",".join(str(i) for i in range(len(ordered)))
    for var in _VISIBLE_VARS.get(the_vendor, ()):
        env[var] = ordinals
    return GpuContainerSpec(
        vendor=the_vendor,
        node=nodes[0],
        gpu_device_ids=gpu_ids,
        devices=tuple(devices),
        environment=env,
        ipc_host=ipc_host,
        bind_mounts=binds,
    )


def shares_from_allocation(
    allocation: Mapping[str, Any],
) -> tuple[tuple[DeviceShare, ...], Vendor, dict[str, str]]:
    """Shares, vendor and uuid → model from a decoded ``GPUSCHED_ALLOCATION``.

    The allocation is the one :mod:`gpusched.hardware.envexport` wrote.

    Raises:
        ConfigurationError: the record is not from this version of gpusched or spans hosts.
    """
    try:
        nodes = list(allocation.get("nodes") or [allocation["node"]])
        if len(nodes) > 1:
            raise ConfigurationError(
                f"the allocation spans hosts {nodes}; start one container per host"
            )
        uuids, indices = list(allocation["uuids"]), list(allocation["devices"])
        milli, memory = list(allocation["milli"]), list(allocation["memory_bytes"])
        vendor = Vendor(str(allocation["vendor"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"GPUSCHED_ALLOCATION is not readable ({exc!r}); it must come from gpusched.hardware.envexport"
        ) from None
    if not (len(uuids) == len(indices) == len(milli) == len(memory)):
        raise ConfigurationError("GPUSCHED_ALLOCATION lists differ in length; re-run the task")
    shares = tuple(
        DeviceShare(uuid=str(u), node=str(nodes[0]), index=int(i), milli=int(m), memory_bytes=int(b))
        for u, i, m, b in zip(uuids, indices, milli, memory, strict=True)
    )
    models = allocation.get("models") or []
    named = {str(u): str(m) for u, m in zip(uuids, models, strict=False)}
    return shares, vendor, named


def profiles_from_allocation(allocation: Mapping[str, Any]) -> dict[str, str | None]:
    """uuid → slice profile (or None) from a decoded ``GPUSCHED_ALLOCATION`` (empty when absent)."""
    uuids = allocation.get("uuids") or []
    profiles = allocation.get("profiles") or []
    if not isinstance(uuids, list) or not isinstance(profiles, list):
        return {}
    return {str(u): (str(p) if p else None) for u, p in zip(uuids, profiles, strict=False)}


def _map(root: str, relative: str) -> str:
    return f"{posixpath.join(root, relative)}:/dev/{relative}:rwm"
