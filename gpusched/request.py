"""GPURequest: what a task asks for, validated when the DAG is parsed.

Build one with keyword arguments, :meth:`GPURequest.from_dict` or :meth:`GPURequest.from_yaml`.
Every invalid field raises :class:`~gpusched.errors.GPURequestError` naming the field, the bad
value and what is accepted. A request serialises to a plain dict (:meth:`GPURequest.to_dict`)
so it can travel in a task's ``executor_config`` and in the ledger.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from gpusched.catalog import Catalog, Vendor, arch_rank, default_catalog
from gpusched.errors import CatalogError, GPURequestError
from gpusched.model import MILLI

__all__ = [
    "PRIORITY_NAMES",
    "REQUEST_KEYS",
    "GPURequest",
    "Interconnect",
    "Partition",
    "parse_duration",
    "parse_size",
]


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


PRIORITY_NAMES: Mapping[str, int] = {"low": 10, "normal": 50, "high": 80, "critical": 100}
"""Named priorities; ``critical`` requests may hold reservations."""

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(d|h|min|m|s)?", re.IGNORECASE)
_TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}$")


def parse_size(value: object, field_name: str = "memory") -> int:
    """Bytes from an int or a string such as ``"40GiB"``, ``"16GB"`` or ``"512M"``."""
    accepted = "a positive number of bytes, or a string like '40GiB', '16GB', '512MiB'"
    if isinstance(value, bool):
        raise GPURequestError(field_name, value, accepted)
    if isinstance(value, int):
        if value <= 0:
            raise GPURequestError(field_name, value, accepted, "must be positive")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])
            if size > 0:
                return size
    raise GPURequestError(field_name, value, accepted)


def parse_duration(value: object, field_name: str = "expected_duration") -> int:
    """Whole seconds from an int or a string such as ``"90s"``, ``"30m"``, ``"2h"``, ``"1h30m"``."""
    accepted = "a positive number of seconds, or a string like '90s', '30m', '2h', '1h30m'"
    if isinstance(value, bool):
        raise GPURequestError(field_name, value, accepted)
    if isinstance(value, int | float) and value > 0:
        return int(value)
    if isinstance(value, str) and value.strip():
        text = value.strip()
        total = 0.0
        pos = 0
        for match in _DURATION_RE.finditer(text):
            if match.start() != pos and text[pos:match.start()].strip():
                raise GPURequestError(field_name, value, accepted)
            total += float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "").lower()]
            pos = match.end()
        if pos == len(text) and total > 0:
            return int(total)
    raise GPURequestError(field_name, value, accepted)


@dataclass(frozen=True, slots=True)
class GPURequest:
    """What one task needs. Construct through :meth:`build` (keywords), ``from_dict`` or ``from_yaml``.

    Attributes:
        count: number of devices (≥ 1).
        milli_per_gpu: compute share per device in milli-GPU; 1000 = whole device, below 1000
            only with ``count == 1`` (fractional sharing).
        memory_per_gpu: device memory needed on each device, in bytes (0 = the whole device's
            memory for whole devices; required for fractions).
        vendors / models: allowed vendors and canonical model names (empty = any).
        labels: node labels that must match, as sorted (key, value) pairs.
        min_arch: lowest architecture allowed (``sm_80``, ``gfx90a``, ``ascend910b``); implies
            that vendor.
        interconnect: see :class:`Interconnect`.
        gang: all devices at once (always true for count > 1 here) and allowed to span nodes
            when ``interconnect`` is ``any`` or ``same_rack``.
        tenant / priority / partition: who pays, how urgent (0–100), which capacity partition.
        expected_duration_s: the author's estimate, for backfill and quotas (0 = unknown).
    """

    count: int = 1
    milli_per_gpu: int = MILLI
    memory_per_gpu: int = 0
    vendors: frozenset[Vendor] = frozenset()
    models: frozenset[str] = frozenset()
    labels: tuple[tuple[str, str], ...] = ()
    min_arch: str | None = None
    interconnect: Interconnect = Interconnect.SAME_NODE
    gang: bool = False
    tenant: str = "default"
    priority: int = PRIORITY_NAMES["normal"]
    partition: Partition = Partition.TRAINING
    expected_duration_s: int = 0

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def build(cls, *, catalog: Catalog | None = None, **kwargs: Any) -> GPURequest:
        """Validate keyword arguments into a request.

        Accepted keys: ``gpus`` (int ≥ 1, or a fraction 0 < x < 1), ``count``, ``milli``,
        ``memory`` (bytes or '40GiB'), ``vendor``/``vendors``, ``model``/``models``, ``labels``
        (mapping), ``min_arch`` (or ``min_compute_capability`` '8.0'), ``interconnect``,
        ``gang``, ``tenant``, ``priority`` (0–100 or low/normal/high/critical), ``partition``,
        ``expected_duration`` (seconds or '2h').
        """
        cat = catalog or default_catalog()
        unknown = set(kwargs) - _ACCEPTED_KEYS
        if unknown:
            key = sorted(unknown)[0]
            close = difflib.get_close_matches(key, sorted(_ACCEPTED_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise GPURequestError(
                key, kwargs[key], ", ".join(sorted(_ACCEPTED_KEYS)), f"unknown field{hint}"
            )
        count, milli = _parse_gpus(kwargs)
        memory = parse_size(kwargs["memory"]) if kwargs.get("memory") is not None else 0
        if milli < MILLI and memory == 0:
            raise GPURequestError(
                "memory", None, "a size such as '8GiB'",
                "a fractional GPU request must say how much device memory it needs",
            )
        vendors = _parse_vendors(kwargs.get("vendors", kwargs.get("vendor")))
        models = _parse_models(kwargs.get("models", kwargs.get("model")), cat)
        for name in models:
            model_vendor = cat.get(name).vendor
            if vendors and model_vendor not in vendors:
                raise GPURequestError(
                    "models", name, f"models of the allowed vendors {sorted(vendors)}",
                    f"model {name!r} is made by {model_vendor}, which the request excludes",
                )
        min_arch = _parse_min_arch(kwargs, cat)
        if min_arch is not None:
            arch_vendor = _arch_vendor(min_arch)
            if vendors and arch_vendor not in vendors:
                raise GPURequestError(
                    "min_arch", min_arch, f"an architecture of {sorted(vendors)}",
                    f"{min_arch} is a {arch_vendor} architecture but vendors are {sorted(vendors)}",
                )
        interconnect = _parse_enum(Interconnect, "interconnect", kwargs.get("interconnect"))
        gang = _parse_bool("gang", kwargs.get("gang", count > 1))
        if count > 1 and not gang:
            raise GPURequestError(
                "gang", False, "true (or leave it out) for count > 1",
                "a multi-device request is always placed all-or-nothing",
            )
        partition = _parse_enum(Partition, "partition", kwargs.get("partition"))
        duration = (
            parse_duration(kwargs["expected_duration"])
            if kwargs.get("expected_duration") is not None
            else 0
        )
        request = cls(
            count=count,
            milli_per_gpu=milli,
            memory_per_gpu=memory,
            vendors=vendors,
            models=models,
            labels=_parse_labels(kwargs.get("labels")),
            min_arch=min_arch,
            interconnect=interconnect or Interconnect.SAME_NODE,
            gang=gang,
            tenant=_parse_tenant(kwargs.get("tenant", "default")),
            priority=_parse_priority(kwargs.get("priority", "normal")),
            partition=partition or Partition.TRAINING,
            expected_duration_s=duration,
        )
        request._check_feasible_memory(cat)
        return request

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, catalog: Catalog | None = None) -> GPURequest:
        """Validate a mapping (for example ``executor_config["gpusched"]``) into a request."""
        if not isinstance(data, Mapping):
            raise GPURequestError("<request>", data, "a mapping of request fields")
        return cls.build(catalog=catalog, **{str(k): v for k, v in data.items()})

    @classmethod
    def from_yaml(cls, text: str, *, catalog: Catalog | None = None) -> GPURequest:
        """Validate a YAML mapping into a request."""
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise GPURequestError("<request>", text, "a YAML mapping of request fields", str(exc)) from exc
        return cls.from_dict(data, catalog=catalog)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_dict` turns back into an equal request."""
        return {
            "count": self.count,
            "milli": self.milli_per_gpu,
            "memory": self.memory_per_gpu or None,
            "vendors": sorted(str(v) for v in self.vendors),
            "models": sorted(self.models),
            "labels": dict(self.labels),
            "min_arch": self.min_arch,
            "interconnect": str(self.interconnect),
            "gang": self.gang,
            "tenant": self.tenant,
            "priority": self.priority,
            "partition": str(self.partition),
            "expected_duration": self.expected_duration_s or None,
        }

    # ---- derived --------------------------------------------------------------------------

    @property
    def is_fractional(self) -> bool:
        """True when the request shares one device (milli-GPU below 1000)."""
        return self.milli_per_gpu < MILLI

    @property
    def total_milli(self) -> int:
        """Total compute share asked for, in milli-GPU."""
        return self.count * self.milli_per_gpu

    @property
    def may_span_nodes(self) -> bool:
        """Whether placement may split the devices across nodes."""
        return self.gang and self.interconnect in (Interconnect.ANY, Interconnect.SAME_RACK)

    def _check_feasible_memory(self, cat: Catalog) -> None:
        if not self.memory_per_gpu:
            return
        candidates = [
            m for m in cat.models
            if (not self.models or m.name in self.models)
            and (not self.vendors or m.vendor in self.vendors)
        ]
        largest = max((m.memory_bytes for m in candidates), default=0)
        if candidates and self.memory_per_gpu > largest:
            raise GPURequestError(
                "memory", self.memory_per_gpu, f"at most {largest // 2**30} GiB for the allowed models",
                f"{self.memory_per_gpu / 2**30:.1f} GiB per device exceeds every allowed model",
            )


