"""The gpusched FastAPI app, mounted by the Airflow api-server at ``/gpusched``.

Every route requires an authenticated Airflow user (``requires_authenticated`` from
``airflow.api_fastapi.core_api.security``): a ``Authorization: Bearer <JWT>`` header from
``POST /auth/token``, or the ``_token`` cookie the Airflow UI sets — which is how the page at
``/gpusched/ui``, shown in the UI navigation as an external view (an iframe on the same origin),
authenticates its own ``fetch`` calls. Without either: 401.

JSON routes (all read-only): ``/fleet``, ``/allocations``, ``/queue``, ``/quotas``,
``/forecast``, ``/events``, ``/preemptions`` (preemptions and moves). The page: ``/ui``, served with a
Content-Security-Policy (its own script only, framed only by the same origin) and the usual
hardening headers. There is no ``/docs``, ``/redoc`` or ``/openapi.json``: the routes are
documented here and in docs/airflow.md, and nothing is served without authentication except
the redirect from ``/`` to ``/ui``. Data comes from the ledger (``$GPUSCHED_DB_URL`` or the
SQLite ledger under ``$AIRFLOW_HOME/gpusched``); the JSON is built
by the pure functions of :mod:`gpusched.airflow.api_views`.

Optional inputs: the quota policy (:mod:`gpusched.quota.file`), and the forecast from
the newest ledger event of kind ``forecast`` (detail = ``Forecast.to_dict()``) or
``$GPUSCHED_FORECAST_FILE`` / ``state_dir()/forecast.json``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpusched.airflow import api_views
from gpusched.airflow.ui_page import render_page, security_headers
from gpusched.paths import state_dir
from gpusched.quota.file import load_quota_policy, quota_file

if TYPE_CHECKING:
    from fastapi import FastAPI

    from gpusched.ledger import Ledger  # at run time only in LazyApp.get (plugin load stays light)

__all__ = ["URL_PREFIX", "LazyApp", "create_app", "load_forecast", "load_quota_policy"]

URL_PREFIX = "/gpusched"
"""Where the Airflow api-server mounts the app (see plugins/gpusched_plugin.py)."""

SAMPLE_WINDOW_S = 300
"""Telemetry older than this is not shown on the fleet page."""


def load_forecast(ledger: Ledger) -> dict[str, Any]:
    """The newest demand forecast, or ``{"available": False, "note": …}`` when there is none.

    When the forecast DAG's newest run was skipped for lack of history, the note gives its reason.
    """
    events = ledger.events(1, kinds=["forecast", "forecast_skipped"])
    if events and events[0].kind == "forecast_skipped":
        return {"available": False, "at": events[0].at,
                "note": f"no forecast yet: {events[0].detail.get('reason', 'the last run was skipped')}"}
    if events and events[0].detail.get("mean") is not None:
        return {"available": True, "at": events[0].at, "origin": "ledger", "forecast": dict(events[0].detail)}
    path = Path(os.environ.get("GPUSCHED_FORECAST_FILE") or state_dir() / "forecast.json")
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return {"available": False, "note": f"forecast file {path} is unreadable: {exc}"}
        return {"available": True, "at": path.stat().st_mtime, "origin": str(path), "forecast": data}
    return {
        "available": False,
        "note": "no forecast yet: the demand-forecast DAG has not run (it records one in the ledger)",
    }


class _LedgerHolder:
    """One Ledger per api-server process, created (and migrated) on first use."""

    def __init__(self, url: str | None) -> None:
        self._url = url
        self._ledger: Ledger | None = None
        self._lock = threading.Lock()

    def get(self) -> Ledger:
        with self._lock:
            if self._ledger is None:
                from gpusched.ledger import Ledger  # local: the ledger's SQL tables, on the first request

                ledger = Ledger(self._url)
                ledger.migrate()
                self._ledger = ledger
            return self._ledger

    def close(self) -> None:
        with self._lock:
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None


def create_app(ledger_url: str | None = None) -> FastAPI:
    """Build the app. ``ledger_url`` None: ``$GPUSCHED_DB_URL`` or the default SQLite ledger."""
    from airflow.api_fastapi.core_api.security import requires_authenticated
    from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
    from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

    holder = _LedgerHolder(ledger_url)
    app = FastAPI(
        title="gpusched",
        description="GPU fleet, allocations, queue, quotas and forecast (read-only).",
        version="1",
        # No unauthenticated schema or docs pages (and nothing to render for them).
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.ledger_holder = holder
    router = APIRouter(dependencies=[Depends(requires_authenticated())])

    @router.get("/fleet")
    def fleet() -> dict[str, Any]:
        """Racks → nodes → islands → devices with state, usage, holders and telemetry."""
        ledger = holder.get()
        now = time.time()
        snapshot = ledger.snapshot(now)
        return api_views.fleet_view(snapshot, ledger.active(), ledger.samples(None, now - SAMPLE_WINDOW_S))

    @router.get("/allocations")
    def allocations() -> list[dict[str, Any]]:
        """Active allocations with request summary, age and lease time left."""
        return api_views.allocations_view(holder.get().active(), time.time())

    @router.get("/queue")
    def queue() -> list[dict[str, Any]]:
        """Tasks waiting for devices, each with the placement's reason."""
        return api_views.queue_view(holder.get().queue(), time.time())

    @router.get("/quotas")
    def quotas() -> dict[str, Any]:
        """Partition shares and use (70/20/10 by default) and tenant budgets this period."""
        ledger = holder.get()
        now = time.time()
        policy = load_quota_policy()
        start = api_views.period_start(now, policy.period_s)
        snapshot = ledger.snapshot(now)
        usage = api_views.tenant_usage(ledger.history(start, now), snapshot, start, now)
        view = api_views.quotas_view(snapshot, ledger.active(), ledger.queue(), policy, usage, start)
        # Placement applies them only when a quota file is configured (else: unlimited).
        view["enforced"] = quota_file().is_file()
        return view

    @router.get("/forecast")
    def forecast() -> dict[str, Any]:
        """The latest demand forecast, or an explanation why there is none."""
        return load_forecast(holder.get())

    @router.get("/events")
    def events(limit: int = 50) -> list[dict[str, Any]]:
        """Recent ledger events (allocations, releases, cordons, health), newest first."""
        rows = holder.get().events(max(1, min(limit, 500)))
        return [{"id": e.id, "at": e.at, "kind": e.kind, "subject": e.subject, "detail": dict(e.detail)}
                for e in rows]

    @router.get("/preemptions")
    def preemptions(limit: int = 20) -> list[dict[str, Any]]:
        """Recent preemptions (victim, for whom, work lost, why) and moves between GPU types
        (``preemption = migrate``: from model/devices -> to), newest first."""
        rows = holder.get().events(max(1, min(limit, 200)), kinds=["preempted", "migrated"])
        return api_views.preemptions_view(rows)

    @router.get("/unschedulable")
    def unschedulable(limit: int = 20) -> list[dict[str, Any]]:
        """Recent tries failed without starting (can never fit this fleet, invalid request,
        refused retry), newest first, each with the executor's reason."""
        rows = holder.get().events(max(1, min(limit, 200)), kinds=["unschedulable"])
        return api_views.unschedulable_view(rows)

    @router.get("/ui", response_class=HTMLResponse)
    def ui() -> HTMLResponse:
        """The fleet page (shown inside the Airflow UI as the "GPU fleet" view)."""
        page = render_page()
        return HTMLResponse(page, headers=security_headers(page))

    app.include_router(router)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse(url="ui")

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        # A person opening the page without a session gets a way to sign in, not raw JSON.
        if exc.status_code == 401 and request.url.path.rstrip("/").endswith("/ui"):
            page = ('<p>Not signed in to Airflow. <a href="/" target="_top">Sign in</a>, then open '
                    "<em>Browse → GPU fleet</em>.</p>")
            return HTMLResponse(page, status_code=401, headers=security_headers(page))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.middleware("http")
    async def _no_sniff(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response

    return app


class LazyApp:
    """An ASGI app that builds :func:`create_app` on its first request.

    The plugin module is imported by every Airflow process (scheduler, workers, dag processor);
    only the api-server serves requests, so only it pays for FastAPI and the ledger.
    """

    def __init__(self, ledger_url: str | None = None) -> None:
        self._ledger_url = ledger_url
        self._app: Any = None
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._app is None:
                self._app = create_app(self._ledger_url)
            return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._get()(scope, receive, send)
