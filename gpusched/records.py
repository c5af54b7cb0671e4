"""What the ledger hands out: allocations, queue entries and events (immutable records)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from gpusched.model import DeviceShare
from gpusched.request import GPURequest

__all__ = [
    "Allocation", "AllocationStatus", "HolderProcess", "LedgerEvent", "QueueEntry", "processes_from_json",
    "request_from_json",
]


class AllocationStatus:
    """Values of the ``status`` column of an allocation."""

    ACTIVE = "active"
    RELEASED = "released"
    EXPIRED = "expired"
    SUCCEEDED = "succeeded"
    """Released because its task succeeded (what learned durations learn from)."""
    QUARANTINED = "quarantined"
    """Unreleased, its holder's fate unknown (host lost): the devices wait for the host's agent to
    confirm the try's processes are gone (``gpusched.ledger.allocations``)."""


@dataclass(frozen=True, slots=True)
class HolderProcess:
    """One process that holds an allocation's devices.

    Attributes:
        role: ``executor`` (allocated it), ``worker`` (supervises the task) or ``task``.
        host: the host name the pid belongs to.
        pid: the process id.
        started_at: the process's start time (epoch s), to tell it from a later process that
            reuses the pid.
    """

    role: str
    host: str
    pid: int
    started_at: float

    def to_dict(self) -> dict[str, Any]:
        """The JSON form stored in the ledger."""
        return {"role": self.role, "host": self.host, "pid": self.pid, "started_at": self.started_at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HolderProcess:
        """Inverse of :meth:`to_dict`."""
        return cls(str(data["role"]), str(data["host"]), int(data["pid"]), float(data["started_at"]))


def processes_from_json(data: Any) -> tuple[HolderProcess, ...]:
    """The processes stored in the ``processes`` column (None, a list, or its text)."""
    if data is None:
        return ()
    items = json.loads(data) if isinstance(data, str) else data
    return tuple(HolderProcess.from_dict(item) for item in items)


@dataclass(frozen=True, slots=True)
class Allocation:
    """Devices handed to one task: the request, the shares, who holds them and for how long.

    Attributes:
        key: the task key (Airflow TaskInstanceKey string or trace job id); at most one active
            allocation exists per key.
        request: what the task asked for.
        shares: one share per device, sorted by device uuid.
        holder: who allocated it (a scheduler/executor id); ``reconcile`` works per holder.
        created_at / lease_expires_at / released_at: epoch (or simulation) seconds.
        release_reason: why it was released ("success", "failed", "lease expired", …).
        status: ``active``, ``released`` or ``expired``.
        processes: the processes recorded as holding it (oldest first; empty for old rows).
        queued_at: when the try was first queued, if the allocator said (None for old rows).
    """

    key: str
    request: GPURequest
    shares: tuple[DeviceShare, ...]
    holder: str
    created_at: float
    lease_expires_at: float
    released_at: float | None = None
    release_reason: str | None = None
    status: str = AllocationStatus.ACTIVE
    processes: tuple[HolderProcess, ...] = ()
    queued_at: float | None = None

    @property
    def active(self) -> bool:
        """True until the allocation is released or expires."""
        return self.released_at is None

    @property
    def total_milli(self) -> int:
        """Compute share held over all devices, in milli-GPU."""
        return sum(s.milli for s in self.shares)

    @property
    def devices(self) -> tuple[str, ...]:
        """The uuids of the devices held."""
        return tuple(s.uuid for s in self.shares)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (for the API, the UI and ``GPUSCHED_ALLOCATION``)."""
        return {
            "key": self.key,
            "request": self.request.to_dict(),
            "shares": [s.to_dict() for s in self.shares],
            "holder": self.holder,
            "created_at": self.created_at,
            "lease_expires_at": self.lease_expires_at,
            "released_at": self.released_at,
            "release_reason": self.release_reason,
            "status": self.status,
            "processes": [p.to_dict() for p in self.processes],
            "queued_at": self.queued_at,
        }


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """A task waiting for devices, with the reason it was not placed (latest cycle)."""

    key: str
    request: GPURequest
    reason: str
    since: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class LedgerEvent:
    """One thing that happened: ``allocate``, ``release``, ``expire``, ``cordon``, ``health``, …"""

    id: int
    at: float
    kind: str
    subject: str
    detail: Mapping[str, Any] = field(default_factory=dict)


def request_from_json(data: Any) -> GPURequest:
    """The request stored in a JSON column (a dict, or its text on some drivers)."""
    text = data if isinstance(data, str) else json.dumps(data, sort_keys=True)
    return _request_from_text(text)


@lru_cache(maxsize=4096)
def _request_from_text(text: str) -> GPURequest:
    # Rebuilding through from_dict re-validates against the catalog; cached because the same few
    # requests come back every scheduling cycle.
    return GPURequest.from_dict(json.loads(text))
