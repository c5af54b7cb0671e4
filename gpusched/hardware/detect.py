"""Choosing the hardware backend: real devices when the host has them, the simulated fleet otherwise.

``detect_backend()`` reads ``GPUSCHED_BACKEND`` (``auto`` | ``nvidia`` | ``amd`` | ``ascend`` |
``simulated``, default ``auto``). In ``auto`` mode NVML is tried first, then AMD SMI, then Ascend's
``npu-smi``; only when none finds a device is the simulated fleet used (``GPUSCHED_FLEET``,
default ``gpusched/include/fleets/default.yaml``),
and then it says so: a logged warning, ``backend.name == "simulated"`` and a ``description``
naming the fleet file. Asking for a vendor explicitly never falls back.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gpusched.errors import BackendUnavailableError, ConfigurationError
from gpusched.hardware import amd, ascend, nvidia, simulated
from gpusched.hardware.base import HardwareBackend

__all__ = ["BACKEND_KINDS", "detect_backend", "fleet_path_from_env"]

log = logging.getLogger(__name__)

BACKEND_KINDS = ("auto", "nvidia", "amd", "ascend", "simulated")
"""Values ``GPUSCHED_BACKEND`` and ``detect_backend(kind)`` accept."""


def fleet_path_from_env() -> Path:
    """The simulated fleet file: ``GPUSCHED_FLEET`` or ``gpusched/include/fleets/default.yaml``."""

    override = os.environ.get("GPUSCHED_FLEET")
    return Path(override) if override else simulated.default_fleet_path()


def detect_backend(kind: str | None = None, *, fleet: str | Path | None = None) -> HardwareBackend:
    """The backend for this host (see the module docstring for the rules).

    Args:
        kind: ``auto``, ``nvidia``, ``amd``, ``ascend`` or ``simulated``; None reads ``GPUSCHED_BACKEND``.
        fleet: the fleet file for the simulated backend (default :func:`fleet_path_from_env`).

    Raises:
        ConfigurationError: an unknown ``kind``.
        BackendUnavailableError: ``nvidia``, ``amd`` or ``ascend`` was asked for and is not there.
        FleetFileError: the simulated fleet file is invalid.
    """
    chosen = (kind or os.environ.get("GPUSCHED_BACKEND") or "auto").strip().lower()
    if chosen not in BACKEND_KINDS:
        raise ConfigurationError(
            f"unknown hardware backend {chosen!r}; set GPUSCHED_BACKEND to one of {', '.join(BACKEND_KINDS)}"
        )
    fleet_path = Path(fleet) if fleet is not None else fleet_path_from_env()
    if chosen == "nvidia":
        return nvidia.NvidiaBackend()
    if chosen == "amd":
        return amd.AmdBackend()
    if chosen == "ascend":
        return ascend.AscendBackend()
    if chosen == "simulated":
        return _simulated(fleet_path, "the simulated backend was asked for")
    reasons = []
    for name in ("nvidia", "amd", "ascend"):
        try:
            return detect_backend(name)
        except BackendUnavailableError as exc:
            reasons.append(f"{name}: {exc}")
    return _simulated(fleet_path, "no NVIDIA, AMD or Ascend device found (" + "; ".join(reasons) + ")")


def _simulated(fleet_path: Path, why: str) -> HardwareBackend:
    backend = simulated.SimulatedBackend(fleet_path)
    log.warning("using the %s: %s", backend.description, why)
    return backend
