"""Injected faults of the simulated fleet, persisted so every process sees them.

Faults live in one JSON file, ``<state_dir>/sim_faults.json``: the agent that samples, the
executor that places and a test that injects may all be different processes. Writes are
serialised with an advisory lock and replace the file atomically, so a reader never sees half a
file. The same store also keeps the simulated load (utilisation and memory in use per device)
that a simulated task reports, in ``sim_load.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusched.errors import HardwareError
from gpusched.model import Health

__all__ = [
    "CRITICAL_XIDS",
    "DEFAULT_XID",
    "FAULT_KINDS",
    "Fault",
    "FaultStore",
    "health_for",
]

FAULT_KINDS: Mapping[str, str] = {
    "xid": "the driver reports an Xid error (code: the Xid number, default 79 'fallen off the bus')",
    "ecc": "uncorrectable (double-bit) ECC errors (code: how many, default 1)",
    "overtemp": "the device runs hot (code: degrees Celsius, default 95)",
    "memory_leak": "device memory stays taken after tasks end (code: percent used, default 97)",
    "lost": "the device no longer answers (it disappears from samples)",
}
"""Fault kinds :meth:`FaultStore.inject` accepts, with what each simulates."""

DEFAULT_XID = 79
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
"""Xid codes after which a device must not take new work until reset (ECC, NVLink, bus, GSP)."""

_DEFAULT_CODE = {"xid": DEFAULT_XID, "ecc": 1, "overtemp": 95, "memory_leak": 97, "lost": 0}


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: what kind, its code (see :data:`FAULT_KINDS`) and when."""

    kind: str
    code: int
    at: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {"kind": self.kind, "code": self.code, "at": self.at}


def health_for(faults: tuple[Fault, ...]) -> Health:
    """The health a device with these faults has: lost, uncorrectable ECC or a critical Xid make it
    unhealthy; heat, leaked memory or a non-critical Xid make it degraded."""
    health = Health.HEALTHY
    for fault in faults:
        if fault.kind in ("lost", "ecc") or (fault.kind == "xid" and fault.code in CRITICAL_XIDS):
            return Health.UNHEALTHY
        health = Health.DEGRADED
    return health


class FaultStore:
    """Faults and simulated load per device uuid, shared through files under ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.faults_path = folder / "sim_faults.json"
        self.load_path = folder / "sim_load.json"

    # ---- faults -------------------------------------------------------------------------------

    def faults(self) -> dict[str, tuple[Fault, ...]]:
        """Every device's faults, oldest first."""
        raw = self._read(self.faults_path)
        result: dict[str, tuple[Fault, ...]] = {}
        for uuid, items in raw.items():
            result[uuid] = tuple(Fault(str(i["kind"]), int(i["code"]), float(i["at"])) for i in items)
        return result

    def inject(self, uuid: str, kind: str, code: int | None, at: float) -> Fault:
        """Record a fault on ``uuid`` (validated by the caller against the fleet)."""
        if kind not in FAULT_KINDS:
            raise HardwareError(
                f"unknown fault kind {kind!r}; use one of: {', '.join(FAULT_KINDS)}"
            )
        fault = Fault(kind, _DEFAULT_CODE[kind] if code is None else int(code), at)
        with self._locked():
            raw = self._read(self.faults_path)
            raw.setdefault(uuid, []).append(fault.to_dict())
            self._write(self.faults_path, raw)
        return fault

    def clear(self, uuid: str | None = None) -> int:
        """Remove the faults of ``uuid`` (all devices when None); returns how many were removed."""
        with self._locked():
            raw = self._read(self.faults_path)
            if uuid is None:
                removed = sum(len(v) for v in raw.values())
                raw = {}
            else:
                removed = len(raw.pop(uuid, []))
            self._write(self.faults_path, raw)
        return removed

    # ---- load ---------------------------------------------------------------------------------

    def loads(self) -> dict[str, tuple[int, int]]:
        """Simulated (utilisation %, memory used bytes) per device that has any."""
        raw = self._read(self.load_path)
        return {uuid: (int(v[0]), int(v[1])) for uuid, v in raw.items()}

    def set_load(self, uuid: str, utilization_pct: int, memory_used_bytes: int) -> None:
        """Record what a simulated task does on ``uuid``; (0, 0) removes the entry."""
        with self._locked():
            raw = self._read(self.load_path)
            if utilization_pct == 0 and memory_used_bytes == 0:
                raw.pop(uuid, None)
            else:
                raw[uuid] = [int(utilization_pct), int(memory_used_bytes)]
            self._write(self.load_path, raw)

    # ---- files --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / "sim_state.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise HardwareError(
                f"simulated fleet state {path} is unreadable ({exc}); delete the file to reset it"
            ) from exc
        return data if isinstance(data, dict) else {}

    def _write(self, path: Path, data: Mapping[str, Any]) -> None:
        handle, tmp = tempfile.mkstemp(dir=self.folder, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(data, out, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
