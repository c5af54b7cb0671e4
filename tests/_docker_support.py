"""Shared by the tests that run containers on a real Docker engine: reach or start the engine,
build the test images offline (nothing is pulled), and start a private engine that hands out
NVIDIA GPUs through a stand-in for the NVIDIA Container Toolkit's hook.

Every helper skips the calling test (``pytest.skip``) with the reason and the fix when the
machine cannot do it (no dockerd, not root, no static busybox)."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BUSYBOX_IMAGE = "gpusched-test-busybox:1"
PYTHON_IMAGE = "gpusched-test-python:1"


def client(base_url: str | None = None) -> Any:
    """A Docker client for ``base_url`` (default: ``$DOCKER_HOST`` or the default socket)."""
    import docker

    if base_url is None:
        return docker.from_env(version="auto", timeout=30)
    return docker.DockerClient(base_url=base_url, version="auto", timeout=30)


def _can_start_dockerd() -> None:
    if shutil.which("dockerd") is None:
        pytest.skip("no Docker engine and dockerd is not installed (apt-get install -y docker.io)")
    if os.geteuid() != 0:
        pytest.skip("no Docker engine running and starting dockerd needs root")


def default_engine() -> Any:
    """The engine at ``$DOCKER_HOST`` or the default socket, started with
    scripts/start_dockerd.sh when none answers."""
    import docker

    try:
        found = client()
        found.ping()
        return found
    except docker.errors.DockerException:
        _can_start_dockerd()
        result = subprocess.run([str(REPO / "scripts" / "start_dockerd.sh")], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, f"dockerd did not start: {result.stderr}"
        return client()


def busybox_image(engine: Any, name: str = BUSYBOX_IMAGE) -> str:
    """A tiny image with busybox (sh, ls, env), imported from a local rootfs tarball."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is needed to build the test image offline (apt-get install -y busybox-static)")
    if engine.images.list(name=name):
        return name
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
    repository, tag = name.split(":")
    engine.api.import_image_from_data(buffer.getvalue(), repository=repository, tag=tag)
    return name


def python_image(engine: Any, name: str = PYTHON_IMAGE) -> str:
    """bash + this machine's Python 3.11 and stdlib (what ``@task.docker`` runs), imported offline."""
    if engine.images.list(name=name):
        return name
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
    repository, tag = name.split(":")
    engine.api.import_image_from_data(buffer.getvalue(), repository=repository, tag=tag)
    return name


# The stand-in for the NVIDIA Container Toolkit's prestart hook. dockerd registers its "nvidia"
# device driver only when `nvidia-container-runtime-hook` is on its PATH at start; the driver
# then turns a device request into NVIDIA_VISIBLE_DEVICES=<ids> in the container's environment
# and runs the hook before the container starts. The real hook mounts those GPUs and the driver
# libraries; this one records which devices it was asked for (the bundle's config.json), one
# JSON line per container, and lets the container start.
HOOK_SOURCE = """#!{python}
import json, os, sys

state = json.load(sys.stdin)
with open(os.path.join(state["bundle"], "config.json")) as config:
    env = json.load(config)["process"]["env"]
asked = [e.partition("=")[2] for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=")]
with open({record!r}, "a") as record:
    record.write(json.dumps({{"container": state["id"], "args": sys.argv[1:],
                             "NVIDIA_VISIBLE_DEVICES": asked[-1] if asked else None}}) + "\\n")
"""


@dataclass
class NvidiaEngine:
    """A private dockerd whose NVIDIA device driver runs the stand-in hook."""

    url: str
    folder: Path
    client: Any
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        """Stop the engine (as a host whose dockerd went away); idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    @property
    def record(self) -> Path:
        return self.folder / "hook.jsonl"

    def hook_calls(self) -> list[dict[str, Any]]:
        """What the hook was asked for, one entry per container that started with GPUs."""
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line.strip()]


def nvidia_engine() -> Iterator[NvidiaEngine]:
    """Start a private dockerd (own socket, data and state folders; no bridge, no iptables) with
    the stand-in hook on its PATH; stop it and remove its folders afterwards. Use as the body of
    a fixture (``yield from``)."""
    _can_start_dockerd()
    folder = Path(tempfile.mkdtemp(prefix="gpusched-nvdocker-"))  # short: a socket path has a limit
    hooks = folder / "bin"
    hooks.mkdir()
    hook = hooks / "nvidia-container-runtime-hook"
    hook.write_text(HOOK_SOURCE.format(python=os.path.realpath(sys.executable),
                                       record=str(folder / "hook.jsonl")))
    hook.chmod(0o755)
    url = f"unix://{folder / 'docker.sock'}"
    env = {**os.environ, "PATH": f"{hooks}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    log = (folder / "dockerd.log").open("wb")
    proc = subprocess.Popen(
        ["dockerd", "--host", url, "--bridge=none", "--iptables=false", "--ip6tables=false",
         "--data-root", str(folder / "data"), "--exec-root", str(folder / "exec"),
         "--pidfile", str(folder / "dockerd.pid")],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        import docker

        found = None
        deadline = time.monotonic() + 60
        while found is None:
            tail = (folder / "dockerd.log").read_text(errors="replace")[-2000:]
            assert proc.poll() is None, f"dockerd exited: {tail}"
            assert time.monotonic() < deadline, f"dockerd did not answer within 60 s: {tail}"
            try:
                candidate = client(url)
                candidate.ping()
                found = candidate
            except docker.errors.DockerException:  # not up yet
                time.sleep(0.5)
        yield NvidiaEngine(url, folder, found, proc)
        found.close()
    finally:
        NvidiaEngine(url, folder, None, proc).stop()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
