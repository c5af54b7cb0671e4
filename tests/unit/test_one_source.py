"""One source of truth each: the GPU-task test, the request phrase, the node builder."""

from __future__ import annotations

from types import SimpleNamespace

from gpusched.airflow.authoring import CONFIG_KEY, gpu, is_gpu_task
from gpusched.request import GPURequest


def test_is_gpu_task_reads_the_key_gpu_writes_on_tasks_tis_and_workloads() -> None:
    config = gpu(gpus=1)["executor_config"]
    assert CONFIG_KEY in config
    task = SimpleNamespace(executor_config=config)
    assert is_gpu_task(task)
    assert is_gpu_task(SimpleNamespace(task=task, executor_config=None))  # task instance
    assert is_gpu_task(SimpleNamespace(task=SimpleNamespace(executor_config=None), executor_config=config))
    assert is_gpu_task(SimpleNamespace(ti=SimpleNamespace(executor_config=config)))  # workload
    assert not is_gpu_task(SimpleNamespace(ti=SimpleNamespace(executor_config={})))
    assert not is_gpu_task(SimpleNamespace(task=SimpleNamespace(executor_config={"other": 1})))
    assert not is_gpu_task(SimpleNamespace())
    assert not is_gpu_task(SimpleNamespace(executor_config="gpusched"))


def test_describe_is_one_phrase_with_an_optional_owner() -> None:
    req = GPURequest.build(gpus=4, models=["A100-SXM-80GB"], interconnect="island", tenant="vision")
    assert req.describe() == "4 NVLink/xGMI/HCCS-connected A100-SXM-80GB"
    assert req.describe(owner=True) == "4 NVLink/xGMI/HCCS-connected A100-SXM-80GB, training, tenant vision"
    half = GPURequest.build(gpus=0.5, memory="8GiB")
    assert half.describe() == "0.5 of a GPU with ≥8 GiB free"
    assert GPURequest.build(gpus=1).describe(fractional=True).endswith("of a GPU")
