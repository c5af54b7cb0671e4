"""GPURequest: what a task asks for, validated when the DAG is parsed.

Build one with keyword arguments, :meth:`GPURequest.from_dict` or :meth:`GPURequest.from_yaml`.
Every invalid field raises :class:`~gpusched.errors.GPURequestError` naming the field, the bad
value and what is accepted — never a bare ``ValueError``/``TypeError``/``OverflowError``; the
field parsers and their bounds live in :mod:`gpusched.request_parse`. A request serialises to a
plain dict (:meth:`GPURequest.to_dict`) so it can travel in a task's ``executor_config`` and in
the ledger.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpusched.catalog import Catalog, Vendor, arch_rank, default_catalog
from gpusched.errors import GPURequestError
from gpusched.fields import FieldProblem, safe_repr, strict_yaml
from gpusched.model import MILLI
from gpusched.request_parse import (
    PRIORITY_NAMES,
    Interconnect,
    Partition,
    arch_vendor,
    parse_bool,
    parse_duration,
    parse_enum,
    parse_gpus,
    parse_isolation,
    parse_job_type,
    parse_labels,
    parse_min_arch,
    parse_models,
    parse_priority,
    parse_size,
    parse_tenant,
    parse_vendors,
)

__all__ = [
    "PRIORITY_NAMES",
    "REQUEST_KEYS",
    "GPURequest",
    "Interconnect",
    "Partition",
    "parse_duration",
    "parse_size",
]


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
        isolation: for a fraction: ``hard`` (a MIG instance / AMD compute partition of its own,
            handed out whole), ``soft`` (a share of a whole device under MPS limits) or ``any``.
        profile: the slice profile a ``hard`` fraction needs (``"3g.40gb"``, ``"CPX"``), or None
            for the smallest free slice that holds it.
        job_type: what kind of work runs (a row of the executor's ``[gpusched] throughput_file``:
            its speed per GPU model), or None. It steers the placement's speed term and the
            ``migrate`` preemption mode; devices are matched without it.
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
    isolation: str = "any"
    profile: str | None = None
    job_type: str | None = None

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def build(cls, *, catalog: Catalog | None = None, **kwargs: Any) -> GPURequest:
        """Validate keyword arguments into a request.

        Accepted keys: ``gpus`` (a whole number 1–4096, or a fraction 0.001–0.999 in steps of
        0.001), ``count`` (1–4096), ``milli`` (1–1000), ``memory`` (bytes or '40GiB', ≤ 1 PiB),
        ``vendor``/``vendors``, ``model``/``models``, ``labels`` (mapping, ≤ 32 labels of ≤ 63
        characters), ``min_arch`` (an architecture a catalog model has, or
        ``min_compute_capability`` '8.0'), ``interconnect``, ``gang``, ``tenant``, ``priority``
        (0–100 or low/normal/high/critical), ``partition``, ``expected_duration`` (seconds or
        '2h'; sub-second values round up to 1 s, at most 366 days), ``isolation`` (any, hard,
        soft), ``profile`` (a slice profile of an allowed model, e.g. '3g.40gb' or 'CPX') and
        ``job_type`` (1–128 printable characters: a row of the executor's throughput table).
        Non-finite numbers are rejected.
        """
        cat = catalog or default_catalog()
        unknown = set(kwargs) - _ACCEPTED_KEYS
        if unknown:
            key = sorted(unknown)[0]
            close = difflib.get_close_matches(key[:60], sorted(_ACCEPTED_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            plain = key.isidentifier() and len(key) <= 40
            raise GPURequestError(
                key if plain else "<request>", kwargs[key], ", ".join(sorted(_ACCEPTED_KEYS)),
                f"unknown field{'' if plain else ' ' + safe_repr(key)}{hint}",
            )
        count, milli = parse_gpus(kwargs)
        memory = parse_size(kwargs["memory"]) if kwargs.get("memory") is not None else 0
        if milli < MILLI and memory == 0:
            raise GPURequestError(
                "memory", None, "a size such as '8GiB'",
                "a fractional GPU request must say how much device memory it needs",
            )
        vendors = parse_vendors(kwargs.get("vendors", kwargs.get("vendor")))
        models = parse_models(kwargs.get("models", kwargs.get("model")), cat)
        for name in models:
            model_vendor = cat.get(name).vendor
            if vendors and model_vendor not in vendors:
                raise GPURequestError(
                    "models", name, f"models of the allowed vendors {sorted(vendors)}",
                    f"model {name!r} is made by {model_vendor}, which the request excludes",
                )
        min_arch = parse_min_arch(kwargs, cat)
        if min_arch is not None:
            made_by = arch_vendor(min_arch)
            if vendors and made_by not in vendors:
                raise GPURequestError(
                    "min_arch", min_arch, f"an architecture of {sorted(vendors)}",
                    f"{min_arch} is a {made_by} architecture but vendors are {sorted(vendors)}",
                )
        interconnect = parse_enum(Interconnect, "interconnect", kwargs.get("interconnect"))
        gang = parse_bool("gang", kwargs.get("gang", count > 1))
        if count > 1 and not gang:
            raise GPURequestError(
                "gang", False, "true (or leave it out) for count > 1",
                "a multi-device request is always placed all-or-nothing",
            )
        partition = parse_enum(Partition, "partition", kwargs.get("partition"))
        duration = (
            parse_duration(kwargs["expected_duration"])
            if kwargs.get("expected_duration") is not None
            else 0
        )
        candidates = [
            m for m in cat.models
            if (not models or m.name in models) and (not vendors or m.vendor in vendors)
            and (min_arch is None
                 or (m.vendor is arch_vendor(min_arch) and m.arch_rank >= arch_rank(min_arch)))
        ]
        isolation, profile = parse_isolation(kwargs, count, milli, candidates, cat)
        request = cls(
            count=count,
            milli_per_gpu=milli,
            memory_per_gpu=memory,
            vendors=vendors,
            models=models,
            labels=parse_labels(kwargs.get("labels")),
            min_arch=min_arch,
            interconnect=interconnect or Interconnect.SAME_NODE,
            gang=gang,
            tenant=parse_tenant(kwargs.get("tenant", "default")),
            priority=parse_priority(kwargs.get("priority", "normal")),
            partition=partition or Partition.TRAINING,
            expected_duration_s=duration,
            isolation=isolation,
            profile=profile,
            job_type=parse_job_type(kwargs.get("job_type")),
        )
        request._check_feasible_memory(cat)
        return request

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, catalog: Catalog | None = None) -> GPURequest:
        """Validate a mapping (for example ``executor_config["gpusched"]``) into a request.

        Field names must be strings (a YAML ``1: 2`` key is rejected, not turned into ``"1"``).
        """
        if not isinstance(data, Mapping):
            raise GPURequestError("<request>", data, "a mapping of request fields")
        for key in data:
            if not isinstance(key, str):
                raise GPURequestError(
                    "<request>", key, ", ".join(sorted(_ACCEPTED_KEYS)),
                    f"field name {safe_repr(key)} is not a string",
                )
        return cls.build(catalog=catalog, **dict(data))

    @classmethod
    def from_yaml(cls, text: str, *, catalog: Catalog | None = None) -> GPURequest:
        """Validate a YAML mapping into a request (a duplicated key is an error, not an overwrite)."""
        try:
            data = strict_yaml(text)
        except FieldProblem as exc:
            raise GPURequestError(
                "<request>", text, "a YAML mapping of request fields", exc.problem
            ) from None
        return cls.from_dict(data, catalog=catalog)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_dict` turns back into an equal request
        (``job_type`` only when set)."""
        data = {
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
            "isolation": self.isolation,
            "profile": self.profile,
        }
        if self.job_type is not None:
            data["job_type"] = self.job_type
        return data

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

    @property
    def wants_slice(self) -> bool:
        """Whether the request may be placed on a hard-isolated slice (MIG instance, AMD partition)."""
        return self.is_fractional and self.isolation != "soft"

    @property
    def wants_shared(self) -> bool:
        """Whether the request may share a whole device (soft isolation) when fractional."""
        return self.isolation != "hard"

    def describe(self, *, fractional: bool | None = None, owner: bool = False) -> str:
        """The one human phrase for this request, e.g. ``4 NVLink/xGMI/HCCS-connected A100-SXM-80GB``.

        ``fractional`` overrides :attr:`is_fractional` (a whole-GPU request placed as a share);
        ``owner`` appends the partition and tenant (``…, training, tenant vision``) for the UI.
        """
        frac = self.is_fractional if fractional is None else fractional
        parts: list[str] = []
        if frac:
            if self.isolation == "hard":
                share = f"≥{self.milli_per_gpu / MILLI:g}"
                parts.append(f"a hard-isolated {self.profile or 'slice'} ({share}) of a")
            else:
                parts.append(f"{self.milli_per_gpu / MILLI:g} of a")
        else:
            parts.append(str(self.count))
            if self.count > 1 and _LINK_WORDS[self.interconnect]:
                parts.append(_LINK_WORDS[self.interconnect])
        plural = "" if frac or self.count == 1 else "s"
        if self.models:
            parts.append("|".join(sorted(self.models)))
        elif self.vendors:
            parts.append("|".join(sorted(str(v) for v in self.vendors)) + f" GPU{plural}")
        else:
            parts.append(f"GPU{plural}")
        if self.min_arch:
            parts.append(f"≥{self.min_arch}")
        if self.memory_per_gpu:
            parts.append(f"with ≥{_gib(self.memory_per_gpu)} free")
        if self.labels:
            parts.append("on " + ",".join(f"{k}={v}" for k, v in self.labels))
        text = " ".join(parts)
        return f"{text}, {self.partition.value}, tenant {self.tenant}" if owner else text

    def _check_feasible_memory(self, cat: Catalog) -> None:
        if not self.memory_per_gpu:
            return
        candidates = [
            m for m in cat.models
            if (not self.models or m.name in self.models)
            and (not self.vendors or m.vendor in self.vendors)
        ]
        if self.isolation == "hard":
            largest = max((p.memory_bytes for m in candidates for p in m.slice_profiles
                           if self.profile is None or p.name == self.profile), default=0)
            if self.memory_per_gpu > largest:
                raise GPURequestError(
                    "memory", self.memory_per_gpu, f"at most {largest // 2**30} GiB for a hard-isolated slice"
                    + (f" of profile {self.profile}" if self.profile else ""),
                    f"{self.memory_per_gpu / 2**30:.1f} GiB exceeds every allowed slice",
                )
            return
        largest = max((m.memory_bytes for m in candidates), default=0)
        if candidates and self.memory_per_gpu > largest:
            raise GPURequestError(
                "memory", self.memory_per_gpu, f"at most {largest // 2**30} GiB for the allowed models",
                f"{self.memory_per_gpu / 2**30:.1f} GiB per device exceeds every allowed model",
            )


_ACCEPTED_KEYS = frozenset({
    "gpus", "count", "milli", "memory", "vendor", "vendors", "model", "models", "labels",
    "min_arch", "min_compute_capability", "interconnect", "gang", "tenant", "priority",
    "partition", "expected_duration", "isolation", "profile", "job_type",
})
REQUEST_KEYS: frozenset[str] = _ACCEPTED_KEYS
"""Every keyword :meth:`GPURequest.build` accepts (for helpers that split request from other kwargs)."""


_LINK_WORDS = {
    Interconnect.ISLAND: "NVLink/xGMI/HCCS-connected",
    Interconnect.SAME_NUMA: "same-NUMA",
    Interconnect.SAME_NODE: "same-node",
    Interconnect.SAME_RACK: "same-rack",
    Interconnect.ANY: "",
}


def _gib(value: int) -> str:
    return f"{value / 2**30:.0f} GiB" if value % 2**30 == 0 else f"{value / 2**30:.1f} GiB"
