"""The one interface every hardware backend implements (NVIDIA, AMD, simulated, …).

Backends are the edge that touches vendor libraries: they translate vendor exceptions into
:class:`~gpusched.errors.HardwareError` and return the vocabulary types of :mod:`gpusched.model`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from gpusched.model import DeviceSample, Node

__all__ = ["BackendFeature", "HardwareBackend"]

BackendFeature = str
"""Declared capabilities, e.g. "topology", "nvlink", "mig", "ecc", "xid", "power", "fault_injection"."""


@runtime_checkable
class HardwareBackend(Protocol):
    """Discovery and sampling of one host's (or one simulated fleet's) accelerators."""

    name: str
    """Short backend name: "nvidia", "amd", "simulated"."""

    features: frozenset[BackendFeature]

    def discover(self) -> list[Node]:
        """The nodes this backend sees, each with its devices and topology."""
        ...

    def sample(self) -> list[DeviceSample]:
        """One reading per device: utilisation, memory, temperature, power, error counters."""
        ...

    def close(self) -> None:
        """Release the vendor library (nvmlShutdown, amdsmi_shut_down)."""
        ...
