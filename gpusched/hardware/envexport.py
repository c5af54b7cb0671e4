"""The environment a task process needs to see exactly the devices it was given.

Pure: shares + fleet facts in, a ``dict[str, str]`` out. The executor puts it into the task
process, the listener exports it when the task runs under another executor, and the Docker
operator turns the same allocation into device requests.

Variables:

- NVIDIA: ``CUDA_VISIBLE_DEVICES`` (device indices by default, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
  so CUDA counts like NVML does; or UUIDs with ``use_uuids=True``). A MIG instance is always
  named by its ``MIG-…`` UUID (CUDA cannot address it by index).
- AMD compute partitions are logical devices with their own index: nothing special.
- AMD: ``HIP_VISIBLE_DEVICES`` and ``ROCR_VISIBLE_DEVICES``.
- Ascend: ``ASCEND_RT_VISIBLE_DEVICES``.
- A fraction of one device: ``GPUSCHED_MEMORY_LIMIT_BYTES`` and ``GPUSCHED_MEMORY_FRACTION``; on
  NVIDIA also ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and a
  ``PYTORCH_CUDA_ALLOC_CONF`` hint (expandable segments fragment less on a shared device).
- A hard-isolated slice (MIG instance, AMD partition): ``GPUSCHED_ISOLATION=hard`` and its memory
  as ``GPUSCHED_MEMORY_LIMIT_BYTES`` (the hardware enforces it; the variable tells the task).
- Always ``GPUSCHED_ALLOCATION``: JSON with key, node, nodes, vendor, devices (indices), uuids,
  models, milli and memory_bytes per device, and ``profiles`` (slice profile or null per device).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpusched.catalog import Vendor
from gpusched.errors import PlacementError
from gpusched.model import MILLI, DeviceShare, FleetSnapshot

__all__ = [
    "ALLOCATION_VAR",
    "ENV_KEYS",
    "allocation_from_env",
    "devices_env",
]

ALLOCATION_VAR = "GPUSCHED_ALLOCATION"
"""Name of the variable carrying the allocation as JSON."""

ENV_KEYS: frozenset[str] = frozenset({
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "PYTORCH_CUDA_ALLOC_CONF",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "GPUSCHED_MEMORY_LIMIT_BYTES",
    "GPUSCHED_MEMORY_FRACTION",
    "GPUSCHED_ISOLATION",
    ALLOCATION_VAR,
})
"""Every variable :func:`devices_env` may set (so a reused worker can clear them all)."""


def devices_env(
    shares: Sequence[DeviceShare],
    snapshot: FleetSnapshot | None = None,
    *,
    vendor: Vendor | str | None = None,
    models: Mapping[str, str] | None = None,
    key: str | None = None,
    use_uuids: bool = False,
    profiles: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """The environment variables that expose ``shares`` (and only them) to a task process.

    Args:
        shares: one share per device, as placed (all on one vendor).
        snapshot: the fleet the shares were placed on; gives vendor, model and memory per
            device. Without it pass ``vendor`` (and optionally ``models``: uuid → model name).
        vendor: overrides / replaces the vendor taken from the snapshot.
        models: uuid → model name when no snapshot is given.
        key: the allocation key, recorded in ``GPUSCHED_ALLOCATION``.
        use_uuids: NVIDIA only: list UUIDs in ``CUDA_VISIBLE_DEVICES`` instead of indices.
        profiles: uuid → slice profile when no snapshot is given (a slice's allocation record).

    Raises:
        PlacementError: no shares, shares on devices of different vendors, or no way to tell
            the vendor (give ``snapshot`` or ``vendor``).
    """
    if not shares:
        raise PlacementError("devices_env needs at least one DeviceShare; pass the allocation's shares")
    ordered = sorted(shares, key=lambda s: (s.node, s.index))
    the_vendor = _vendor_of(ordered, snapshot, vendor)
    model_names = [_model_of(s, snapshot, models) for s in ordered]
    indices = ",".join(str(s.index) for s in ordered)
    env: dict[str, str] = {}
    profiles_of = [_profile_of(s, snapshot, profiles) for s in ordered]
    if the_vendor is Vendor.NVIDIA:
        # A MIG instance has no CUDA index: it is named by its UUID.
        sliced = any(p is not None or s.uuid.startswith("MIG-")
                     for s, p in zip(ordered, profiles_of, strict=True))
        if use_uuids or sliced:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(s.uuid for s in ordered)
        else:
            env["CUDA_VISIBLE_DEVICES"] = indices
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    elif the_vendor is Vendor.AMD:
        env["HIP_VISIBLE_DEVICES"] = indices
        env["ROCR_VISIBLE_DEVICES"] = indices
    else:
        env["ASCEND_RT_VISIBLE_DEVICES"] = indices
    fractional = len(ordered) == 1 and ordered[0].milli < MILLI
    if fractional:
        share = ordered[0]
        env["GPUSCHED_MEMORY_LIMIT_BYTES"] = str(share.memory_bytes)
        total = _device_memory(share, snapshot)
        if total:
            env["GPUSCHED_MEMORY_FRACTION"] = f"{min(1.0, share.memory_bytes / total):.4f}"
        if the_vendor is Vendor.NVIDIA:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, math.ceil(share.milli / 10)))
            # Ordinal 0: the only device this process sees after CUDA_VISIBLE_DEVICES.
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, share.memory_bytes // 2**20)}M"
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if len(ordered) == 1 and (profiles_of[0] is not None or ordered[0].uuid.startswith("MIG-")):
        env["GPUSCHED_ISOLATION"] = "hard"
        env["GPUSCHED_MEMORY_LIMIT_BYTES"] = str(ordered[0].memory_bytes)
    nodes = sorted({s.node for s in ordered})
    allocation: dict[str, Any] = {
        "key": key,
        "node": ordered[0].node,
        "nodes": nodes,
        "vendor": str(the_vendor),
        "devices": [s.index for s in ordered],
        "uuids": [s.uuid for s in ordered],
        "models": model_names,
        "milli": [s.milli for s in ordered],
        "memory_bytes": [s.memory_bytes for s in ordered],
        "profiles": profiles_of,
    }
    env[ALLOCATION_VAR] = json.dumps(allocation, sort_keys=True)
    return env


def allocation_from_env(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The decoded ``GPUSCHED_ALLOCATION`` of ``environ``, or None when absent or unreadable."""
    raw = environ.get(ALLOCATION_VAR)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _vendor_of(
    shares: Sequence[DeviceShare], snapshot: FleetSnapshot | None, vendor: Vendor | str | None
) -> Vendor:
    if vendor is not None:
        try:
            return Vendor(str(vendor).lower())
        except ValueError:
            raise PlacementError(
                f"unknown vendor {vendor!r}; use one of {', '.join(v.value for v in Vendor)}"
            ) from None
    if snapshot is None:
        raise PlacementError("devices_env cannot tell the vendor: pass the fleet snapshot or vendor=")
    found = set()
    for share in shares:
        if not snapshot.has_device(share.uuid):
            raise PlacementError(
                f"device {share.uuid} is not in the fleet snapshot; pass the snapshot it was placed on"
            )
        found.add(snapshot.device(share.uuid).vendor)
    if len(found) != 1:
        raise PlacementError(
            f"one task cannot see devices of several vendors ({sorted(found)}); "
            "restrict the request's vendors"
        )
    return found.pop()


def _model_of(share: DeviceShare, snapshot: FleetSnapshot | None, models: Mapping[str, str] | None) -> str:
    if models and share.uuid in models:
        return models[share.uuid]
    if snapshot is not None and snapshot.has_device(share.uuid):
        return snapshot.device(share.uuid).model
    return "unknown"


def _profile_of(
    share: DeviceShare, snapshot: FleetSnapshot | None, profiles: Mapping[str, str | None] | None
) -> str | None:
    if profiles and profiles.get(share.uuid):
        return profiles[share.uuid]
    if snapshot is not None and snapshot.has_device(share.uuid):
        return snapshot.device(share.uuid).profile
    return None


def _device_memory(share: DeviceShare, snapshot: FleetSnapshot | None) -> int:
    if snapshot is not None and snapshot.has_device(share.uuid):
        return snapshot.device(share.uuid).memory_bytes
    return 0
