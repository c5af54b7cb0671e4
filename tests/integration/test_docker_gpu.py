"""GPU Docker tasks against a REAL Docker engine.

This machine has no GPU: stand-in character devices (mknod) in a temporary folder play the
AMD render nodes / Ascend davinci nodes, and the tests check that a container started by
``GPUDockerOperator`` sees exactly the allocated ones (``ls /dev``, environment). For NVIDIA the
device request must reach the engine (``HostConfig.DeviceRequests``); without the NVIDIA
Container Toolkit the engine then refuses to *start* the container, which the operator reports in
one line. A private engine whose NVIDIA driver runs a stand-in for the toolkit's hook
(``_docker_support.nvidia_engine``) then starts it with exactly the allocated GPUs.

The engine: ``$DOCKER_HOST`` or the default socket; started with ``scripts/start_dockerd.sh``
when absent (root + ``apt-get install -y docker.io``). The image is built locally from a static
busybox (``apt-get install -y busybox-static``) with ``docker import``; nothing is pulled.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _docker_support import BUSYBOX_IMAGE, NvidiaEngine, busybox_image, default_engine, nvidia_engine
from _docker_support import python_image as build_python_image

from gpusched.catalog import Vendor
from gpusched.hardware.envexport import allocation_from_env, devices_env
from gpusched.model import DeviceShare

pytestmark = pytest.mark.docker

IMAGE = BUSYBOX_IMAGE
GIB = 1024**3


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A reachable Docker engine (started with scripts/start_dockerd.sh when needed)."""
    client = default_engine()
    yield client
    client.close()


@pytest.fixture(scope="module")
def image(engine: Any) -> str:
    """A tiny image with busybox (sh, ls, env), imported from a local rootfs tarball."""
    return busybox_image(engine)


@pytest.fixture(scope="module")
def python_image(engine: Any) -> str:
    """bash + this machine's Python 3.11 and stdlib (what ``@task.docker`` runs), imported offline."""
    return build_python_image(engine)


def _stand_in_devices(root: Path, names: list[str]) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))  # a char device (like /dev/null)


def _allocation(vendor: Vendor, indices: list[int], key: str) -> dict[str, Any]:
    shares = [DeviceShare(f"{vendor}-uuid-{i}", "host-a", i, 1000, 64 * GIB) for i in indices]
    record = allocation_from_env(devices_env(shares, vendor=vendor, key=key))
    assert record is not None
    return record


def _run_operator(
    image: str, allocation: dict[str, Any] | None, dev_root: Path | None, **kwargs: Any
) -> list[str]:
    from gpusched.airflow.docker import GPUDockerOperator

    op = GPUDockerOperator(
        task_id=f"t_{uuid.uuid4().hex[:8]}",
        image=image,
        command=["sh", "-c", "ls /dev /dev/dri 2>/dev/null; env | sort"],
        allocation=allocation,
        dev_root=str(dev_root) if dev_root else None,
        xcom_all=True,
        do_xcom_push=True,
        mount_tmp_dir=False,
        auto_remove="force",
        **kwargs,
    )
    lines = op.execute(context={})
    assert isinstance(lines, list)
    return [str(line).strip() for line in lines]


def test_amd_container_sees_exactly_its_render_nodes(image: str, tmp_path: Path) -> None:
    _stand_in_devices(tmp_path, ["kfd", *(f"dri/renderD{128 + i}" for i in range(4))])
    out = _run_operator(image, _allocation(Vendor.AMD, [1, 3], "dag.train.run1.1.-1"), tmp_path)
    names = set(out)
    assert {"kfd", "renderD129", "renderD131"} <= names
    assert not {"renderD128", "renderD130"} & names  # not allocated: not visible
    assert "HIP_VISIBLE_DEVICES=0,1" in out and "ROCR_VISIBLE_DEVICES=0,1" in out
    allocation_line = next(line for line in out if line.startswith("GPUSCHED_ALLOCATION="))
    assert '"devices": [1, 3]' in allocation_line and "dag.train.run1.1.-1" in allocation_line


def test_ascend_container_sees_exactly_its_npus(image: str, tmp_path: Path) -> None:
    control = ["davinci_manager", "devmm_svm", "hisi_hdc"]
    _stand_in_devices(tmp_path, [*(f"davinci{i}" for i in range(8)), *control])
    out = _run_operator(image, _allocation(Vendor.ASCEND, [2, 5], "k-ascend"), tmp_path)
    davinci = {line for line in out if line.startswith("davinci")}
    assert davinci == {"davinci2", "davinci5", "davinci_manager"}  # not davinci0/1/3/4/6/7
    assert {"devmm_svm", "hisi_hdc"} <= set(out)
    assert "ASCEND_RT_VISIBLE_DEVICES=0,1" in out


