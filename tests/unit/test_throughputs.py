"""The throughput table (``[gpusched] throughput_file``, ``bench gavel --throughputs``) and the
task-level ``job_type`` that selects its row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusched.airflow.authoring import gpu
from gpusched.errors import ConfigurationError, GPURequestError
from gpusched.placement.preemption import check_mode
from gpusched.request import GPURequest
from gpusched.throughputs import load_throughputs, parse_throughputs


def test_simple_shape_resolves_model_aliases() -> None:
    table = parse_throughputs({"resnet": {"a100": 10, "K80": 1.5}, "bert": {"V100": 3.0}})
    assert table == {"resnet": {"A100-SXM-80GB": 10.0, "K80": 1.5}, "bert": {"V100-SXM2-16GB": 3.0}}


def test_gavel_shape_keeps_single_gpu_runs_alone_of_known_gpu_types() -> None:
    raw = {"v100": {"('A3C', 1)": {"null": 3.0, "('LM', 1)": 1.0}, "('A3C', 2)": {"null": 5.0}},
           "k80": {"('A3C', 1)": {"null": 1.0}}, "v100_unconsolidated": {"('A3C', 1)": {"null": 9.0}}}
    assert parse_throughputs(raw) == {"A3C": {"V100-SXM2-16GB": 3.0, "K80": 1.0}}


@pytest.mark.parametrize(("data", "says"), [
    ([], "not a non-empty JSON object"),
    ({"resnet": {"H900": 1.0}}, "'H900' is not in the accelerator catalog"),
    ({"resnet": {"A100": -1}}, "give a finite number >= 0"),
    ({"resnet": {"A100": True}}, "give a finite number >= 0"),
    ({"resnet": 3}, "is not an object"),
    ({"v100": {"A3C": {"null": 1.0}}}, "not a (job type, scale) pair"),
])
def test_bad_tables_are_one_line_errors(data: object, says: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_throughputs(data)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tp.json"
    path.write_text(json.dumps({"resnet": {"T4": 1.0}}))
    assert load_throughputs(path) == {"resnet": {"T4": 1.0}}
    path.write_text("{not json")
    with pytest.raises(ConfigurationError, match=r"throughput file .*tp\.json is not JSON"):
        load_throughputs(path)
    with pytest.raises(ConfigurationError, match="cannot be read"):
        load_throughputs(tmp_path / "missing.json")


def test_job_type_is_validated_at_parse_time_and_travels_in_the_request() -> None:
    config = gpu(gpus=1, job_type="ResNet-50 (batch size 64)")["executor_config"]["gpusched"]
    assert config["job_type"] == "ResNet-50 (batch size 64)"
    assert GPURequest.from_dict(config).job_type == "ResNet-50 (batch size 64)"
    assert "job_type" not in GPURequest.build(gpus=1).to_dict()  # unchanged without one
    assert GPURequest.build(gpus=1, job_type="").job_type is None
    for bad in (" padded", "x" * 129, "line\nbreak", 7):
        with pytest.raises(GPURequestError, match=r"GPURequest\.job_type"):
            gpu(gpus=1, job_type=bad)


def test_migrate_is_a_mode_only_where_the_caller_handles_it() -> None:
    assert check_mode("Migrate", extra=("migrate",)) == "migrate"
    with pytest.raises(ConfigurationError, match="not one of off, priority, partitions, service;"):
        check_mode("migrate")
