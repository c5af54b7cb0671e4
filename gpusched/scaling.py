"""Pre-scaling: turn a demand forecast into a plan, and apply it through a scaler provider.

:func:`plan_prescale` is pure: given the forecast, the active capacity, the provisioning delay
and the standby nodes, it says which standby nodes to activate *now* so that they are ready
before the predicted demand arrives, and how many GPUs to hold back for the burst partition.

Providers implement :class:`Scaler` (``apply(plan) -> ScalingResult``):

* :class:`LocalFleetScaler` — the simulated / on-premises fleet: records the activated standby
  nodes and the burst reserve in ``state_dir()/scaling.json`` (read by the agent and the UI;
  :func:`activate_in_snapshot` applies it to a fleet snapshot);
* :class:`CommandScaler` — runs a configured command with the plan as JSON on stdin;
* :class:`WebhookScaler` — POSTs the plan as JSON to a URL (urllib, no extra dependency).

:func:`scaler_from_spec` builds one from ``GPUSCHED_SCALER`` (``local``, ``command:<cmd>``,
``webhook:<url>``).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpusched.errors import ConfigurationError, ScalingError
from gpusched.forecast import Forecast
from gpusched.model import FleetSnapshot, Node
from gpusched.paths import state_dir

__all__ = [
    "CommandScaler",
    "LocalFleetScaler",
    "ScaleStep",
    "Scaler",
    "ScalingPlan",
    "ScalingResult",
    "WebhookScaler",
    "activate_in_snapshot",
    "plan_prescale",
    "scaler_from_spec",
]


@dataclass(frozen=True, slots=True)
class ScaleStep:
    """Capacity wanted for one forecast step: ready by ``at``, so requested by ``request_by``."""

    at: float
    request_by: float
    demand_gpus: float
    target_gpus: int


@dataclass(frozen=True, slots=True)
class ScalingPlan:
    """What to do now so capacity meets the forecast.

    Attributes:
        created_at: when the plan was made (epoch seconds or simulation clock).
        provisioning_delay_s: how long a standby node takes to become usable.
        active_gpus: capacity active (or already being provisioned) when planning.
        target_gpus: capacity wanted by ``created_at + provisioning_delay_s + lookahead``.
        activate: standby node names to activate now (empty = nothing to do).
        surplus_gpus: active capacity the forecast does not need in the window (scale-in hint).
        burst_reserve_gpus: GPUs to keep free for the burst partition.
        steps: the per-step targets the plan was derived from.
        model: the forecasting model behind it.
        reason: one human-readable line.
    """

    created_at: float
    provisioning_delay_s: int
    active_gpus: int
    target_gpus: int
    activate: tuple[str, ...]
    surplus_gpus: int
    burst_reserve_gpus: int
    steps: tuple[ScaleStep, ...]
    model: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (what command and webhook scalers receive)."""
        data = asdict(self)
        data["activate"] = list(self.activate)
        data["steps"] = [asdict(s) for s in self.steps]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScalingPlan:
        """Inverse of :meth:`to_dict`."""
        return cls(
            created_at=float(data["created_at"]),
            provisioning_delay_s=int(data["provisioning_delay_s"]),
            active_gpus=int(data["active_gpus"]), target_gpus=int(data["target_gpus"]),
            activate=tuple(str(n) for n in data["activate"]), surplus_gpus=int(data["surplus_gpus"]),
            burst_reserve_gpus=int(data["burst_reserve_gpus"]),
            steps=tuple(ScaleStep(**s) for s in data["steps"]),
            model=str(data["model"]), reason=str(data["reason"]),
        )


@dataclass(frozen=True, slots=True)
class ScalingResult:
    """What a provider did with a plan."""

    provider: str
    applied: bool
    activated: tuple[str, ...]
    burst_reserve_gpus: int
    detail: str


