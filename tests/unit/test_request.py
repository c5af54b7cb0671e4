"""GPURequest: every field valid and invalid; errors name the field and what it accepts; round trips."""

from __future__ import annotations

from typing import Any

import pytest

from gpusched.catalog import Vendor
from gpusched.errors import GPURequestError
from gpusched.model import MILLI
from gpusched.request import GPURequest, Interconnect, Partition, parse_duration, parse_size

GIB = 2**30


def _error(**kwargs: Any) -> GPURequestError:
    with pytest.raises(GPURequestError) as info:
        GPURequest.build(**kwargs)
    return info.value


def _assert_names(exc: GPURequestError, field: str, *accepted: str) -> None:
    assert exc.field == field
    message = str(exc)
    assert f"GPURequest.{field}" in message
    assert "accepted:" in message
    for word in accepted:
        assert word in message, (word, message)


# ---- count / gpus / milli ------------------------------------------------------------------------


def test_gpus_whole_and_fraction() -> None:
    assert GPURequest.build(gpus=4).count == 4
    assert GPURequest.build(gpus=4).milli_per_gpu == MILLI
    half = GPURequest.build(gpus=0.25, memory="8GiB")
    assert (half.count, half.milli_per_gpu, half.is_fractional) == (1, 250, True)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True])
def test_gpus_invalid(bad: object) -> None:
    _assert_names(_error(gpus=bad, memory="1GiB"), "gpus", "whole number", "fraction")


def test_count_valid_and_invalid() -> None:
    assert GPURequest.build(count=3).count == 3
    _assert_names(_error(count=0), "count", "whole number ≥ 1")
    _assert_names(_error(count="3"), "count", "whole number ≥ 1")


def test_gpus_and_count_together_rejected() -> None:
    _assert_names(_error(gpus=2, count=2), "gpus", "either 'gpus' or 'count'")


def test_milli_valid_and_invalid() -> None:
    assert GPURequest.build(milli=500, memory="4GiB").milli_per_gpu == 500
    _assert_names(_error(milli=0, memory="4GiB"), "milli", "1 to 1000")
    _assert_names(_error(milli=1001), "milli", "1 to 1000")
    _assert_names(_error(count=2, milli=500, memory="4GiB"), "milli", "1000 when count > 1")


# ---- memory ---------------------------------------------------------------------------------------


def test_memory_units() -> None:
    assert GPURequest.build(memory="40GiB").memory_per_gpu == 40 * GIB
    assert GPURequest.build(memory="16GB").memory_per_gpu == 16 * 10**9
    assert GPURequest.build(memory=1024).memory_per_gpu == 1024
    assert parse_size("512MiB") == 512 * 2**20


@pytest.mark.parametrize("bad", ["lots", -5, 0, "12 parsecs", True])
def test_memory_invalid(bad: object) -> None:
    _assert_names(_error(memory=bad), "memory", "'40GiB'")


def test_fraction_needs_memory() -> None:
    _assert_names(_error(gpus=0.5), "memory", "8GiB")


def test_memory_larger_than_every_allowed_model() -> None:
    exc = _error(memory="100GiB", models=["T4"])
    _assert_names(exc, "memory", "at most 16 GiB")


# ---- vendors / models ------------------------------------------------------------------------------


def test_vendors_valid_and_invalid() -> None:
    request = GPURequest.build(vendors=["NVIDIA", "amd"])
    assert request.vendors == frozenset({Vendor.NVIDIA, Vendor.AMD})
    assert GPURequest.build(vendor="ascend").vendors == frozenset({Vendor.ASCEND})
    _assert_names(_error(vendor="intel"), "vendors", "nvidia", "amd", "ascend")


def test_models_aliases_resolve_and_unknown_rejected() -> None:
    assert GPURequest.build(model="NVIDIA H100 80GB HBM3").models == frozenset({"H100-SXM-80GB"})
    assert GPURequest.build(models=["v100m16", "MI300X"]).models == frozenset({"V100-SXM2-16GB", "MI300X"})
    _assert_names(_error(model="H900"), "models", "H100-SXM-80GB", "MI300X")


def test_model_of_excluded_vendor() -> None:
    _assert_names(_error(model="MI300X", vendor="nvidia"), "models", "allowed vendors")


# ---- labels -----------------------------------------------------------------------------------------


