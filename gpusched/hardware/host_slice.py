"""One GPU host's share of a backend: the nodes (and samples) named after that host.

On real hardware a host's backend sees only its own node (named ``GPUSCHED_NODE_NAME`` or the
host name), so the slice is the whole backend. A simulated fleet describes many nodes: the GPU
host ``H`` of a multi-host test or demo owns the fleet file's node named ``H``. A host whose agent
runs is switched on, so its nodes are never standby here (a fleet file's ``standby: true`` says
which host starts powered off; whether it is, is its host's state in the ledger).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpusched.errors import ConfigurationError
from gpusched.hardware.base import BackendFeature, HardwareBackend
from gpusched.model import HOST_SOURCE_PREFIX, DeviceSample, Node

__all__ = ["HostSlice"]


class HostSlice:
    """The nodes of ``backend`` that belong to GPU host ``host``; inventory source ``host:<host>``."""

    def __init__(self, backend: HardwareBackend, host: str) -> None:
        self.inner = backend
        self.host = host
        self.name = HOST_SOURCE_PREFIX + host
        self.features: frozenset[BackendFeature] = backend.features
        self.description = f"{getattr(backend, 'description', backend.name)} as host {host}"

    def discover(self) -> list[Node]:
        """The host's nodes; ConfigurationError when the backend has none named after it."""
        nodes = self.inner.discover()
        mine = [replace(n, standby=False) for n in nodes if n.name == self.host]
        if not mine:
            raise ConfigurationError(
                f"GPU host {self.host!r}: the {self.inner.name} backend has no node of that name "
                f"(it has: {', '.join(n.name for n in nodes) or 'none'}); name the host after its node "
                "(GPUSCHED_HOST, or GPUSCHED_NODE_NAME on hardware)"
            )
        return mine

    def sample(self) -> list[DeviceSample]:
        """Readings of this host's devices only."""
        uuids = {d.uuid for n in self.discover() for d in n.devices}
        return [s for s in self.inner.sample() if s.uuid in uuids]

    def close(self) -> None:
        """Close the underlying backend."""
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Optional backend features (fault injection, observe_allocations …) pass through.
        return getattr(self.inner, name)
