"""The accelerator catalog: one registry of known GPU/NPU models and their figures.

The data lives in ``gpusched/include/catalog/accelerators.json``; this module loads it once into
immutable :class:`AcceleratorModel` records and resolves names and aliases case-insensitively
(``"V100M16"``, ``"Tesla V100-SXM2-16GB"`` and ``"v100-sxm2-16gb"`` are the same model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path

from gpusched.errors import CatalogError
from gpusched.paths import include_dir

__all__ = [
    "AcceleratorModel",
    "Catalog",
    "LinkKind",
    "Vendor",
    "arch_rank",
    "default_catalog",
]

GIB = 1024**3


class Vendor(StrEnum):
    """Accelerator vendors gpusched knows how to drive."""

    NVIDIA = "nvidia"
    AMD = "amd"
    ASCEND = "ascend"


class LinkKind(StrEnum):
    """The fastest intra-node link a model is built with."""

    NVSWITCH = "nvswitch"
    NVLINK = "nvlink"
    XGMI = "xgmi"
    HCCS = "hccs"
    PCIE = "pcie"

    @property
    def is_high_speed(self) -> bool:
        """True for peer links faster than PCIe (NVLink/NVSwitch, xGMI, HCCS)."""
        return self is not LinkKind.PCIE


def arch_rank(architecture: str) -> int:
    """An integer that orders architectures of one vendor, oldest first.

    ``sm_90`` → 90; AMD ``gfxNNN`` names are hexadecimal (``gfx908`` < ``gfx90a`` < ``gfx942``
    < ``gfx1100``); ``ascend910`` → 9100, ``ascend910b`` → 9102. Unknown or undisclosed → 0.
    """
    arch = architecture.lower()
    if arch.startswith("sm_") and arch[3:].isdigit():
        return int(arch[3:])
    if arch.startswith("gfx"):
        try:
            return int(arch[3:], 16)
        except ValueError:
            return 0
    if arch.startswith("ascend"):
        body = arch[6:]
        digits = "".join(ch for ch in body if ch.isdigit())
        suffix = body[len(digits):]
        if digits and len(suffix) <= 1:
            return int(digits) * 10 + (ord(suffix) - ord("a") + 1 if suffix else 0)
    return 0


@dataclass(frozen=True, slots=True)
class AcceleratorModel:
    """One accelerator model as the catalog describes it (integer units where it matters)."""

    name: str
    aliases: tuple[str, ...]
    vendor: Vendor
    architecture: str
    family: str
    memory_bytes: int
    peak_tflops: float
    peak_precision: str
    tdp_milliwatts: int
    link: LinkKind
    partitioning: tuple[str, ...]
    a100_equiv_milli: int
    disclosed: bool

    @property
    def arch_rank(self) -> int:
        """Orders this model's architecture among its vendor's (see :func:`arch_rank`)."""
        return arch_rank(self.architecture)

    @property
    def compute_capability(self) -> str | None:
        """NVIDIA compute capability as ``"9.0"``; ``None`` for other vendors or undisclosed."""
        if self.vendor is Vendor.NVIDIA and self.architecture.startswith("sm_"):
            digits = self.architecture[3:]
            return f"{digits[:-1]}.{digits[-1]}"
        return None

    @property
    def supports_fractions(self) -> bool:
        """Whether one device can be shared by several tasks (MPS, MIG or vendor partitions)."""
        return bool(self.partitioning)


class Catalog:
    """An immutable set of models with case-insensitive lookup by name or alias."""

    def __init__(self, models: tuple[AcceleratorModel, ...]) -> None:
        self._models = models
        index: dict[str, AcceleratorModel] = {}
        for model in models:
            for key in (model.name, *model.aliases):
                folded = key.casefold()
                if folded in index and index[folded] is not model:
                    raise CatalogError(f"catalog name {key!r} is used by two models; make it unique")
                index[folded] = model
        self._index = index

    @classmethod
    def from_file(cls, path: Path) -> Catalog:
        """Load a catalog JSON file (the format of ``gpusched/include/catalog/accelerators.json``)."""
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            models = tuple(_parse_model(entry) for entry in raw["models"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CatalogError(f"cannot read accelerator catalog {path}: {exc}") from exc
        return cls(models)

    @property
    def models(self) -> tuple[AcceleratorModel, ...]:
        """All models, in file order."""
        return self._models

    @property
    def names(self) -> tuple[str, ...]:
        """Canonical names of all models."""
        return tuple(model.name for model in self._models)

    def get(self, name: str) -> AcceleratorModel:
        """The model called ``name`` (canonical name or alias, any case).

        Raises:
            CatalogError: naming the unknown model and listing the known ones.
        """
        model = self._index.get(name.strip().casefold())
        if model is None:
            raise CatalogError(
                f"unknown accelerator model {name!r}; known models: {', '.join(self.names)} "
                "(add it to gpusched/include/catalog/accelerators.json)"
            )
        return model

    def find(self, name: str) -> AcceleratorModel | None:
        """Like :meth:`get` but ``None`` for an unknown name."""
        return self._index.get(name.strip().casefold())

    def architectures(self) -> tuple[str, ...]:
        """Every architecture name in the catalog, sorted."""
        return tuple(sorted({m.architecture for m in self._models if m.disclosed}))


def _parse_model(entry: dict[str, object]) -> AcceleratorModel:
    return AcceleratorModel(
        name=str(entry["name"]),
        aliases=tuple(str(a) for a in entry.get("aliases", ()) or ()),  # type: ignore[attr-defined]
        vendor=Vendor(str(entry["vendor"])),
        architecture=str(entry["architecture"]),
        family=str(entry["family"]),
        memory_bytes=int(float(str(entry["memory_gib"])) * GIB),
        peak_tflops=float(str(entry["peak_tflops"])),
        peak_precision=str(entry["peak_precision"]),
        tdp_milliwatts=int(str(entry["tdp_watts"])) * 1000,
        link=LinkKind(str(entry["link"])),
        partitioning=tuple(str(p) for p in entry.get("partitioning", ()) or ()),  # type: ignore[attr-defined]
        a100_equiv_milli=int(str(entry["a100_equiv_milli"])),
        disclosed=bool(entry.get("disclosed", True)),
    )


@cache
def default_catalog() -> Catalog:
    """The catalog shipped in ``gpusched/include/catalog/accelerators.json`` (loaded once)."""
    return Catalog.from_file(include_dir() / "catalog" / "accelerators.json")