def test_labels_valid_and_invalid() -> None:
    assert GPURequest.build(labels={"zone": "a", "pool": 3}).labels == (("pool", "3"), ("zone", "a"))
    _assert_names(_error(labels=["zone=a"]), "labels", "mapping")
    _assert_names(_error(labels={"bad key!": "x"}), "labels", "label names")
    _assert_names(_error(labels={"zone": ["a"]}), "labels", "strings")


# ---- min_arch / min_compute_capability ----------------------------------------------------------------


def test_min_arch_valid() -> None:
    assert GPURequest.build(min_arch="sm_80").min_arch == "sm_80"
    assert GPURequest.build(min_arch="8.0").min_arch == "sm_80"
    assert GPURequest.build(min_arch="gfx942").min_arch == "gfx942"
    assert GPURequest.build(min_compute_capability="9.0").min_arch == "sm_90"


def test_min_arch_invalid() -> None:
    _assert_names(_error(min_arch="pentium"), "min_arch", "sm_80", "gfx942")
    _assert_names(_error(min_compute_capability="nine"), "min_compute_capability", "'8.0'")
    _assert_names(_error(min_arch="sm_80", min_compute_capability="8.0"), "min_arch", "not both")
    _assert_names(_error(min_arch="gfx942", vendor="nvidia"), "min_arch", "architecture of")


# ---- interconnect / gang ---------------------------------------------------------------------------


def test_interconnect_valid_and_invalid() -> None:
    assert GPURequest.build(gpus=2, interconnect="ISLAND").interconnect is Interconnect.ISLAND
    assert GPURequest.build().interconnect is Interconnect.SAME_NODE
    _assert_names(_error(interconnect="nvlink-please"), "interconnect", "any", "same_numa", "island")


def test_gang_valid_and_invalid() -> None:
    assert GPURequest.build(gpus=4).gang is True
    assert GPURequest.build(gpus=1, gang=True).gang is True
    assert GPURequest.build(gpus=8, interconnect="any").may_span_nodes is True
    _assert_names(_error(gang="yes"), "gang", "true or false")
    _assert_names(_error(gpus=2, gang=False), "gang", "count > 1")


# ---- tenant / priority / partition / duration --------------------------------------------------------


def test_tenant_valid_and_invalid() -> None:
    assert GPURequest.build(tenant="team-vision").tenant == "team-vision"
    _assert_names(_error(tenant="Team Vision"), "tenant", "lower-case")
    _assert_names(_error(tenant=""), "tenant", "lower-case")


def test_priority_valid_and_invalid() -> None:
    assert GPURequest.build(priority="critical").priority == 100
    assert GPURequest.build(priority=7).priority == 7
    _assert_names(_error(priority=101), "priority", "0–100", "critical")
    _assert_names(_error(priority="urgent"), "priority", "low", "normal", "high")


def test_partition_valid_and_invalid() -> None:
    assert GPURequest.build(partition="dev").partition is Partition.DEV
    _assert_names(_error(partition="prod"), "partition", "training", "burst", "dev")


def test_expected_duration_valid_and_invalid() -> None:
    assert GPURequest.build(expected_duration="1h30m").expected_duration_s == 5400
    assert GPURequest.build(expected_duration=90).expected_duration_s == 90
    assert parse_duration("2d") == 172800
    _assert_names(_error(expected_duration="soon"), "expected_duration", "'2h'")
    _assert_names(_error(expected_duration=-3), "expected_duration", "positive")


def test_unknown_field_suggests_the_right_one() -> None:
    exc = _error(memroy="8GiB")
    assert exc.field == "memroy"
    assert "did you mean 'memory'" in str(exc)


# ---- round trips ---------------------------------------------------------------------------------------


FULL = {
    "gpus": 4, "memory": "40GiB", "vendors": ["nvidia"], "models": ["H100", "A100"],
    "labels": {"zone": "a"}, "min_arch": "sm_80", "interconnect": "island", "tenant": "team-a",
    "priority": "high", "partition": "burst", "expected_duration": "2h",
}


def test_to_dict_from_dict_round_trip() -> None:
    request = GPURequest.build(**FULL)
    data = request.to_dict()
    assert GPURequest.from_dict(data) == request
    assert data["models"] == ["A100-SXM-80GB", "H100-SXM-80GB"]
    fraction = GPURequest.build(gpus=0.3, memory="10GiB")
    assert GPURequest.from_dict(fraction.to_dict()) == fraction


