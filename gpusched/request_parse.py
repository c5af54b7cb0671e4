"""The field parsers of :class:`~gpusched.request.GPURequest`: one function per request field.

Each takes the raw value (from keyword arguments, a dict or YAML) and returns the validated
value or raises :class:`~gpusched.errors.GPURequestError` naming the field and what it accepts.
Bounds (see ``docs/reliability.md``): at most :data:`~gpusched.fields.MAX_DEVICES` devices;
fractions are multiples of 0.001 from 0.001 to 0.999 (milli-GPU); architectures must be ones a
catalog model has; names, tenants and labels at most 63 characters, at most 32 labels.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

from gpusched.catalog import AcceleratorModel, Catalog, Vendor
from gpusched.errors import CatalogError, GPURequestError
from gpusched.fields import MAX_DEVICES, MAX_TEXT, FieldProblem, duration_seconds, safe_repr, size_bytes
from gpusched.model import MILLI

__all__ = [
    "ISOLATION_VALUES",
    "MAX_LABELS",
    "PRIORITY_NAMES",
    "Interconnect",
    "Partition",
    "arch_vendor",
    "parse_bool",
    "parse_duration",
    "parse_enum",
    "parse_gpus",
    "parse_isolation",
    "parse_job_type",
    "parse_labels",
    "parse_min_arch",
    "parse_models",
    "parse_priority",
    "parse_size",
    "parse_tenant",
    "parse_vendors",
]

MAX_LABELS = 32
MAX_LIST = 64  # vendors / models listed in one request


class Interconnect(StrEnum):
    """How tightly the devices of a multi-device request must be connected."""

    ANY = "any"  # anywhere; locality is preferred, not required (may span nodes with gang)
    SAME_NODE = "same_node"
    SAME_NUMA = "same_numa"  # one node, one NUMA domain (same PCIe root complex side)
    ISLAND = "island"  # one NVLink/NVSwitch, xGMI or HCCS island
    SAME_RACK = "same_rack"  # may span nodes of one rack (with gang)


class Partition(StrEnum):
    """Capacity partitions: training/burst/dev share the fleet 70/20/10 by default."""

    TRAINING = "training"
    BURST = "burst"
    DEV = "dev"


ISOLATION_VALUES = ("any", "hard", "soft")
"""``isolation`` of a request: ``hard`` = a MIG instance / AMD partition of its own, ``soft`` =
a share of a whole device (MPS limits, not enforced by hardware), ``any`` = either."""

PRIORITY_NAMES: Mapping[str, int] = {"low": 10, "normal": 50, "high": 80, "critical": 100}
"""Named priorities; ``critical`` requests may hold reservations."""

_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
_LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,62}")
_LABEL_VALUE_RE = re.compile(r"[A-Za-z0-9_./-]{0,63}")
_CAPABILITY_RE = re.compile(r"[0-9]{1,2}\.[0-9]")


def parse_size(value: object, field_name: str = "memory") -> int:
    """Bytes from an int or a string such as ``"40GiB"``, ``"16GB"`` or ``"512M"`` (at most 1 PiB)."""
    try:
        return size_bytes(value)
    except FieldProblem as exc:
        raise GPURequestError(field_name, value, exc.accepted, exc.problem) from None


def parse_duration(value: object, field_name: str = "expected_duration") -> int:
    """Whole seconds from a number or a string such as ``"90s"``, ``"30m"``, ``"2h"``, ``"1h30m"``.

    Positive sub-second values round up to 1 s; zero, negative, non-finite and > 366 days are rejected.
    """
    try:
        return duration_seconds(value)
    except FieldProblem as exc:
        raise GPURequestError(field_name, value, exc.accepted, exc.problem) from None


def parse_gpus(kwargs: Mapping[str, Any]) -> tuple[int, int]:
    """``(count, milli_per_gpu)`` from ``gpus`` or ``count``/``milli``."""
    accepted_gpus = (
        f"a whole number from 1 to {MAX_DEVICES}, or a fraction from 0.001 to 0.999 in steps of 0.001 "
        "such as 0.25"
    )
    gpus = kwargs.get("gpus")
    count = kwargs.get("count")
    milli = kwargs.get("milli")
    if gpus is not None and (count is not None or milli is not None):
        raise GPURequestError("gpus", gpus, "either 'gpus' or 'count'/'milli', not both", "given twice")
    if gpus is not None:
        if isinstance(gpus, bool) or not isinstance(gpus, int | float):
            raise GPURequestError("gpus", gpus, accepted_gpus)
        if isinstance(gpus, float) and not math.isfinite(gpus):
            raise GPURequestError("gpus", gpus, accepted_gpus, f"{gpus!r} is not a finite number")
        if gpus >= 1:
            if gpus > MAX_DEVICES:
                raise GPURequestError("gpus", gpus, accepted_gpus, f"more than {MAX_DEVICES} devices")
            if gpus != int(gpus):
                raise GPURequestError("gpus", gpus, accepted_gpus, "more than one GPU must be whole")
            return int(gpus), MILLI
        if gpus <= 0:
            raise GPURequestError("gpus", gpus, accepted_gpus, "must be positive (at least 0.001)")
        share = round(gpus * MILLI)
        if abs(gpus * MILLI - share) > 1e-6 or not 1 <= share < MILLI:
            raise GPURequestError(
                "gpus", gpus, accepted_gpus,
                f"{safe_repr(gpus)} is not a whole number of milli-GPU (0.001 steps below 1)",
            )
        return 1, share
    count_value = 1 if count is None else count
    if (isinstance(count_value, bool) or not isinstance(count_value, int)
            or not 1 <= count_value <= MAX_DEVICES):
        raise GPURequestError("count", count, f"a whole number ≥ 1 and ≤ {MAX_DEVICES}")
    milli_value = MILLI if milli is None else milli
    if isinstance(milli_value, bool) or not isinstance(milli_value, int) or not 1 <= milli_value <= MILLI:
        raise GPURequestError("milli", milli, "a whole number of milli-GPU from 1 to 1000")
    if milli_value < MILLI and count_value > 1:
        raise GPURequestError(
            "milli", milli, "1000 when count > 1", "only a single-device request can be fractional"
        )
    return count_value, milli_value


def _as_strings(field: str, value: object, accepted: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise GPURequestError(field, value, accepted, f"{safe_repr(value)} is not a name or a list of names")
    else:
        items = list(value)
        if len(items) > MAX_LIST:
            raise GPURequestError(field, value, accepted, f"more than {MAX_LIST} entries")
    for item in items:
        if not isinstance(item, str) or len(item) > 200:
            raise GPURequestError(field, item, accepted, f"{safe_repr(item)} is not a name")
    return [str(item) for item in items]


def parse_vendors(value: object) -> frozenset[Vendor]:
    """Allowed vendors from a name or a list of names."""
    accepted = ", ".join(v.value for v in Vendor)
    result = set()
    for item in _as_strings("vendors", value, accepted):
        try:
            result.add(Vendor(item.strip().lower()))
        except ValueError:
            raise GPURequestError("vendors", item, accepted) from None
    return frozenset(result)


def parse_models(value: object, cat: Catalog) -> frozenset[str]:
    """Canonical model names from catalog names or aliases."""
    accepted = ", ".join(cat.names)
    result = set()
    for item in _as_strings("models", value, accepted):
        try:
            result.add(cat.get(item).name)
        except CatalogError:
            raise GPURequestError("models", item, accepted, "unknown model") from None
    return frozenset(result)


def arch_vendor(arch: str) -> Vendor:
    """The vendor an architecture name belongs to (``sm_`` NVIDIA, ``gfx`` AMD, else Ascend)."""
    if arch.startswith("sm_"):
        return Vendor.NVIDIA
    if arch.startswith("gfx"):
        return Vendor.AMD
    return Vendor.ASCEND


def parse_min_arch(kwargs: Mapping[str, Any], cat: Catalog) -> str | None:
    """The lowest architecture allowed: one a catalog model has (a compute capability maps to ``sm_``)."""
    known = cat.architectures()
    accepted = "one of " + ", ".join(known) + " (or a compute capability like '8.0')"
    arch = kwargs.get("min_arch")
    capability = kwargs.get("min_compute_capability")
    if arch is not None and capability is not None:
        raise GPURequestError("min_arch", arch, "min_arch or min_compute_capability, not both", "given twice")
    if capability is not None:
        cap_accepted = "a compute capability like '8.0' that a catalog model has: " + ", ".join(
            f"{a[3:-1]}.{a[-1]}" for a in known if a.startswith("sm_")
        )
        text = capability.strip() if isinstance(capability, str) else ""
        if isinstance(capability, float) and math.isfinite(capability) and 0 < capability < 100:
            text = f"{capability:.1f}"
        if not _CAPABILITY_RE.fullmatch(text) or "sm_" + text.replace(".", "") not in known:
            raise GPURequestError("min_compute_capability", capability, cap_accepted)
        return "sm_" + text.replace(".", "")
    if arch is None:
        return None
    if not isinstance(arch, str) or len(arch) > 32:
        raise GPURequestError("min_arch", arch, accepted, f"{safe_repr(arch)} is not an architecture name")
    text = arch.strip().lower()
    if _CAPABILITY_RE.fullmatch(text):
        text = "sm_" + text.replace(".", "")
    if text in known:
        return text
    raise GPURequestError("min_arch", arch, accepted, "no catalog model has this architecture")


def parse_enum(enum: type[Interconnect] | type[Partition], name: str, value: object) -> Any:
    """A member of ``enum`` from its value (case-insensitive); ``None`` stays ``None``."""
    if value is None:
        return None
    accepted = ", ".join(e.value for e in enum)
    if not isinstance(value, str):
        raise GPURequestError(name, value, accepted)
    try:
        return enum(value.strip().lower())
    except ValueError:
        raise GPURequestError(name, value, accepted) from None


def parse_bool(name: str, value: object) -> bool:
    """A real bool (``1``/``"yes"`` are rejected, not guessed)."""
    if isinstance(value, bool):
        return value
    raise GPURequestError(name, value, "true or false")


def parse_labels(value: object) -> tuple[tuple[str, str], ...]:
    """Sorted ``(key, value)`` pairs from a mapping of at most 32 short labels."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise GPURequestError("labels", value, "a mapping of label names to values, e.g. {'zone': 'a'}")
    if len(value) > MAX_LABELS:
        raise GPURequestError("labels", value, f"at most {MAX_LABELS} labels", f"{len(value)} labels")
    pairs = []
    for key, item in value.items():
        if not isinstance(key, str) or not _LABEL_RE.fullmatch(key):
            raise GPURequestError(
                "labels", key,
                f"label names of 1–{MAX_TEXT} letters, digits, '_', '.', '/', '-', "
                "starting with a letter or digit",
            )
        if isinstance(item, bool) or not isinstance(item, str | int):
            raise GPURequestError("labels", item, "label values that are strings")
        text = str(item) if isinstance(item, str) or abs(item) < 10**MAX_TEXT else "-" * (MAX_TEXT + 1)
        if not _LABEL_VALUE_RE.fullmatch(text):
            raise GPURequestError(
                "labels", item, f"label values of at most {MAX_TEXT} letters, digits, '_', '.', '/', '-'"
            )
        pairs.append((key, text))
    return tuple(sorted(pairs))


