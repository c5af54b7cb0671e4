"""One local Airflow for tests and benchmarks: free ports, waiting for readiness, health and login.

The end-to-end tests (``scripts/run.sh`` → ``airflow standalone``; :func:`stop_run_sh` stops it,
as the API latency benchmark does too), the API-server test and the real-Airflow recovery
benchmark (:mod:`gpusched.bench.recovery_airflow`) boot Airflow the same way and share these
helpers; the multi-host cluster (:mod:`gpusched.deploy.multihost_cluster`) takes its ports from
here too. No Airflow import (psutil only inside :func:`stop_run_sh`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpusched.errors import AirflowBootError

__all__ = [
    "api_server", "free_port", "http_get", "login_token", "poll_until", "scheduler_healthy", "stop_run_sh",
    "wait_until",
]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def poll_until(
    what: str,
    check: Callable[[], Any],
    *,
    timeout: float,
    abort: Callable[[], str | None] = lambda: None,
    logs: Callable[[], str] = lambda: "",
    interval: float = 1.0,
) -> Any:
    """Poll ``check`` every ``interval`` s until it returns something truthy, and return that.

    An exception from ``check`` counts as "not yet" (a server still starting). Before each try
    ``abort()`` says why waiting is pointless (e.g. ``"Airflow exited (1)"``: a process the check
    depends on died), or returns None to go on.

    Raises:
        AirflowBootError: ``abort`` gave a reason, or ``timeout`` seconds passed; the message names
            ``what`` was awaited and ends with ``logs()`` (the processes' log tails).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reason = abort()
        if reason:
            raise AirflowBootError(f"{reason} while waiting for {what}:\n{logs()}")
        try:
            result = check()
        except Exception:  # not up yet
            result = None
        if result:
            return result
        time.sleep(interval)
    raise AirflowBootError(f"timed out after {timeout:.0f} s waiting for {what}:\n{logs()}")


def wait_until(what: str, check: Callable[[], Any], timeout: float, *, proc: subprocess.Popen[bytes],
               log: Path, interval: float = 1.0, tail: int = 6000) -> Any:
    """:func:`poll_until` for one Airflow process ``proc`` (e.g. ``airflow standalone``) logging to ``log``.

    Raises:
        AirflowBootError: ``proc`` exited, or ``timeout`` seconds passed; the message ends with the
            last ``tail`` characters of ``log``.
    """

    def exited() -> str | None:
        return None if proc.poll() is None else f"Airflow exited ({proc.returncode})"

    return poll_until(what, check, timeout=timeout, abort=exited, logs=lambda: _tail(log, tail),
                      interval=interval)


def scheduler_healthy(url: str) -> bool:
    """Whether Airflow at ``url`` reports its scheduler and DAG processor healthy."""
    with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as response:
        health = json.loads(response.read())
    return all(health[c]["status"] == "healthy" for c in ("scheduler", "dag_processor"))


def login_token(home: Path, url: str) -> str:
    """A JWT for the first user of the simple auth manager's generated passwords ("" if refused)."""
    passwords = json.loads((home / "simple_auth_manager_passwords.json.generated").read_text())
    user, password = next(iter(passwords.items()))
    body = json.dumps({"username": user, "password": password}).encode()
    request = urllib.request.Request(f"{url}/auth/token", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(json.loads(response.read())["access_token"])
    except urllib.error.HTTPError:
        return ""


def http_get(url: str, headers: Mapping[str, str] | None = None, *, timeout: float = 30) -> tuple[int, bytes]:
    """``GET url``: (status, body), also for an error status (4xx/5xx are answers, not exceptions)."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@contextlib.contextmanager
def api_server(airflow: Sequence[str], *, port: int, env: Mapping[str, str], log: Path,
               cwd: Path | None = None, timeout: float = 180) -> Iterator[str]:
    """Run ``airflow api-server --port PORT`` (``airflow`` = the command that runs Airflow, e.g.
    ``[sys.executable, "-m", "airflow"]``) and yield its base URL once ``/api/v2/version`` answers.

    On exit the whole process group gets SIGINT (SIGTERM would leave its workers running), then
    SIGKILL after 30 s.

    Raises:
        AirflowBootError: the server exited or did not answer within ``timeout`` s (with its log).
    """
    with log.open("wb") as sink:
        proc = subprocess.Popen([*airflow, "api-server", "--port", str(port)], env=dict(env), cwd=cwd,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until("the api-server", lambda: http_get(f"{base}/api/v2/version")[0] in (200, 401), timeout,
                   proc=proc, log=log, tail=3000)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _tail(log: Path, chars: int) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return f"(no log at {log})"


def stop_run_sh(proc: subprocess.Popen[bytes]) -> tuple[int | None, list[int]]:
    """SIGINT to run.sh (it forwards SIGINT to standalone's parent); kill the process groups as a
    fallback. Returns run.sh's exit code (None if it had to be killed) and the pids still alive."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.send_signal(signal.SIGINT)
    try:
        code: int | None = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
        for child in family:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                child.kill()
        proc.kill()
        proc.wait(timeout=30)
    _gone, alive = psutil.wait_procs(family, timeout=10)
    for child in alive:
        child.kill()
    return code, [p.pid for p in alive]
