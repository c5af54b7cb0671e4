"""GPU containers: Docker tasks that see exactly the GPUs gpusched gave them.

``GPUDockerOperator`` and its decorator ``@gpu_docker_task`` are the Docker provider's
``DockerOperator`` / ``@task.docker`` plus the task's allocation: the container gets a device
request for the allocated NVIDIA GPUs only (the NVIDIA Container Toolkit exposes just those; on
AMD and Ascend the allocated device nodes), ``CUDA_VISIBLE_DEVICES`` naming them and
``GPUSCHED_ALLOCATION`` (node, host indices, UUIDs). The network is off and the named volume
``gpusched-shared`` is mounted at ``/shared`` for datasets and checkpoints (docs/docker.md).

* ``show_devices`` (``GPUDockerOperator``, one GPU): the container prints the devices it was
  given, and ``nvidia-smi -L`` when the image has it.
* ``train`` (``@gpu_docker_task``, two GPUs of one NVLink island): a Python function runs in the
  container and returns the devices it saw, which becomes the task's XCom.

Needs a Docker engine on the worker (``docker info`` answers; ``DOCKER_HOST`` points elsewhere)
with the NVIDIA Container Toolkit, and the images, which are params of the run: ``image`` (default
the CUDA runtime image) and ``python_image`` (any image with ``python3`` and ``bash``). Without an
engine both tasks fail at once with one line naming the problem and the fix; parsing this file
and ``gpusched check`` need no engine.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag

from gpusched.airflow.authoring import gpu
from gpusched.airflow.docker import BASE_IMAGES, GPUDockerOperator, gpu_docker_task

SHOW_DEVICES = (
    'echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"; '
    'echo "NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"; '
    'echo "GPUSCHED_ALLOCATION=$GPUSCHED_ALLOCATION"; '
    "if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L; fi"
)


@dag(
    dag_id="example_gpu_container",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["gpusched", "example", "docker"],
    doc_md=__doc__,
    params={
        "image": Param(BASE_IMAGES["nvidia"], type="string", description="image of show_devices"),
        "python_image": Param("pytorch/pytorch:2.4.1-cuda12.4-cudnn9-runtime", type="string",
                              description="image of train: needs python3 and bash"),
    },
)
def example_gpu_container() -> None:
    GPUDockerOperator(
        task_id="show_devices",
        image="{{ params.image }}",
        command=["sh", "-c", SHOW_DEVICES],
        auto_remove="success",
        **gpu(gpus=1, vendor="nvidia", memory="8GiB", tenant="vision", expected_duration="2m"),
    )

    @gpu_docker_task(
        task_id="train",
        image="{{ params.python_image }}",
        expect_airflow=False,  # the image has Python, not Airflow
        auto_remove="success",
        **gpu(gpus=2, vendor="nvidia", interconnect="island", tenant="vision", expected_duration="10m"),
    )
    def train() -> dict[str, object]:
        import json
        import os

        allocation = json.loads(os.environ.get("GPUSCHED_ALLOCATION") or "{}")
        seen = {
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "nvidia_visible_devices": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
            "node": allocation.get("node"),
            "devices": allocation.get("devices"),
            "uuids": allocation.get("uuids"),
            "key": allocation.get("key"),
        }
        print(f"training on {seen}")  # a real task would start torch.distributed here
        return seen

    train()


example_gpu_container()
