"""GPU Docker tasks against a REAL Docker engine.

This machine has no GPU: stand-in character devices (mknod) in a temporary folder play the
AMD render nodes / Ascend davinci nodes, and the tests check that a container started by
``GPUDockerOperator`` sees exactly the allocated ones (``ls /dev``, environment). For NVIDIA the
device request must reach the engine (``HostConfig.DeviceRequests``); without the NVIDIA
container runtime the engine then refuses to *start* the container, which is asserted too.

The engine: ``$DOCKER_HOST`` or the default socket; started with ``scripts/start_dockerd.sh``
when absent (root + ``apt-get install -y docker.io``). The image is built locally from a static
busybox (``apt-get install -y busybox-static``) with ``docker import``; nothing is pulled.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusched.catalog import Vendor
from gpusched.hardware.envexport import allocation_from_env, devices_env
from gpusched.model import DeviceShare

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
IMAGE = "gpusched-test-busybox:1"
GIB = 1024**3


def _client() -> Any:
    import docker

    return docker.from_env(version="auto", timeout=30)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A reachable Docker engine (started with scripts/start_dockerd.sh when needed)."""
    import docker

    try:
        client = _client()
        client.ping()
    except docker.errors.DockerException:
        if shutil.which("dockerd") is None:
            pytest.skip("no Docker engine and dockerd is not installed (apt-get install -y docker.io)")
        if os.geteuid() != 0:
            pytest.skip("no Docker engine running and starting dockerd needs root")
        result = subprocess.run([str(REPO / "scripts" / "start_dockerd.sh")], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, f"dockerd did not start: {result.stderr}"
        client = _client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def image(engine: Any) -> str:
    """A tiny image with busybox (sh, ls, env), imported from a local rootfs tarball."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is needed to build the test image offline (apt-get install -y busybox-static)")
    if engine.images.list(name=IMAGE):
        return IMAGE
    ldd = subprocess.run(["ldd", busybox], capture_output=True, text=True)
    if "not a dynamic executable" not in ldd.stdout + ldd.stderr:
        pytest.skip("busybox is not static; install busybox-static")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder in ("bin", "dev", "proc", "sys", "tmp", "etc", "shared"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for applet in ("sh", "ls", "env", "cat", "echo", "test"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
    engine.api.import_image_from_data(buffer.getvalue(), repository=IMAGE.split(":")[0], tag="1")
    return IMAGE


PY_IMAGE = "gpusched-test-python:1"


@pytest.fixture(scope="module")
def python_image(engine: Any) -> str:
    """bash + this machine's Python 3.11 and stdlib (what ``@task.docker`` runs), imported offline."""
    if engine.images.list(name=PY_IMAGE):
        return PY_IMAGE
    # The interpreter behind this venv, at its own path (so it finds its stdlib), plus bash.
    python = Path(os.path.realpath(sys.executable))
    bash = Path(shutil.which("bash") or "/usr/bin/bash")
    binaries = [bash, python]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not bash.exists() or not stdlib.is_dir():
        pytest.skip("needs bash and the interpreter's stdlib to build the test image offline")
    libs: set[str] = set()
    for binary in [*binaries, *stdlib.glob("lib-dynload/*.so")]:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        libs.update(part for line in out.splitlines() for part in line.split() if part.startswith("/"))
    skip = {"test", "idlelib", "tkinter", "ensurepip", "lib2to3", "__pycache__", "site-packages",
            "dist-packages", "turtledemo"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder in ("tmp", "dev", "proc", "sys", "etc"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if folder == "tmp" else 0o755
            tar.addfile(info)
        for path in [*binaries, *(Path(lib) for lib in sorted(libs))]:
            tar.add(str(path.resolve()), arcname=str(path).lstrip("/"))
        tar.add(str(stdlib), arcname=str(stdlib).lstrip("/"),
                filter=lambda info: None if set(Path(info.name).parts) & skip else info)
        if str(python) != "/usr/bin/python3":
            link = tarfile.TarInfo("usr/bin/python3")
            link.type, link.linkname = tarfile.SYMTYPE, str(python)
            tar.addfile(link)
        if str(bash) != "/bin/bash":
            link = tarfile.TarInfo("bin/bash")
            link.type, link.linkname = tarfile.SYMTYPE, str(bash)
            tar.addfile(link)
    engine.api.import_image_from_data(buffer.getvalue(), repository=PY_IMAGE.split(":")[0], tag="1")
    return PY_IMAGE


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
    import docker

    from gpusched.airflow.docker import GPUDockerOperator

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
            # No NVIDIA runtime here: the engine accepts the request but cannot start it.
            with pytest.raises(docker.errors.APIError, match="could not select device driver"):
                op.execute(context={})
        inspected = engine.api.inspect_container(name)
        requests = inspected["HostConfig"]["DeviceRequests"]
        assert len(requests) == 1
        assert requests[0]["DeviceIDs"] == ["nvidia-uuid-0", "nvidia-uuid-2"]
        assert requests[0]["Capabilities"] == [["gpu"]]
        assert "CUDA_VISIBLE_DEVICES=nvidia-uuid-0,nvidia-uuid-2" in inspected["Config"]["Env"]
        assert not inspected["HostConfig"].get("Devices")
    finally:
        engine.api.remove_container(name, force=True)


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
