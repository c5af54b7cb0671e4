"""The accelerator catalog: required models with their figures, aliases, architecture ordering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusched.catalog import Catalog, LinkKind, Vendor, arch_rank, default_catalog
from gpusched.errors import CatalogError

GIB = 2**30

# name: (vendor, architecture, memory GiB, peak TFLOPS, TDP W, link, partitioning must include)
REQUIRED = {
    "H100-SXM-80GB": (Vendor.NVIDIA, "sm_90", 80, 989.0, 700, LinkKind.NVSWITCH, {"mig", "mps"}),
    "H200-SXM-141GB": (Vendor.NVIDIA, "sm_90", 141, 989.0, 700, LinkKind.NVSWITCH, {"mig"}),
    "A100-SXM-80GB": (Vendor.NVIDIA, "sm_80", 80, 312.0, 400, LinkKind.NVLINK, {"mig", "mps"}),
    "A100-PCIE-40GB": (Vendor.NVIDIA, "sm_80", 40, 312.0, 250, LinkKind.PCIE, {"mig"}),
    "L40S": (Vendor.NVIDIA, "sm_89", 48, 362.0, 350, LinkKind.PCIE, {"mps"}),
    "A10": (Vendor.NVIDIA, "sm_86", 24, 125.0, 150, LinkKind.PCIE, {"mps"}),
    "T4": (Vendor.NVIDIA, "sm_75", 16, 65.0, 70, LinkKind.PCIE, {"mps"}),
    "V100-SXM2-32GB": (Vendor.NVIDIA, "sm_70", 32, 125.0, 300, LinkKind.NVLINK, set()),
    "V100-SXM2-16GB": (Vendor.NVIDIA, "sm_70", 16, 125.0, 300, LinkKind.NVLINK, set()),
    "P100-PCIE-16GB": (Vendor.NVIDIA, "sm_60", 16, 18.7, 250, LinkKind.PCIE, set()),
    "K80": (Vendor.NVIDIA, "sm_37", 12, 4.4, 150, LinkKind.PCIE, set()),
    "MI300X": (Vendor.AMD, "gfx942", 192, 1307.4, 750, LinkKind.XGMI, {"compute-partition"}),
    "MI250X": (Vendor.AMD, "gfx90a", 64, 191.5, 280, LinkKind.XGMI, set()),
    "Ascend-910B": (Vendor.ASCEND, "ascend910b", 64, 313.0, 400, LinkKind.HCCS, {"vnpu"}),
}


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_required_model_figures(name: str) -> None:
    vendor, arch, memory_gib, tflops, tdp_w, link, partitioning = REQUIRED[name]
    model = default_catalog().get(name)
    assert model.vendor is vendor
    assert model.architecture == arch
    assert model.memory_bytes == memory_gib * GIB
    assert model.peak_tflops == pytest.approx(tflops)
    assert model.tdp_milliwatts == tdp_w * 1000
    assert model.link is link
    assert partitioning <= set(model.partitioning)
    assert model.disclosed
    assert model.a100_equiv_milli > 0


def test_reference_model_and_relative_speeds() -> None:
    cat = default_catalog()
    assert cat.get("A100-SXM-80GB").a100_equiv_milli == 1000
    speed = {name: cat.get(name).a100_equiv_milli for name in ("H100", "A100", "T4")}
    assert speed["H100"] > speed["A100"] > speed["T4"]


def test_three_vendors_present() -> None:
    assert {m.vendor for m in default_catalog().models} == set(Vendor)


def test_undisclosed_trace_models() -> None:
    cat = default_catalog()
    for name in ("G2", "G3"):
        model = cat.get(name)
        assert not model.disclosed
        assert model.architecture not in cat.architectures()


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM-80GB"),
        ("h100", "H100-SXM-80GB"),
        ("NVIDIA H200", "H200-SXM-141GB"),
        ("V100M16", "V100-SXM2-16GB"),
        ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
        ("v100-sxm2-16gb", "V100-SXM2-16GB"),
        ("V100M32", "V100-SXM2-32GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM-80GB"),
        ("Tesla T4", "T4"),
        ("AMD Instinct MI300X", "MI300X"),
        (" Ascend 910B ", "Ascend-910B"),
        ("910b", "Ascend-910B"),
    ],
)
def test_aliases_resolve_case_insensitively(alias: str, name: str) -> None:
    assert default_catalog().get(alias).name == name


def test_unknown_model_error_lists_known_and_fix() -> None:
    with pytest.raises(CatalogError) as info:
        default_catalog().get("B200")
    message = str(info.value)
    assert "'B200'" in message
    assert "H100-SXM-80GB" in message
    assert "accelerators.json" in message
    assert default_catalog().find("B200") is None


def test_duplicate_alias_is_rejected(tmp_path: Path) -> None:
    raw = json.loads((Path(__file__).parents[2] / "gpusched/include/catalog/accelerators.json").read_text())
    raw["models"][1]["aliases"].append("H100")  # H200 claiming H100's alias
    path = tmp_path / "cat.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(CatalogError, match="used by two models"):
        Catalog.from_file(path)


def test_broken_catalog_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{\"models\": [{\"name\": \"X\"}]}")
    with pytest.raises(CatalogError, match=r"broken\.json"):
        Catalog.from_file(path)


def test_arch_ordering_within_each_vendor() -> None:
    nvidia = ["sm_37", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90"]
    amd = ["gfx908", "gfx90a", "gfx942", "gfx1100"]
    ascend = ["ascend910", "ascend910b", "ascend910c"]
    for chain in (nvidia, amd, ascend):
        ranks = [arch_rank(a) for a in chain]
        assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks), chain
    assert arch_rank("undisclosed") == 0
    assert arch_rank("gfxzzz") == 0


def test_compute_capability_and_fractions() -> None:
    cat = default_catalog()
    assert cat.get("H100").compute_capability == "9.0"
    assert cat.get("T4").compute_capability == "7.5"
    assert cat.get("MI300X").compute_capability is None
    assert cat.get("MI300X").arch_rank > cat.get("MI250X").arch_rank
    assert cat.get("A100").supports_fractions
    assert not cat.get("K80").supports_fractions