_ACCEPTED_KEYS = frozenset({
    "gpus", "count", "milli", "memory", "vendor", "vendors", "model", "models", "labels",
    "min_arch", "min_compute_capability", "interconnect", "gang", "tenant", "priority",
    "partition", "expected_duration",
})
REQUEST_KEYS: frozenset[str] = _ACCEPTED_KEYS
"""Every keyword :meth:`GPURequest.build` accepts (for helpers that split request from other kwargs)."""


def _parse_gpus(kwargs: Mapping[str, Any]) -> tuple[int, int]:
    accepted_gpus = "a whole number ≥ 1, or a fraction between 0 and 1 such as 0.25"
    gpus = kwargs.get("gpus")
    count = kwargs.get("count")
    milli = kwargs.get("milli")
    if gpus is not None and (count is not None or milli is not None):
        raise GPURequestError("gpus", gpus, "either 'gpus' or 'count'/'milli', not both", "given twice")
    if gpus is not None:
        if isinstance(gpus, bool) or not isinstance(gpus, int | float):
            raise GPURequestError("gpus", gpus, accepted_gpus)
        if gpus >= 1:
            if gpus != int(gpus):
                raise GPURequestError("gpus", gpus, accepted_gpus, "more than one GPU must be whole")
            return int(gpus), MILLI
        share = round(gpus * MILLI)
        if gpus <= 0 or share < 1:
            raise GPURequestError("gpus", gpus, accepted_gpus, "must be positive (at least 0.001)")
        return 1, share
    count_value = 1 if count is None else count
    if isinstance(count_value, bool) or not isinstance(count_value, int) or count_value < 1:
        raise GPURequestError("count", count, "a whole number ≥ 1")
    milli_value = MILLI if milli is None else milli
    if isinstance(milli_value, bool) or not isinstance(milli_value, int) or not 1 <= milli_value <= MILLI:
        raise GPURequestError("milli", milli, "a whole number of milli-GPU from 1 to 1000")
    if milli_value < MILLI and count_value > 1:
        raise GPURequestError(
            "milli", milli, "1000 when count > 1", "only a single-device request can be fractional"
        )
    return count_value, milli_value


