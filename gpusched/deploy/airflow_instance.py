"""One local Airflow for tests and benchmarks: free ports, waiting for readiness, health and login.

The end-to-end tests (``scripts/run.sh`` → ``airflow standalone``), the API-server test and the
real-Airflow recovery benchmark (:mod:`gpusched.bench.recovery_airflow`) boot Airflow the same
way and share these helpers; the multi-host cluster (:mod:`gpusched.deploy.multihost_cluster`)
takes its ports from here too. Only the standard library: no Airflow import.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpusched.errors import AirflowBootError

__all__ = ["free_port", "login_token", "scheduler_healthy", "wait_until"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(what: str, check: Callable[[], Any], timeout: float, *, proc: subprocess.Popen[bytes],
               log: Path, interval: float = 1.0, tail: int = 6000) -> Any:
    """Poll ``check`` until it returns something truthy and return that.

    An exception from ``check`` counts as "not yet" (Airflow still starting).

    Raises:
        AirflowBootError: ``proc`` exited, or ``timeout`` seconds passed; the message ends with the
            last ``tail`` characters of ``log``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AirflowBootError(
                f"Airflow exited ({proc.returncode}) while waiting for {what}:\n{_tail(log, tail)}")
        try:
            result = check()
        except Exception:  # not up yet
            result = None
        if result:
            return result
        time.sleep(interval)
    raise AirflowBootError(f"timed out after {timeout:.0f} s waiting for {what}:\n{_tail(log, tail)}")


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


def _tail(log: Path, chars: int) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return f"(no log at {log})"
