"""gpu()/gpu_task authoring, task keys, and that the example DAG files parse light and clean."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpusched.airflow.authoring import gpu, gpu_task, partition_pool, request_from_executor_config
from gpusched.errors import GPURequestError
from gpusched.request import GPURequest, Interconnect
from gpusched.scheduler.keys import parse_ti_key, ti_key, ti_key_of

REPO = Path(__file__).resolve().parents[2]


def test_gpu_puts_a_validated_request_in_executor_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSCHED_POOL_SYNC", raising=False)
    kwargs = gpu(gpus=4, vendor="nvidia", interconnect="island", memory="40GiB")
    assert set(kwargs) == {"executor_config"}
    request = request_from_executor_config(kwargs["executor_config"])
    assert request is not None
    expected = (4, Interconnect.ISLAND, 40 * 2**30)
    assert (request.count, request.interconnect, request.memory_per_gpu) == expected
    json.dumps(kwargs)  # must serialise with the DAG


def test_gpu_pool_sync_assigns_the_partition_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCHED_POOL_SYNC", "true")
    kwargs = gpu(gpus=2, partition="dev")
    assert kwargs["pool"] == partition_pool("dev") == "gpu_dev"
    assert kwargs["pool_slots"] == 2
    assert "pool" not in gpu(gpus=1, pool_sync=False)


def test_an_explicit_pool_wins_over_the_partition_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSCHED_POOL_SYNC", "true")
    assert gpu(gpus=2, pool="team_a")["pool"] == "team_a"
    assert gpu(gpus=2, pool="team_a")["pool_slots"] == 2  # slots default to the device count
    assert gpu(gpus=2, pool="team_a", pool_slots=1)["pool_slots"] == 1
    assert gpu(gpus=2, pool="team_a", pool_sync=False)["pool"] == "team_a"  # whatever pool sync says
    partition = gpu(gpus=2, pool_slots=5)
    assert (partition["pool"], partition["pool_slots"]) == ("gpu_training", 5)

    @gpu_task(gpus=2, pool="team_a", retries=1)
    def train() -> None:
        return None

    op = train().operator
    assert (op.pool, op.pool_slots, op.retries) == ("team_a", 2, 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"gpus": 1, "pool": ""}, "pool"), ({"gpus": 1, "pool": 3}, "pool"),
     ({"gpus": 1, "pool_slots": 0}, "pool_slots"), ({"gpus": 1, "pool_slots": True}, "pool_slots")],
)
def test_a_bad_pool_is_one_line_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GPURequestError) as info:
        gpu(**kwargs)
    assert info.value.field == field
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"GPURequest.{field}:") and "accepted:" in message


def test_gang_task_takes_the_options_of_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk import DAG

    from gpusched.airflow.gang import gang_task

    monkeypatch.setenv("GPUSCHED_POOL_SYNC", "true")

    def members(**kwargs: Any) -> dict[str, Any]:
        with DAG(dag_id="g", schedule=None) as dag:
            @gang_task(nodes=2, gpus_per_node=2, vendor="nvidia", **kwargs)
            def train() -> None:
                return None

            train()
        return {t.task_id: t for t in dag.tasks}

    synced = members(retries=2)
    assert sorted(synced) == ["train__node0", "train__node1"]
    assert {(t.pool, t.pool_slots, t.retries) for t in synced.values()} == {("gpu_training", 2, 2)}
    unsynced = members(pool_sync=False)  # an option of gpu(), not forwarded to @task
    assert {t.pool for t in unsynced.values()} == {"default_pool"}
    own = members(pool="team_a", pool_slots=1, task_id="pretrain", executor_config={"other": 1})
    assert sorted(own) == ["pretrain__node0", "pretrain__node1"]
    for rank, member in enumerate(own[f"pretrain__node{r}"] for r in (0, 1)):
        assert (member.pool, member.pool_slots) == ("team_a", 1)
        assert member.executor_config["other"] == 1
        assert member.executor_config["gpusched_gang"]["rank"] == rank
        assert request_from_executor_config(member.executor_config) == GPURequest.build(
            gpus=2, vendor="nvidia", interconnect="same_node")
    with pytest.raises(GPURequestError, match=r"GPURequest\.pool_slots: 0 is not valid"):
        gang_task(nodes=2, gpus_per_node=1, pool_slots=0)
    with pytest.raises(GPURequestError, match="use nodes and gpus_per_node"):
        gang_task(nodes=2, gpus_per_node=1, count=2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"gpus": 0.5}, "memory"), ({"gpus": 2, "interconect": "island"}, "interconect"),
     ({"gpus": 1, "partition": "prod"}, "partition")],
)
def test_gpu_rejects_bad_fields_at_parse_time(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GPURequestError) as info:
        gpu(**kwargs)
    assert info.value.field == field


def test_request_from_executor_config() -> None:
    assert request_from_executor_config(None) is None
    assert request_from_executor_config({"KubernetesExecutor": {}}) is None
    request = GPURequest.build(gpus=0.25, memory="8GiB")
    assert request_from_executor_config({"gpusched": request.to_dict()}) == request
    with pytest.raises(GPURequestError):
        request_from_executor_config({"gpusched": {"gpus": -1}})


def test_gpu_task_splits_request_and_task_arguments() -> None:
    @gpu_task(gpus=2, interconnect="same_numa", retries=3, executor_config={"other": 1})
    def train() -> None:
        return None

    op = train().operator
    assert op.retries == 3
    assert op.executor_config["other"] == 1
    expected = GPURequest.build(gpus=2, interconnect="same_numa")
    assert request_from_executor_config(op.executor_config) == expected


def test_bare_gpu_task_asks_for_one_whole_device() -> None:
    @gpu_task
    def infer() -> None:
        return None

    assert request_from_executor_config(infer().operator.executor_config) == GPURequest.build(gpus=1)


def test_task_keys_round_trip() -> None:
    key = ti_key("dag.a", "task_1", "manual__2026-01-01T00:00:00+00:00/x", 2, -1)
    parts = parse_ti_key(key)
    assert parts is not None
    assert parts.run_id == "manual__2026-01-01T00:00:00+00:00/x"
    assert ti_key_of(parts) == key
    assert parse_ti_key("job-17") is None


def test_example_dags_parse_without_errors_and_stay_light(tmp_path: Path) -> None:
    code = f"""