def _as_list(value: object) -> list[object]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, Iterable):
        return list(value)
    return [value]


def _parse_vendors(value: object) -> frozenset[Vendor]:
    accepted = ", ".join(v.value for v in Vendor)
    result = set()
    for item in _as_list(value):
        try:
            result.add(Vendor(str(item).strip().lower()))
        except ValueError:
            raise GPURequestError("vendors", item, accepted) from None
    return frozenset(result)


def _parse_models(value: object, cat: Catalog) -> frozenset[str]:
    result = set()
    for item in _as_list(value):
        try:
            result.add(cat.get(str(item)).name)
        except CatalogError:
            raise GPURequestError("models", item, ", ".join(cat.names), "unknown model") from None
    return frozenset(result)


def _arch_vendor(arch: str) -> Vendor:
    if arch.startswith("sm_"):
        return Vendor.NVIDIA
    if arch.startswith("gfx"):
        return Vendor.AMD
    return Vendor.ASCEND


def _parse_min_arch(kwargs: Mapping[str, Any], cat: Catalog) -> str | None:
    accepted = "one of " + ", ".join(cat.architectures()) + " (or a compute capability like '8.0')"
    arch = kwargs.get("min_arch")
    capability = kwargs.get("min_compute_capability")
    if arch is not None and capability is not None:
        raise GPURequestError("min_arch", arch, "min_arch or min_compute_capability, not both", "given twice")
    if capability is not None:
        text = str(capability).strip()
        if not re.fullmatch(r"\d{1,2}\.\d", text):
            raise GPURequestError(
                "min_compute_capability", capability, "a compute capability like '8.0' or '9.0'"
            )
        return "sm_" + text.replace(".", "")
    if arch is None:
        return None
    text = str(arch).strip().lower()
    if re.fullmatch(r"\d{1,2}\.\d", text):
        text = "sm_" + text.replace(".", "")
    if text in cat.architectures() or (
        re.fullmatch(r"sm_\d{2,3}|gfx[0-9a-f]{3,4}|ascend\d{3}[a-z]?", text) and arch_rank(text) > 0
    ):
        return text
    raise GPURequestError("min_arch", arch, accepted, "unknown architecture")