def test_from_yaml_round_trip() -> None:
    import yaml

    request = GPURequest.build(**FULL)
    text = yaml.safe_dump(request.to_dict())
    assert GPURequest.from_yaml(text) == request
    parsed = GPURequest.from_yaml("gpus: 2\nmemory: 24GiB\ninterconnect: same_numa\n")
    assert (parsed.count, parsed.memory_per_gpu, parsed.interconnect) == (2, 24 * GIB, Interconnect.SAME_NUMA)


def test_from_yaml_and_from_dict_reject_non_mappings() -> None:
    with pytest.raises(GPURequestError) as info:
        GPURequest.from_yaml("gpus: [1, 2")
    assert info.value.field == "<request>"
    with pytest.raises(GPURequestError):
        GPURequest.from_dict(["gpus", 2])  # type: ignore[arg-type]


# ---- bad input found by probing (issue: input validation is incomplete) --------------------------


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"gpus": float("nan")}, "gpus", ("not a finite number",)),
        ({"gpus": float("inf")}, "gpus", ("not a finite number",)),
        ({"expected_duration": float("inf")}, "expected_duration", ("not a finite number",)),
        ({"expected_duration": float("nan")}, "expected_duration", ("not a finite number",)),
        ({"count": 10**12}, "count", ("4096",)),
        ({"gpus": 5000}, "gpus", ("4096",)),
        ({"min_arch": "sm_999"}, "min_arch", ("no catalog model", "sm_90")),
        ({"min_arch": "gfx9999"}, "min_arch", ("no catalog model", "gfx942")),
        ({"min_compute_capability": "9.9"}, "min_compute_capability", ("8.0",)),
        ({"tenant": "abc\n"}, "tenant", ("lower-case",)),
        ({"gpus": 0.9999, "memory": "1GiB"}, "gpus", ("0.001", "0.999")),
        ({"gpus": 0.0005, "memory": "1GiB"}, "gpus", ("0.001",)),
        ({"vendor": {"nvidia": 1}}, "vendors", ("nvidia, amd, ascend",)),
        ({"models": [["H100"]]}, "models", ("H100-SXM-80GB",)),
        ({"labels": {"zone": "x" * 10_000}}, "labels", ("63",)),
        ({"labels": {"x" * 10_000: "a"}}, "labels", ("63",)),
        ({"labels": {"zone": 10**5000}}, "labels", ("63",)),
        ({"priority": 10**5000}, "priority", ("0–100",)),
        ({"memory": "9" * 400 + "GiB"}, "memory", ("1 PiB",)),
        ({"memory": 2**80}, "memory", ("1 PiB",)),
        ({"interconnect": ["island"]}, "interconnect", ("same_node",)),
        ({"expected_duration": "999999999d"}, "expected_duration", ("366 days",)),
    ],
)
def test_probed_bad_inputs_are_request_errors(kwargs: dict[str, Any], field: str, words: tuple[str]) -> None:
    exc = _error(**kwargs)
    _assert_names(exc, field, *words)
    assert "\n" not in str(exc) and len(str(exc)) < 400


def test_sub_second_duration_rounds_up_never_zero() -> None:
    assert GPURequest.build(expected_duration="0.1s").expected_duration_s == 1
    assert GPURequest.build(expected_duration=1.5).expected_duration_s == 2
    assert GPURequest.build(expected_duration="1h30m").expected_duration_s == 5400


def test_fractions_in_milli_steps_are_accepted() -> None:
    assert GPURequest.build(gpus=0.999, memory="1GiB").milli_per_gpu == 999
    assert GPURequest.build(gpus=0.001, memory="1GiB").milli_per_gpu == 1
    assert GPURequest.build(gpus=2.0).count == 2


@pytest.mark.parametrize(
    "text", ["gpus: .inf", "gpus: .nan", "gpus: 1\ngpus: 2\n", "1: 2", "expected_duration: -.inf"]
)
def test_yaml_bad_input(text: str) -> None:
    with pytest.raises(GPURequestError) as info:
        GPURequest.from_yaml(text)
    assert "\n" not in str(info.value)


def test_yaml_duplicated_key_is_named() -> None:
    with pytest.raises(GPURequestError, match=r"line 2.*duplicated key 'gpus'"):
        GPURequest.from_yaml("gpus: 1\ngpus: 2\n")