import importlib.util, json, sys
from pathlib import Path
heavy = ("numpy", "pandas", "deap", "statsmodels", "gpusched.ledger", "gpusched.placement",
         "matplotlib")
# Of the device layer only envexport (the variables per vendor, pure): the Docker operator's mapping.
light = ("gpusched.hardware", "gpusched.hardware.envexport")
found = {{}}
for path in sorted(Path({str(REPO / 'dags')!r}).glob("example_*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dag = getattr(module, path.stem)()
    found[dag.dag_id] = {{t.task_id: (t.executor_config or {{}}).get("gpusched") for t in dag.tasks}}
found["_heavy"] = [m for m in heavy if m in sys.modules] + sorted(
    m for m in sys.modules if m.startswith("gpusched.hardware") and m not in light)
print(json.dumps(found))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found.pop("_heavy") == []
    assert set(found) == {
        "example_multi_gpu_nvlink_training", "example_fractional_finetune", "example_dev_smoke_test",
        "example_multi_node_gang", "example_gpu_container",
    }
    gang = found["example_multi_node_gang"]
    assert sorted(gang) == ["pretrain__node0", "pretrain__node1"]
    assert all(member["count"] == 8 and member["interconnect"] == "same_node" for member in gang.values())
    train = found["example_multi_gpu_nvlink_training"]
    assert train["prepare_dataset"] is None
    assert train["train_resnet50"]["count"] == 4 and train["train_resnet50"]["interconnect"] == "island"
    fractions = found["example_fractional_finetune"]
    assert fractions["finetune_sentiment"]["milli"] == fractions["finetune_ner"]["milli"] == 500
    assert found["example_dev_smoke_test"]["smoke_test"]["partition"] == "dev"
    containers = found["example_gpu_container"]
    assert containers["show_devices"]["count"] == 1 and containers["show_devices"]["vendors"] == ["nvidia"]
    assert containers["train"]["count"] == 2 and containers["train"]["interconnect"] == "island"