def _parse_enum(enum: type[Interconnect] | type[Partition], name: str, value: object) -> Any:
    if value is None:
        return None
    try:
        return enum(str(value).strip().lower())
    except ValueError:
        raise GPURequestError(name, value, ", ".join(e.value for e in enum)) from None


def _parse_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise GPURequestError(name, value, "true or false")


def _parse_labels(value: object) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise GPURequestError("labels", value, "a mapping of label names to values, e.g. {'zone': 'a'}")
    for key, item in value.items():
        if not isinstance(key, str) or not _LABEL_RE.match(key):
            raise GPURequestError("labels", key, "label names of letters, digits, '_', '.', '/', '-'")
        if not isinstance(item, str | int) or isinstance(item, bool):
            raise GPURequestError("labels", item, "label values that are strings")
    return tuple(sorted((str(k), str(v)) for k, v in value.items()))


def _parse_tenant(value: object) -> str:
    if isinstance(value, str) and _TENANT_RE.match(value):
        return value
    raise GPURequestError(
        "tenant", value, "1–63 lower-case letters, digits, '_', '.', '-', starting with a letter or digit"
    )


def _parse_priority(value: object) -> int:
    accepted = "a whole number 0–100 or one of " + ", ".join(PRIORITY_NAMES)
    if isinstance(value, str) and value.strip().lower() in PRIORITY_NAMES:
        return PRIORITY_NAMES[value.strip().lower()]
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 100:
        return value
    raise GPURequestError("priority", value, accepted)


def request_fields() -> tuple[str, ...]:
    """Names of the dataclass fields (for documentation and the UI)."""
    return tuple(f.name for f in fields(GPURequest))
