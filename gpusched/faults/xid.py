"""NVIDIA Xid codes: which blame the device (or its link) and which the program on it (pure table)."""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "APPLICATION_XIDS",
    "HARDWARE_XIDS",
    "XidClass",
    "classify_xid",
]

HARDWARE_XIDS: frozenset[int] = frozenset({
    48,   # double-bit (uncorrectable) ECC error
    61, 62,  # internal micro-controller breakpoint / halt
    63,   # ECC page retirement or row remapping recorded
    64,   # ECC page retirement or row remapping failure
    74,   # NVLink error
    79,   # GPU has fallen off the bus
    92,   # high single-bit ECC error rate
    94,   # contained ECC error
    95,   # uncontained ECC error
    119, 120,  # GSP RPC timeout / GSP error
    140,  # unrecovered ECC error
})
"""NVIDIA Xid codes that point at the device (or its link), per NVIDIA's Xid catalogue."""

APPLICATION_XIDS: frozenset[int] = frozenset({
    13,   # graphics engine exception (illegal instruction, out-of-range access in a kernel)
    31,   # GPU memory page fault (the program touched an invalid address)
    43,   # GPU stopped processing (the application's context was torn down)
    45,   # preemptive cleanup after an earlier error (the process was killed)
    68,   # video decoder exception
})
"""NVIDIA Xid codes caused by the program running on the device, not by the device."""


class XidClass(StrEnum):
    """Who an Xid error blames."""

    HARDWARE = "hardware"
    APPLICATION = "application"
    UNKNOWN = "unknown"


def classify_xid(code: int) -> XidClass:
    """``hardware`` for device/link faults, ``application`` for program faults, else ``unknown``."""
    if code in HARDWARE_XIDS:
        return XidClass.HARDWARE
    if code in APPLICATION_XIDS:
        return XidClass.APPLICATION
    return XidClass.UNKNOWN

