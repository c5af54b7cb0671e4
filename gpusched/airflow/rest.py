"""A small client of Airflow's public REST API (``/api/v2``) for the fault chain.

Used where Airflow's ORM is off limits (task code in Airflow 3) or another process must act:
clearing a failed task instance so it runs again (the fault-recovery DAG) and marking a running
one failed (stopping a task from outside its host). Standard library only.

Configuration (first found wins):

- base URL: ``GPUSCHED_AIRFLOW_API_URL``; else the running instance's own configuration: ``[api]
  base_url`` when it is absolute; else ``[core] execution_api_server_url`` without its
  ``/execution/`` path; else ``http://<[api] host>:<[api] port>`` (``0.0.0.0`` read as loopback).
  No address is ever guessed: without Airflow configuration the client refuses to start, so
  credentials only go where configuration says the API server is.
- credentials: ``GPUSCHED_AIRFLOW_API_USER`` + ``GPUSCHED_AIRFLOW_API_PASSWORD``; else the first
  user of the simple auth manager's generated passwords file (``airflow standalone``). A JWT is
  fetched from ``POST /auth/token`` and sent as a Bearer token.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from gpusched.errors import ConfigurationError

__all__ = ["AirflowApi", "base_url_from_config"]


def _default_base_url() -> str:
    env = os.environ.get("GPUSCHED_AIRFLOW_API_URL", "").strip()
    if env:
        return env
    try:
        from airflow.configuration import conf
    except Exception as exc:
        raise ConfigurationError(
            f"no Airflow API address: Airflow's configuration cannot be read ({exc}); "
            "set GPUSCHED_AIRFLOW_API_URL"
        ) from exc
    return base_url_from_config(conf)


def base_url_from_config(conf: Any) -> str:
    """The API server's base URL as Airflow configuration ``conf`` names it (see module docs)."""
    base = str(conf.get("api", "base_url", fallback="") or "").strip()
    if base.startswith(("http://", "https://")):
        return base.rstrip("/")
    execution = str(conf.get("core", "execution_api_server_url", fallback="") or "").strip()
    if execution.startswith(("http://", "https://")):
        trimmed = execution.rstrip("/")
        return trimmed[: -len("/execution")] if trimmed.endswith("/execution") else trimmed
    host = str(conf.get("api", "host", fallback="") or "").strip()
    port = str(conf.get("api", "port", fallback="") or "").strip()
    if not port:
        raise ConfigurationError(
            "no Airflow API address in the configuration ([api] base_url, [core] "
            "execution_api_server_url and [api] port are unset); set GPUSCHED_AIRFLOW_API_URL"
        )
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}{base if base.startswith('/') else ''}".rstrip("/")


def _default_credentials() -> tuple[str, str] | None:
    user = os.environ.get("GPUSCHED_AIRFLOW_API_USER")
    password = os.environ.get("GPUSCHED_AIRFLOW_API_PASSWORD")
    if user and password:
        return user, password
    home = Path(os.environ.get("AIRFLOW_HOME") or Path.home() / "airflow")
    generated = home / "simple_auth_manager_passwords.json.generated"
    try:
        users = json.loads(generated.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(users, dict) and users:
        name, secret = next(iter(users.items()))
        return str(name), str(secret)
    return None


class AirflowApi:
    """Calls to Airflow's REST API with a Bearer token (fetched lazily, refreshed on 401)."""

    def __init__(self, base_url: str | None = None, credentials: tuple[str, str] | None = None,
                 timeout_s: float = 10.0) -> None:
        self.base_url = (base_url or _default_base_url()).rstrip("/")
        self.credentials = credentials if credentials is not None else _default_credentials()
        self.timeout_s = timeout_s
        self._token: str | None = None

    def _send(self, method: str, path: str, body: Any, token: str | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            text = response.read().decode() or "null"
        return json.loads(text)

    def _login(self) -> str | None:
        if self.credentials is None:
            return None
        user, password = self.credentials
        answer = self._send("POST", "/auth/token", {"username": user, "password": password}, None)
        return str(answer["access_token"])

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One JSON call; raises ConfigurationError naming the URL and status on failure."""
        try:
            if self._token is None:
                self._token = self._login()
            try:
                return self._send(method, path, body, self._token)
            except urllib.error.HTTPError as exc:
                if exc.code != 401 or self.credentials is None:
                    raise
                self._token = self._login()
                return self._send(method, path, body, self._token)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise ConfigurationError(
                f"Airflow API {method} {self.base_url}{path} answered {exc.code}: {detail}; check "
                "GPUSCHED_AIRFLOW_API_URL and GPUSCHED_AIRFLOW_API_USER/PASSWORD"
            ) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ConfigurationError(
                f"Airflow API at {self.base_url} is unreachable ({exc}); set GPUSCHED_AIRFLOW_API_URL"
            ) from exc

    def clear_task(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> Any:
        """Clear one failed task instance so the scheduler runs it again (a new try)."""
        target: Any = [task_id, map_index] if map_index >= 0 else task_id
        return self.call("POST", f"/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}/clearTaskInstances", {
            "dry_run": False, "dag_run_id": run_id, "task_ids": [target], "only_failed": True,
            "reset_dag_runs": True,
        })

    def mark_failed(self, dag_id: str, run_id: str, task_id: str, note: str | None = None) -> Any:
        """Set a (running) task instance to failed; Airflow then terminates its process."""
        quote = urllib.parse.quote
        path = (f"/api/v2/dags/{quote(dag_id, safe='')}/dagRuns/{quote(run_id, safe='')}"
                f"/taskInstances/{quote(task_id, safe='')}")
        body: dict[str, Any] = {"new_state": "failed"}
        if note:
            body["note"] = note[:1000]
        return self.call("PATCH", path, body)