def test_allocation_is_read_from_the_task_environment(
    image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_in_devices(tmp_path, ["kfd", "dri/renderD128", "dri/renderD129"])
    shares = [DeviceShare("amd-uuid-0", "host-a", 0, 1000, 64 * GIB)]
    for name, value in devices_env(shares, vendor=Vendor.AMD, key="from-env").items():
        monkeypatch.setenv(name, value)  # what the gpusched listener exports into the task process
    monkeypatch.setenv("GPUSCHED_DEV_ROOT", str(tmp_path))
    out = _run_operator(image, None, None)
    assert "renderD128" in out and "renderD129" not in out
    assert any("from-env" in line for line in out)


def test_network_is_none_and_shared_volume_is_mounted(image: str, engine: Any, tmp_path: Path) -> None:
    from gpusched.airflow.docker import GPUDockerOperator

    _stand_in_devices(tmp_path, ["davinci0", "davinci_manager", "devmm_svm", "hisi_hdc"])
    name = f"gpusched-test-{uuid.uuid4().hex[:8]}"
    volume = f"gpusched-test-vol-{uuid.uuid4().hex[:6]}"
    op = GPUDockerOperator(
        task_id="net", image=image, container_name=name,
        command=["sh", "-c", "ls /sys/class/net; ls -d /shared"],
        allocation=_allocation(Vendor.ASCEND, [0], "k-net"), dev_root=str(tmp_path),
        shared_volume=volume, xcom_all=True, mount_tmp_dir=False, auto_remove="never",
    )
    try:
        out = [str(line).strip() for line in op.execute(context={})]
        inspected = engine.api.inspect_container(name)
        assert inspected["HostConfig"]["NetworkMode"] == "none"
        assert out[0].split() == ["lo"]  # only loopback
        assert "/shared" in out
        mounts = {m["Destination"]: m for m in inspected["Mounts"]}
        assert mounts["/shared"]["Name"] == volume
    finally:
        engine.api.remove_container(name, force=True)
        engine.api.remove_volume(volume)


def test_nvidia_device_request_reaches_the_engine(image: str, engine: Any) -> None:
    from gpusched.airflow.docker import GPUDockerOperator
    from gpusched.errors import ConfigurationError

    name = f"gpusched-test-{uuid.uuid4().hex[:8]}"
    allocation = _allocation(Vendor.NVIDIA, [0, 2], "k-nv")
    op = GPUDockerOperator(
        task_id="nv", image=image, container_name=name, command=["true"], allocation=allocation,
        mount_tmp_dir=False, auto_remove="never", shared_volume=None,
    )
    try:
        runtimes = engine.info().get("Runtimes", {})
        if "nvidia" in runtimes:  # a real NVIDIA host: it must simply run
            op.execute(context={})
        else:
            # No NVIDIA Container Toolkit here: the engine accepts the request but cannot start
            # the container; the operator says so in one line, with the fix.
            with pytest.raises(ConfigurationError) as raised:
                op.execute(context={})
            assert "cannot give containers NVIDIA GPUs (could not select device driver)" in str(raised.value)
            assert "install the NVIDIA Container Toolkit" in str(raised.value)
            assert "\n" not in str(raised.value)
        inspected = engine.api.inspect_container(name)
        requests = inspected["HostConfig"]["DeviceRequests"]
        assert len(requests) == 1
        assert requests[0]["DeviceIDs"] == ["nvidia-uuid-0", "nvidia-uuid-2"]
        assert requests[0]["Capabilities"] == [["gpu"]]
        assert "CUDA_VISIBLE_DEVICES=nvidia-uuid-0,nvidia-uuid-2" in inspected["Config"]["Env"]
        assert not inspected["HostConfig"].get("Devices")
    finally:
        engine.api.remove_container(name, force=True)


@pytest.fixture(scope="module")
def nvidia() -> Iterator[NvidiaEngine]:
    """A private engine with the NVIDIA device driver (the toolkit's hook stood in)."""
    yield from nvidia_engine()


def test_nvidia_container_sees_exactly_its_gpus_through_the_toolkit_hook(nvidia: NvidiaEngine) -> None:
    image = busybox_image(nvidia.client)
    allocation = _allocation(Vendor.NVIDIA, [1, 3], "dag.train.run1.1.-1")
    out = _run_operator(image, allocation, None, docker_url=nvidia.url, shared_volume=None)
    # The engine's NVIDIA driver turned the device request into the toolkit's variable and ran
    # the toolkit's hook for exactly the allocated GPUs; CUDA sees the same UUIDs.
    assert "NVIDIA_VISIBLE_DEVICES=nvidia-uuid-1,nvidia-uuid-3" in out
    assert "CUDA_VISIBLE_DEVICES=nvidia-uuid-1,nvidia-uuid-3" in out
    assert [(c["args"], c["NVIDIA_VISIBLE_DEVICES"]) for c in nvidia.hook_calls()] == [
        (["prestart"], "nvidia-uuid-1,nvidia-uuid-3")]


def test_no_engine_is_one_line_naming_the_problem_and_the_fix(tmp_path: Path) -> None:
    from gpusched.airflow.docker import GPUDockerOperator
    from gpusched.errors import ConfigurationError

    url = f"unix://{tmp_path / 'no-docker.sock'}"
    op = GPUDockerOperator(task_id="nodocker", image=IMAGE, command=["true"], docker_url=url,
                           allocation=_allocation(Vendor.NVIDIA, [0], "k-none"), mount_tmp_dir=False)
    with pytest.raises(ConfigurationError) as raised:
        op.execute(context={})
    message = str(raised.value)
    assert message == (f"task 'nodocker': no Docker engine answers at {url}: start one "
                       "(e.g. `sudo systemctl start docker`) or point DOCKER_HOST / docker_url at one")


def test_an_image_the_engine_cannot_pull_is_one_line_naming_it_and_the_fix(image: str) -> None:
    from gpusched.airflow.docker import GPUDockerOperator
    from gpusched.errors import ConfigurationError

    absent = "gpusched-test/never-built:absent"  # no registry here has it (and none is reachable)
    op = GPUDockerOperator(task_id="nopull", image=absent, command=["true"],
                           allocation=_allocation(Vendor.NVIDIA, [0], "k-pull"), mount_tmp_dir=False)
    with pytest.raises(ConfigurationError) as raised:
        op.execute(context={})
    message = str(raised.value)
    assert message.startswith(f"task 'nopull': the Docker engine at {op.docker_url} cannot pull image "
                              f"'{absent}' ("), message
    assert message.endswith(f"pull or build it on that host (`docker pull {absent}`), or give the task "
                            "an image the engine has") and "\n" not in message, message


def test_missing_allocation_is_a_clear_error(image: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusched.airflow.docker import GPUDockerOperator
    from gpusched.errors import ConfigurationError

    monkeypatch.delenv("GPUSCHED_ALLOCATION", raising=False)
    op = GPUDockerOperator(task_id="none", image=image, command=["true"], mount_tmp_dir=False)
    with pytest.raises(ConfigurationError, match="no GPU allocation"):
        op.execute(context={})
    plain = _run_operator(image, None, None, require_gpu=False)
    assert not any(line.startswith("GPUSCHED_ALLOCATION=") for line in plain)


def test_decorated_task_builds_a_gpu_docker_operator() -> None:
    from airflow.sdk import DAG

    from gpusched.airflow.docker import GPUDockerDecoratedOperator, gpu_docker_task

    with DAG("gpu_docker_decorated", schedule=None):

        @gpu_docker_task(image=IMAGE, shared_volume=None)
        def train() -> int:
            return 1

        node = train()
    assert isinstance(node.operator, GPUDockerDecoratedOperator)
    assert node.operator.network_mode == "none"
    assert node.operator.require_gpu is True


def test_gpu_docker_task_runs_python_with_exactly_its_devices(python_image: str, tmp_path: Path) -> None:
    from airflow.sdk import DAG

    from gpusched.airflow.docker import gpu_docker_task

    _stand_in_devices(tmp_path, ["kfd", *(f"dri/renderD{128 + i}" for i in range(4))])
    allocation = _allocation(Vendor.AMD, [0, 2], "dag.decorated.r1.1.-1")
    with DAG("gpu_docker_decorated_run", schedule=None):

        @gpu_docker_task(image=python_image, allocation=allocation, dev_root=str(tmp_path),
                         expect_airflow=False, mount_tmp_dir=False, shared_volume=None, auto_remove="force")
        def probe(scale: int) -> dict[str, object]:
            import os

            return {"dri": sorted(os.listdir("/dev/dri")), "kfd": os.path.exists("/dev/kfd"),
                    "hip": os.environ.get("HIP_VISIBLE_DEVICES"), "answer": 21 * scale}

        node = probe(2)
    result = node.operator.execute(context={})
    assert result == {"dri": ["renderD128", "renderD130"], "kfd": True, "hip": "0,1", "answer": 42}
