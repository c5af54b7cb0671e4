"""Hourly capacity forecast: demand history → validation → model choice → forecast → pre-scaling.

Tasks
1. ``load_history`` — hourly GPU demand: from the allocation ledger (default: GPUs allocated plus
   GPUs that waited for devices, queued and not yet placed, so unmet demand is forecast too), a Philly trace
   (``GPUSCHED_DEMAND_SOURCE=trace:<path to philly_jobs.csv>``) or a synthetic series
   (``synthetic``, for demos and tests). The fleet capacity comes from the ledger's snapshot
   (``GPUSCHED_FORECAST_CAPACITY`` overrides it).
2. ``validate`` — the great-expectations suite ``gpusched/include/expectations/demand_history.json``
   (non-null, strictly increasing hourly timestamps, no gaps, 0 ≤ demand ≤ capacity). A failure
   fails the task naming each failed expectation. Here and in the next two tasks a
   ``ForecastError`` fails the task at once, without the retry (the same input fails again).
3. ``select_model`` — rolling-origin backtest of seasonal-naive, ETS and SARIMAX (MASE);
   ``GPUSCHED_FORECAST_MODELS`` (comma-separated) and ``GPUSCHED_FORECAST_ORIGINS`` narrow it.
   History counts from the first non-zero demand; with less than 96 h of it (a new fleet, an
   empty ledger) the task is *skipped* with the reason, records a ``forecast_skipped`` ledger
   event the fleet page shows, and ``forecast``/``prescale`` are skipped: the run succeeds.
4. ``forecast`` — refit the chosen model, forecast 24 h with a 90 % interval, write
   ``$AIRFLOW_HOME/gpusched/forecast/latest.json``, the UI's ``$AIRFLOW_HOME/gpusched/forecast.json``,
   a ``forecast`` event in the ledger and, with the ``lab`` extra (matplotlib), the picture
   ``forecast-<stamp>.png`` (without it the task logs why and writes ``"plot": null``).
5. ``prescale`` — :func:`gpusched.capacity.scaling.plan_prescale` with the provisioning delay
   (``GPUSCHED_PROVISIONING_DELAY_S``, default 900) applied through ``GPUSCHED_SCALER``
   (``local`` | ``command:<cmd>`` | ``webhook:<url>``) and, for the ledger source, recorded in the
   ledger (a ``prescale_plan`` event): the agent's scale-in keeps its burst reserve and target.

Top-level imports are only ``airflow.sdk`` and the standard library; the work happens in tasks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import dag, task

HISTORY_DAYS = 28


def _series(history: dict[str, Any]) -> Any:
    from gpusched.capacity.forecast import DemandSeries

    return DemandSeries(history["start"], history["step_s"], tuple(history["values"]), history["capacity"])


def _source() -> str:
    return os.environ.get("GPUSCHED_DEMAND_SOURCE", "ledger").strip()


@contextmanager
def _fail_without_retry() -> Iterator[None]:
    """Turn a :class:`~gpusched.errors.ForecastError` into ``AirflowFailException``.

    A ForecastError is a property of the history or of the settings (failed expectations, an
    unknown model in ``GPUSCHED_FORECAST_MODELS``, a fit that cannot converge on this series):
    the retry would read the same input and fail the same way, five minutes later.
    """
    from airflow.sdk.exceptions import AirflowFailException

    from gpusched.errors import ForecastError

    try:
        yield
    except ForecastError as exc:
        raise AirflowFailException(str(exc)) from exc


@dag(
    dag_id="gpusched_capacity_forecast",
    schedule="@hourly",
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=5)},
    tags=["gpusched", "forecast"],
    doc_md=__doc__,
)
def gpusched_capacity_forecast() -> None:
    @task
    def load_history() -> dict[str, Any]:
        import time

        from gpusched.capacity.forecast import demand_from_history, load_philly_demand, synthetic_demand

        source = _source()
        override = os.environ.get("GPUSCHED_FORECAST_CAPACITY")
        standby: list[dict[str, Any]] = []
        if source == "synthetic":
            series = synthetic_demand(24 * 14)
            now = series.start + len(series) * series.step_s
            capacity = float(override or series.capacity or 128)
            active = int(capacity * 0.75)
        elif source.startswith("trace:"):
            series = load_philly_demand(source.split(":", 1)[1])
            now = series.start + len(series) * series.step_s
            capacity = float(override or max(series.values) * 1.25)
            active = int(capacity)
        else:
            from gpusched.ledger import Ledger

            ledger = Ledger()
            ledger.migrate()
            now = float(int(time.time()) // 3600 * 3600)
            rows = ledger.demand_history(now - HISTORY_DAYS * 86400, now, 3600)
            waited = ledger.waiting_history(now - HISTORY_DAYS * 86400, now, 3600)
            snapshot = ledger.snapshot(now)
            capacity = float(override or snapshot.total_devices())
            series = demand_from_history(rows, capacity=capacity, waiting=waited)
            active = sum(len(n.devices) for n in snapshot.nodes if not n.standby)
            standby = [{"name": n.name, "gpus": len(n.devices)} for n in snapshot.nodes if n.standby]
        return {"source": source, "start": series.start, "step_s": series.step_s,
                "values": list(series.values), "capacity": capacity, "active_gpus": active,
                "standby": standby, "now": now}

    @task
    def validate(history: dict[str, Any]) -> dict[str, Any]:
        from gpusched.capacity.demand_checks import validate_series

        with _fail_without_retry():
            checks = validate_series(_series(history))
        return {"passed": [c.describe() for c in checks]}

    @task
    def select_model(history: dict[str, Any], checks: dict[str, Any]) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowSkipException

        from gpusched.capacity.forecast import MODELS, backtest, history_shortfall, since_first_demand
        from gpusched.ledger import Ledger

        series = _series(history)
        shortfall = history_shortfall(series)
        if shortfall is not None:
            # A fleet too new to forecast is not a failure: say why, skip the rest of the run.
            Ledger().record_event("forecast_skipped", "fleet", reason=shortfall, source=history["source"])
            raise AirflowSkipException(shortfall)
        series = since_first_demand(series)
        origins = int(os.environ.get("GPUSCHED_FORECAST_ORIGINS", "7"))
        models = [m.strip() for m in os.environ.get("GPUSCHED_FORECAST_MODELS", "").split(",") if m.strip()]
        with _fail_without_retry():
            return backtest(series, models or MODELS, origins=origins, spacing=24).to_dict()

    @task
    def forecast(history: dict[str, Any], selection: dict[str, Any]) -> dict[str, Any]:
        import json

        from gpusched.capacity.forecast import fit_forecast, plot_forecast, since_first_demand
        from gpusched.errors import MissingExtraError
        from gpusched.paths import state_dir

        series = since_first_demand(_series(history))
        with _fail_without_retry():
            fc = fit_forecast(series, selection["chosen"], 24, level=0.9)
        out_dir = state_dir() / "forecast"
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = datetime.fromtimestamp(fc.start).strftime("%Y%m%dT%H%M")
        png: str | None = None
        try:
            png = str(plot_forecast(series, fc, out_dir / f"forecast-{stamp}.png"))
        except MissingExtraError as exc:  # the picture is optional: the UI reads the JSON
            print(f"capacity_forecast: no forecast picture: {exc}")
        data = fc.to_dict() | {"backtest": selection, "plot": png, "source": history["source"]}
        for path in (out_dir / "latest.json", state_dir() / "forecast.json"):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
            os.replace(tmp, path)
        if history["source"] == "ledger":
            from gpusched.ledger import Ledger

            Ledger().record_event("forecast", "fleet", **fc.to_dict())
        return data

    @task
    def prescale(history: dict[str, Any], fc: dict[str, Any]) -> dict[str, Any]:
        from gpusched.capacity.forecast import Forecast
        from gpusched.capacity.scaling import plan_prescale, record_plan, scaler_from_spec
        from gpusched.catalog import default_catalog
        from gpusched.model import Device, Node

        model = default_catalog().models[0]
        standby = [
            Node(s["name"], "standby", tuple(
                Device(f"{s['name']}-{i}", i, s["name"], model.name, model.vendor, model.architecture,
                       model.memory_bytes) for i in range(s["gpus"])), standby=True)
            for s in history["standby"]
        ]
        plan = plan_prescale(
            Forecast.from_dict(fc), int(history["active_gpus"]),
            int(os.environ.get("GPUSCHED_PROVISIONING_DELAY_S", "900")), now=float(history["now"]),
            standby=standby,
        )
        result = scaler_from_spec().apply(plan)
        if history["source"] == "ledger":
            from gpusched.ledger import Ledger

            record_plan(Ledger(), plan, result)
        return {"plan": plan.to_dict(), "provider": result.provider, "applied": result.applied,
                "activated": list(result.activated), "detail": result.detail}

    history = load_history()
    checks = validate(history)
    selection = select_model(history, checks)
    fc = forecast(history, selection)
    prescale(history, fc)


capacity_forecast_dag = gpusched_capacity_forecast()