def plan_prescale(
    forecast: Forecast,
    capacity: int,
    provisioning_delay_s: int,
    *,
    now: float,
    standby: Sequence[Node] = (),
    burst_forecast: Forecast | None = None,
    headroom: float = 0.1,
    use_upper: bool = True,
    lookahead_s: int = 3600,
    max_burst_fraction: float = 0.2,
) -> ScalingPlan:
    """Pure: the standby nodes to activate now and the burst reserve, from a forecast.

    Capacity requested now is usable at ``now + provisioning_delay_s``; it must cover the peak
    of the forecast (upper interval bound when ``use_upper``, times ``1 + headroom``) over every
    step that overlaps ``[now, now + provisioning_delay_s + lookahead_s)``. Standby nodes are
    taken largest first, smallest last so the overshoot stays small. The burst reserve is the
    peak of ``burst_forecast`` (upper bound) in the same window, or the forecast's uncertainty
    band (upper − mean) without one, capped at ``max_burst_fraction`` of the target.
    """
    if capacity < 0 or provisioning_delay_s < 0:
        raise ScalingError("capacity and provisioning_delay_s must be ≥ 0; check the scaler settings")
    horizon_end = now + provisioning_delay_s + lookahead_s
    series = forecast.upper if use_upper else forecast.mean
    steps: list[ScaleStep] = []
    band = 0.0
    for i, at in enumerate(forecast.timestamps()):
        if at + forecast.step_s <= now or at >= horizon_end:
            continue
        demand = series[i]
        steps.append(ScaleStep(at, at - provisioning_delay_s, demand,
                               math.ceil(demand * (1 + headroom) - 1e-9)))
        band = max(band, forecast.upper[i] - forecast.mean[i])
    target = max((s.target_gpus for s in steps), default=capacity)
    burst = band
    if burst_forecast is not None:
        burst = max(
            (burst_forecast.upper[i] for i, at in enumerate(burst_forecast.timestamps())
             if at + burst_forecast.step_s > now and at < horizon_end),
            default=0.0,
        )
    burst_reserve = min(math.ceil(burst - 1e-9), math.floor(max_burst_fraction * max(target, capacity)))
    target = max(target, 0)
    activate: list[str] = []
    missing = target - capacity
    if missing > 0:
        pool = sorted(standby, key=lambda n: (-len(n.devices), n.name))
        chosen: list[Node] = []
        for node in pool:
            if missing <= 0:
                break
            chosen.append(node)
            missing -= len(node.devices)
        # Swap the last pick for the smallest node that still covers what it covered.
        if chosen:
            covered_before = missing + len(chosen[-1].devices)
            fits = [n for n in pool if n not in chosen[:-1] and len(n.devices) >= covered_before]
            if fits:
                chosen[-1] = min(fits, key=lambda n: (len(n.devices), n.name))
                missing = covered_before - len(chosen[-1].devices)
        activate = [n.name for n in chosen]
    added = sum(len(n.devices) for n in standby if n.name in activate)
    if activate:
        reason = (f"forecast peak {target} GPUs (with {headroom:.0%} headroom) by "
                  f"+{provisioning_delay_s}s exceeds active {capacity}: activate {len(activate)} "
                  f"standby node(s) (+{added} GPUs)")
        if missing > 0:
            reason += f"; still {missing} GPUs short — no standby capacity left"
    else:
        reason = f"active {capacity} GPUs cover the forecast peak {target}"
    return ScalingPlan(
        created_at=now, provisioning_delay_s=provisioning_delay_s, active_gpus=capacity,
        target_gpus=target, activate=tuple(activate), surplus_gpus=max(0, capacity - target),
        burst_reserve_gpus=max(0, burst_reserve), steps=tuple(steps), model=forecast.model,
        reason=reason,
    )


@runtime_checkable
class Scaler(Protocol):
    """A provider that carries out a :class:`ScalingPlan`."""

    name: str

    def apply(self, plan: ScalingPlan) -> ScalingResult:
        """Apply the plan; raises :class:`~gpusched.errors.ScalingError` when it cannot."""
        ...


