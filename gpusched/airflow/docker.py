"""Docker tasks that see exactly their allocated GPUs: ``GPUDockerOperator`` and ``@gpu_docker_task``.

At ``execute()`` the operator reads the task's allocation (``GPUSCHED_ALLOCATION``, exported into
the task process by the gpusched executor/listener, or the ``allocation=`` argument), maps it with
:func:`gpusched.airflow.docker_devices.container_gpu_spec` and starts the container with:

* NVIDIA: ``device_requests=[DeviceRequest(device_ids=[uuids], capabilities=[["gpu"]])]``;
* AMD / Ascend: the device nodes in ``HostConfig.Devices`` (the provider's ``DockerOperator`` has
  no ``devices`` argument, so this class adds them to the host config it builds);
* the variables of :func:`gpusched.hardware.envexport.devices_env` (visible devices, fractions, allocation);
* ``network_mode="none"`` by default, and an optional shared named volume (datasets,
  checkpoints) mounted at ``/shared``.

A missing engine, or an engine that cannot hand out NVIDIA GPUs (no NVIDIA Container Toolkit),
fails the task at once with one :class:`~gpusched.errors.ConfigurationError` line naming the
problem and the fix, instead of the Docker client's traceback.

Usage::

    GPUDockerOperator(task_id="train", image="my-train:1", command="python train.py",
                      **gpu(gpus=2, memory="40GiB"))

    @gpu_docker_task(image="my-train:1", **gpu(gpus=1))
    def train(): ...
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from airflow.exceptions import AirflowException
from airflow.providers.docker.decorators.docker import _DockerDecoratedOperator
from airflow.providers.docker.operators.docker import DockerOperator
from docker.errors import APIError

from gpusched.airflow.docker_devices import (
    GpuContainerSpec,
    container_gpu_spec,
    profiles_from_allocation,
    shares_from_allocation,
)
from gpusched.errors import ConfigurationError
from gpusched.hardware.envexport import allocation_from_env

__all__ = [
    "BASE_IMAGES",
    "GPUDockerDecoratedOperator",
    "GPUDockerOperator",
    "docker_gpu_arguments",
    "gpu_docker_task",
]

BASE_IMAGES: Mapping[str, str] = {
    "nvidia": "nvidia/cuda:12.4.1-runtime-ubuntu22.04",
    "amd": "rocm/dev-ubuntu-22.04:6.1",
    "ascend": "ascendai/cann:8.0.0-910b-ubuntu22.04-py3.10",
}
"""Suggested vendor base images; build task images FROM them (see docs/docker.md)."""


NO_NVIDIA_DRIVER = "could not select device driver"
"""What the Docker engine answers to a GPU device request when it has no NVIDIA Container Toolkit."""


def docker_gpu_arguments(spec: GpuContainerSpec) -> dict[str, Any]:
    """Docker API arguments for ``spec``: ``device_requests``, ``devices``, ``ipc_mode``, ``binds``.

    ``device_requests`` holds ``docker.types.DeviceRequest`` objects (NVIDIA), ``devices`` the
    ``host:container:rwm`` strings (AMD, Ascend) for ``create_host_config(devices=...)``.
    """
    from docker.types import DeviceRequest

    arguments: dict[str, Any] = {"device_requests": [], "devices": list(spec.devices)}
    if spec.gpu_device_ids:
        arguments["device_requests"].append(
            DeviceRequest(device_ids=list(spec.gpu_device_ids), capabilities=[["gpu"]])
        )
    if spec.ipc_host:
        arguments["ipc_mode"] = "host"
    arguments["binds"] = list(spec.bind_mounts)
    return arguments


class GPUDockerOperator(DockerOperator):
    """A ``DockerOperator`` whose container sees exactly the task's allocated devices.

    Args (besides every ``DockerOperator`` argument):
        allocation: the allocation record (the ``GPUSCHED_ALLOCATION`` dict); default: read
            from the task process environment at run time.
        require_gpu: fail when no allocation is found (default True) instead of running
            without devices.
        dev_root: host folder with the device nodes (default ``$GPUSCHED_DEV_ROOT`` or ``/dev``).
        render_nodes: AMD uuid → host render node path, when not ``renderD<128+index>``.
        shared_volume: a named Docker volume mounted at ``shared_mount`` (None: no volume).
        network_mode: defaults to ``"none"`` (a training container needs no network here).
    """

    def __init__(
        self,
        *,
        allocation: Mapping[str, Any] | None = None,
        require_gpu: bool = True,
        dev_root: str | None = None,
        render_nodes: Mapping[str, str] | None = None,
        shared_volume: str | None = "gpusched-shared",
        shared_mount: str = "/shared",
        network_mode: str | None = "none",
        **kwargs: Any,
    ) -> None:
        super().__init__(network_mode=network_mode, **kwargs)
        self.allocation = dict(allocation) if allocation is not None else None
        self.require_gpu = require_gpu
        self.dev_root = dev_root
        self.render_nodes = dict(render_nodes or {})
        self.shared_volume = shared_volume
        self.shared_mount = shared_mount
        self.gpu_spec: GpuContainerSpec | None = None

    def resolve_gpu_spec(self) -> GpuContainerSpec | None:
        """The container spec of this task's allocation (None when there is none and not required).

        Raises:
            ConfigurationError: ``require_gpu`` and no allocation was given or exported.
        """
        record = self.allocation if self.allocation is not None else allocation_from_env(os.environ)
        if record is None:
            if self.require_gpu:
                raise ConfigurationError(
                    f"task {self.task_id!r} has no GPU allocation: run it under the gpusched executor "
                    "with a request (**gpu(...)), pass allocation=..., or set require_gpu=False"
                )
            return None
        shares, vendor, models = shares_from_allocation(record)
        key = record.get("key")
        return container_gpu_spec(
            shares, vendor, key=str(key) if key else None, models=models,
            dev_root=self.dev_root, render_nodes=self.render_nodes,
            profiles=profiles_from_allocation(record),
        )

    def check_engine(self) -> None:
        """Connect to the Docker engine (the provider's client, kept for the run).

        Raises:
            ConfigurationError: no engine answers at ``docker_url`` (one line: what and the fix).
        """
        try:
            self.cli  # noqa: B018 - the provider's client pings the engine when first built
        except AirflowException as exc:  # "Failed to establish connection to any given Docker hosts."
            raise ConfigurationError(
                f"task {self.task_id!r}: no Docker engine answers at {self.docker_url}: start one "
                "(e.g. `sudo systemctl start docker`) or point DOCKER_HOST / docker_url at one"
            ) from exc

    def execute(self, context: Any) -> Any:
        from docker.types import Mount

        self.gpu_spec = self.resolve_gpu_spec()
        self.check_engine()
        if self.gpu_spec is not None:
            arguments = docker_gpu_arguments(self.gpu_spec)
            self.environment = {**self.environment, **self.gpu_spec.environment}
            self.device_requests = [*(self.device_requests or []), *arguments["device_requests"]]
            if "ipc_mode" in arguments:
                self.ipc_mode = arguments["ipc_mode"]
            for source, target in arguments["binds"]:
                self.mounts.append(Mount(target=target, source=source, type="bind"))
            self.log.info(
                "gpusched: container gets %s devices on %s: %s", self.gpu_spec.vendor,
                self.gpu_spec.node, list(self.gpu_spec.gpu_device_ids) or list(self.gpu_spec.devices),
            )
        if self.shared_volume:
            self.mounts.append(Mount(target=self.shared_mount, source=self.shared_volume, type="volume"))
        try:
            return super().execute(context)
        except APIError as exc:
            problem = self.engine_problem(exc)
            if problem is None:
                raise
            raise ConfigurationError(problem) from exc

    def engine_problem(self, exc: APIError) -> str | None:
        """The one line that says what the engine refused and the fix, for the refusals a user can
        fix (no NVIDIA runtime, an image it cannot pull); None for any other error."""
        text = str(exc)
        if self.gpu_spec is not None and self.gpu_spec.gpu_device_ids and NO_NVIDIA_DRIVER in text:
            return (f"task {self.task_id!r}: the Docker engine at {self.docker_url} cannot give containers "
                    f"NVIDIA GPUs ({NO_NVIDIA_DRIVER}): install the NVIDIA Container Toolkit on that "
                    "host and restart dockerd")
        if "/images/create" in text:  # the provider pulls an image the engine does not have
            why = (exc.explanation or text).splitlines()[0] if isinstance(exc.explanation, str) else text
            return (f"task {self.task_id!r}: the Docker engine at {self.docker_url} cannot pull image "
                    f"{self.image!r} ({why[:200]}): pull or build it on that host (`docker pull "
                    f"{self.image}`), or give the task an image the engine has")
        return None

    def _run_image_with_mounts(self, target_mounts: Any, add_tmp_variable: bool) -> Any:
        # DockerOperator builds the host config itself and has no `devices` argument: add ours
        # to that one call, for the lifetime of this run only.
        devices = list(self.gpu_spec.devices) if self.gpu_spec is not None else []
        if not devices:
            return super()._run_image_with_mounts(target_mounts, add_tmp_variable)
        cli = self.cli
        original = cli.create_host_config

        def create_host_config(*args: Any, **kwargs: Any) -> Any:
            kwargs["devices"] = [*(kwargs.get("devices") or []), *devices]
            return original(*args, **kwargs)

        cli.create_host_config = create_host_config
        try:
            return super()._run_image_with_mounts(target_mounts, add_tmp_variable)
        finally:
            del cli.create_host_config


class GPUDockerDecoratedOperator(GPUDockerOperator, _DockerDecoratedOperator):
    """``@task.docker`` with the devices of the task's allocation (see :func:`gpu_docker_task`)."""

    custom_operator_name = "@gpu_docker_task"


def gpu_docker_task(python_callable: Any = None, multiple_outputs: bool | None = None, **kwargs: Any) -> Any:
    """Like ``@task.docker``, but the container sees exactly the task's allocated devices.

    Accepts every ``@task.docker`` argument plus those of :class:`GPUDockerOperator`; combine with
    ``**gpu(...)`` from :mod:`gpusched.airflow.authoring` to declare the request.
    """
    from airflow.sdk.bases.decorator import task_decorator_factory

    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=GPUDockerDecoratedOperator,
        **kwargs,
    )
