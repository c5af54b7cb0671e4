"""Topology helpers shared by the backends: grouping devices into PCIe switches and link islands.

Pure functions over plain values (indices and pairs), so the NVIDIA, AMD and simulated backends
derive ``pcie_switch``, ``island`` and ``peers`` the same way.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HostInfo",
    "connected_groups",
    "host_info",
    "island_members",
    "normalise_bus_id",
    "pcie_switch_key",
]


def connected_groups(size: int, pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Connected components of ``range(size)`` joined by ``pairs``, each sorted, ordered by first member.

    Singletons are included; callers drop them when a group of one means "no island".
    """
    parent = list(range(size))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for i in range(size):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def normalise_bus_id(bus_id: str | bytes) -> str:
    """A PCI bus id in one canonical form, ``dddd:bb:dd.f`` lower-case.

    NVML reports ``00000000:18:00.0`` (8-digit domain) in some calls and 4 digits in others;
    comparing the canonical forms matches a device to the far end of a link.
    """
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    text = text.strip().lower()
    if ":" not in text:
        return text
    parts = text.split(":")
    if len(parts) == 3:
        domain, bus, rest = parts
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{rest}"
    if len(parts) == 2:
        bus, rest = parts
        return f"0000:{int(bus, 16):02x}:{rest}"
    return text


@dataclass(frozen=True, slots=True)
class HostInfo:
    """What a real backend says about the host it runs on (the node holding its devices)."""

    name: str
    rack: str
    labels: tuple[tuple[str, str], ...]
    cpu_milli: int
    memory_bytes: int


def host_info() -> HostInfo:
    """This host's name, rack and labels (``GPUSCHED_NODE_NAME``, ``GPUSCHED_RACK``,
    ``GPUSCHED_NODE_LABELS="k=v,k2=v2"`` override the defaults), CPUs and RAM."""
    labels: list[tuple[str, str]] = []
    for item in os.environ.get("GPUSCHED_NODE_LABELS", "").split(","):
        if "=" in item:
            key, value = item.split("=", 1)
            labels.append((key.strip(), value.strip()))
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return HostInfo(
        name=os.environ.get("GPUSCHED_NODE_NAME") or socket.gethostname(),
        rack=os.environ.get("GPUSCHED_RACK") or "default",
        labels=tuple(sorted(labels)),
        cpu_milli=(os.cpu_count() or 0) * 1000,
        memory_bytes=int(memory),
    )


def island_members(groups: Sequence[Sequence[int]]) -> dict[int, int]:
    """Map each index in a group of two or more to its group's position (for island ids)."""
    result: dict[int, int] = {}
    for position, group in enumerate(g for g in groups if len(g) > 1):
        for member in group:
            result[member] = position
    return result


def pcie_switch_key(bus_id: str, sysfs: Path = Path("/sys/bus/pci/devices")) -> str | None:
    """The PCI address of the switch (or root port) a device hangs under, read from sysfs.

    ``/sys/bus/pci/devices/<bdf>`` links to ``/sys/devices/pci<root>/<root port>/<switch up>/
    <switch down>/<device>``; devices sharing the upstream port of a switch share a PCIe switch.
    None when sysfs does not know the device (another host, a container without /sys).
    """
    try:
        real = (sysfs / bus_id).resolve(strict=True)
    except OSError:
        return None
    chain = [part for part in real.parts if part.count(":") == 2 and "." in part]
    if len(chain) >= 4:  # root port, switch upstream, switch downstream, ..., device
        return chain[1]
    if len(chain) >= 2:  # directly under a root port
        return chain[0]
    return None