class LocalFleetScaler:
    """Activates standby nodes of the local (simulated or on-premises) fleet.

    The state — activated nodes, burst reserve, the last plan — is kept in a JSON file
    (default ``state_dir()/scaling.json``) that every process can read.
    """

    name = "local"

    def __init__(self, state_file: str | Path | None = None) -> None:
        self.state_file = Path(state_file) if state_file else state_dir() / "scaling.json"

    def state(self) -> dict[str, Any]:
        """The persisted state (``{"active_standby": [], "burst_reserve_gpus": 0}`` when none)."""
        try:
            data = json.loads(self.state_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"active_standby": [], "burst_reserve_gpus": 0, "last_plan": None}
        except (OSError, ValueError) as exc:
            raise ScalingError(
                f"cannot read scaling state {self.state_file}: {exc}; delete it to reset"
            ) from exc
        return dict(data)

    def apply(self, plan: ScalingPlan) -> ScalingResult:
        """Add ``plan.activate`` to the active standby nodes and set the burst reserve."""
        state = self.state()
        active = list(dict.fromkeys([*state.get("active_standby", []), *plan.activate]))
        state.update(active_standby=active, burst_reserve_gpus=plan.burst_reserve_gpus,
                     last_plan=plan.to_dict(), applied_at=time.time())
        try:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=2), encoding="utf-8")
            os.replace(tmp, self.state_file)
        except OSError as exc:
            raise ScalingError(f"cannot write scaling state {self.state_file}: {exc}; "
                               "check that AIRFLOW_HOME is writable") from exc
        return ScalingResult(self.name, True, plan.activate, plan.burst_reserve_gpus,
                             f"{len(active)} standby node(s) active; state in {self.state_file}")

    def deactivate(self, names: Sequence[str]) -> None:
        """Return nodes to standby (scale-in)."""
        state = self.state()
        state["active_standby"] = [n for n in state.get("active_standby", []) if n not in set(names)]
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(state, indent=2), encoding="utf-8")


def activate_in_snapshot(snapshot: FleetSnapshot, names: Sequence[str]) -> FleetSnapshot:
    """Pure: the snapshot with the named standby nodes switched to active."""
    wanted = set(names)
    changed = [replace(n, standby=False) for n in snapshot.nodes if n.name in wanted and n.standby]
    return snapshot.with_nodes(changed) if changed else snapshot


class CommandScaler:
    """Runs ``argv`` with the plan as JSON on stdin; a non-zero exit is a ScalingError."""

    name = "command"

    def __init__(self, argv: Sequence[str], *, timeout_s: float = 60.0) -> None:
        if not argv:
            raise ConfigurationError("CommandScaler needs a command, e.g. command:/usr/local/bin/scale-up")
        self.argv = list(argv)
        self.timeout_s = timeout_s

    def apply(self, plan: ScalingPlan) -> ScalingResult:
        """Run the command; its stdout (trimmed) becomes the result's detail."""
        try:
            done = subprocess.run(
                self.argv, input=json.dumps(plan.to_dict()), capture_output=True, text=True,
                timeout=self.timeout_s, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ScalingError(f"scaler command {self.argv[0]} failed to run: {exc}; "
                               "check GPUSCHED_SCALER") from exc
        if done.returncode != 0:
            raise ScalingError(
                f"scaler command {shlex.join(self.argv)} exited {done.returncode}: "
                f"{done.stderr.strip()[-500:]}; fix the command or its credentials"
            )
        return ScalingResult(self.name, True, plan.activate, plan.burst_reserve_gpus,
                             done.stdout.strip()[-500:])


class WebhookScaler:
    """POSTs the plan as JSON to ``url``; any non-2xx answer is a ScalingError."""

    name = "webhook"

    def __init__(
        self, url: str, *, timeout_s: float = 10.0, headers: Mapping[str, str] | None = None
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigurationError(f"webhook scaler URL {url!r} must start with http:// or https://")
        self.url = url
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def apply(self, plan: ScalingPlan) -> ScalingResult:
        """POST the plan; the response body (trimmed) becomes the result's detail."""
        body = json.dumps(plan.to_dict()).encode("utf-8")
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8", "replace")
                status = response.status
        except urllib.error.HTTPError as exc:
            raise ScalingError(f"scaler webhook {self.url} answered HTTP {exc.code}: {exc.reason}; "
                               "check the endpoint and its credentials") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ScalingError(f"scaler webhook {self.url} unreachable: {exc}; check the URL") from exc
        return ScalingResult(self.name, 200 <= status < 300, plan.activate, plan.burst_reserve_gpus,
                             text.strip()[-500:])


def scaler_from_spec(spec: str | None = None) -> Scaler:
    """A scaler from ``spec`` or ``$GPUSCHED_SCALER``: ``local`` (default), ``command:<cmd>``,
    ``webhook:<url>``."""
    text = (spec if spec is not None else os.environ.get("GPUSCHED_SCALER", "local")).strip()
    if text in ("", "local"):
        return LocalFleetScaler()
    kind, _, rest = text.partition(":")
    if kind == "command" and rest:
        return CommandScaler(shlex.split(rest))
    if kind == "webhook" and rest:
        return WebhookScaler(rest)
    raise ConfigurationError(
        f"GPUSCHED_SCALER={text!r} is not understood; use local, command:<command line> or webhook:<url>"
    )