def parse_tenant(value: object) -> str:
    """A tenant name: 1–63 lower-case letters, digits, '_', '.', '-' (the whole string, no newline)."""
    if isinstance(value, str) and _TENANT_RE.fullmatch(value):
        return value
    raise GPURequestError(
        "tenant", value, "1–63 lower-case letters, digits, '_', '.', '-', starting with a letter or digit"
    )


MAX_JOB_TYPE = 128
"""Longest job type (a key of the executor's throughput table)."""


def parse_job_type(value: object) -> str | None:
    """A job type (a row of the throughput table, e.g. ``"ResNet-50 (batch size 64)"``): 1–128
    printable characters without leading or trailing spaces; None or '' = none."""
    if value is None or value == "":
        return None
    if (isinstance(value, str) and len(value) <= MAX_JOB_TYPE and value == value.strip()
            and value.isprintable()):
        return value
    raise GPURequestError(
        "job_type", value, f"1–{MAX_JOB_TYPE} printable characters without leading or trailing spaces, "
        "a job type of the executor's [gpusched] throughput_file (e.g. 'ResNet-50 (batch size 64)')",
    )


def parse_priority(value: object) -> int:
    """0–100 or one of :data:`PRIORITY_NAMES`."""
    accepted = "a whole number 0–100 or one of " + ", ".join(PRIORITY_NAMES)
    if isinstance(value, str) and value.strip().lower() in PRIORITY_NAMES:
        return PRIORITY_NAMES[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 100:
        return value
    raise GPURequestError("priority", value, accepted)


def parse_isolation(
    kwargs: Mapping[str, Any], count: int, milli: int, candidates: Iterable[AcceleratorModel], cat: Catalog
) -> tuple[str, str | None]:
    """``(isolation, profile)``: how a fraction may share a device, checked against the catalog.

    ``isolation`` is ``any`` (default), ``hard`` (a MIG instance / AMD compute partition of its
    own) or ``soft`` (a share of a whole device, MPS limits). ``profile`` (``"3g.40gb"``,
    ``"CPX"``) pins the slice profile and implies ``hard``. Hard isolation needs a fraction of one
    device and an allowed model (``candidates``) that can be sliced, with a slice big enough.
    """
    raw = kwargs.get("isolation")
    profile_raw = kwargs.get("profile")
    accepted = ", ".join(ISOLATION_VALUES)
    if raw is None:
        isolation = "hard" if profile_raw is not None else "any"
    elif not isinstance(raw, str) or raw.strip().lower() not in ISOLATION_VALUES:
        raise GPURequestError("isolation", raw, accepted)
    else:
        isolation = raw.strip().lower()
    if isolation != "hard" and profile_raw is None:
        return isolation, None
    if isolation != "hard":
        raise GPURequestError("isolation", raw, "hard (or leave it out) with a profile",
                              "a slice profile means a hard-isolated slice")
    field = "profile" if profile_raw is not None else "isolation"
    if count > 1 or milli >= MILLI:
        raise GPURequestError(
            field,
            profile_raw if profile_raw is not None else raw,
            "a fraction of one device, e.g. gpus=0.25",
            "hard isolation slices one device; a whole GPU is isolated already (drop isolation/profile)",
        )
    sliceable = [m for m in candidates if m.supports_slices]
    if not sliceable:
        raise GPURequestError(
            field, profile_raw if profile_raw is not None else raw,
            "models with MIG or compute partitions: "
            + ", ".join(m.name for m in cat.models if m.supports_slices),
            "none of the allowed models can be partitioned (MIG / compute partitions)",
        )
    if profile_raw is None:
        best = max(p.compute_milli for m in sliceable for p in m.slice_profiles)
        if milli > best:
            raise GPURequestError("gpus", milli / MILLI, f"at most {best / MILLI:g} with isolation='hard'",
                                  "no slice profile of the allowed models holds that much compute")
        return isolation, None
    names = sorted({p.name for m in sliceable for p in m.slice_profiles})
    if not isinstance(profile_raw, str) or len(profile_raw) > 32:
        raise GPURequestError("profile", profile_raw, "one of " + ", ".join(names))
    matches = [p for m in sliceable if (p := m.slice_profile(profile_raw)) is not None]
    if not matches:
        raise GPURequestError("profile", profile_raw, "one of " + ", ".join(names),
                              "no allowed model has this slice profile")
    biggest = max(p.compute_milli for p in matches)
    if milli > biggest:
        raise GPURequestError("gpus", milli / MILLI,
                              f"at most {biggest / MILLI:g} for profile {matches[0].name}",
                              f"a {matches[0].name} slice holds less compute than asked")
    return isolation, matches[0].name

