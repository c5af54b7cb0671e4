"""Hard-isolated slices of one device: NVIDIA MIG instances and AMD compute partitions.

One source of truth for what a slice looks like in the model (:class:`~gpusched.model.Device`
with ``parent``, ``profile`` and ``compute_milli``) and for which layouts are possible, used by
the fleet file and the NVIDIA and AMD backends (the request parser reads the profiles from the
catalog).

* NVIDIA MIG: the GPU stays in the inventory with ``mig_enabled`` (it takes no work itself) and
  each MIG instance is a device of its own: uuid ``MIG-…``, the parent's index, no NVLink (MIG
  instances have no peer-to-peer), the profile's memory and compute share.
* AMD compute partitions (SPX/DPX/QPX/CPX): ROCm shows each partition as a logical device with its
  own index, so the partitions *are* the devices; their ``parent`` names the physical card.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gpusched.catalog import AcceleratorModel, LinkKind, SliceProfile, layout_problem, profile_names
from gpusched.model import MILLI, Device

__all__ = [
    "amd_partition_of",
    "amd_partitions",
    "layout_problem",
    "mig_instance",
    "mig_slices",
    "partition_count",
    "profile_names",
]

def mig_slices(
    parent: Device, model: AcceleratorModel, profiles: Sequence[str], uuids: Sequence[str] | None = None
) -> list[Device]:
    """The MIG instances of ``parent`` (already validated with :func:`layout_problem`).

    ``uuids`` are the instances' real ``MIG-…`` uuids; by default ``MIG-<parent uuid>-<k>``.
    """
    out = []
    for k, name in enumerate(profiles):
        profile = model.slice_profile(name)
        assert profile is not None, "validate the layout with layout_problem first"
        uuid = uuids[k] if uuids else f"MIG-{parent.uuid}-{k}"
        out.append(mig_instance(parent, uuid, profile.name, profile.memory_bytes, profile.compute_milli))
    return out


def mig_instance(parent: Device, uuid: str, profile: str, memory_bytes: int, compute_milli: int) -> Device:
    """One MIG instance of ``parent``: its own uuid, memory and compute share; no peer links."""
    return replace(
        parent,
        uuid=uuid,
        memory_bytes=memory_bytes,
        island=None,
        link=LinkKind.PCIE,
        peers=(),
        mig_enabled=False,
        parent=parent.uuid,
        profile=profile,
        compute_milli=max(1, min(MILLI, compute_milli)),
    )


def amd_partitions(
    card: Device, profile: SliceProfile, first_index: int, card_id: str, uuids: Sequence[str]
) -> list[Device]:
    """The logical devices an AMD card in compute partition mode ``profile`` exposes.

    Each gets its own index (``first_index`` onwards, as ROCm enumerates them), its uuid from
    ``uuids`` (one per partition), an even share of memory and ``parent = card_id``.
    """
    return [
        replace(
            card,
            uuid=uuid,
            index=first_index + k,
            memory_bytes=profile.memory_bytes,
            peers=(),
            parent=card_id,
            profile=profile.name,
            compute_milli=profile.compute_milli,
        )
        for k, uuid in enumerate(uuids)
    ]


def partition_count(profile: SliceProfile) -> int:
    """How many logical devices one card shows in this compute partition mode (CPX: 8)."""
    return profile.max_count


def amd_partition_of(
    device: Device, model: AcceleratorModel | None, compute_mode: str, card_id: str
) -> Device:
    """``device`` (one logical device as AMD SMI lists it) marked as a slice of ``card_id`` when its
    card runs a compute partition mode that splits it (DPX/QPX/CPX); unchanged in SPX or unknown."""
    mode = compute_mode.strip().upper()
    profile = model.slice_profile(mode) if model is not None and mode else None
    if profile is None or partition_count(profile) <= 1:
        return device
    return replace(
        device, parent=card_id, profile=profile.name, compute_milli=profile.compute_milli, peers=()
    )
