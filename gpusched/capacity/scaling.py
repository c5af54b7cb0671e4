"""Pre-scaling: turn a demand forecast into a plan, and apply it through a scaler provider.

:func:`plan_prescale` (pure, in :mod:`gpusched.capacity.prescale`, re-exported here) says which standby
nodes to activate *now* so that they are ready before the predicted demand arrives, and how
many GPUs to hold back for the burst partition.

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
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpusched.capacity.prescale import (
    ReactiveScaleOut,
    ScaleStep,
    ScalingPlan,
    WaitingTask,
    activate_in_snapshot,
    plan_prescale,
    standby_for_waiting,
)
from gpusched.errors import ConfigurationError, ScalingError
from gpusched.hardware.standby import read_state, write_state
from gpusched.hardware.standby import state_file as standby_state_file

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
    "react_to_waiting",
    "scaler_from_spec",
]

REACTIVE_SCALE_OUT = "scale_out_reactive"
"""Ledger event kind of a reactive activation (subject: the node; detail: the reason)."""


@dataclass(frozen=True, slots=True)
class ScalingResult:
    """What a provider did with a plan."""

    provider: str
    applied: bool
    activated: tuple[str, ...]
    burst_reserve_gpus: int
    detail: str


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
    (default ``state_dir()/scaling.json``, :mod:`gpusched.hardware.standby`) that every process can
    read; the simulated backend powers the activated nodes on from it.
    """

    name = "local"

    def __init__(self, state_file: str | Path | None = None) -> None:
        self.state_file = Path(state_file) if state_file else standby_state_file()

    def state(self) -> dict[str, Any]:
        """The persisted state (``{"active_standby": [], "burst_reserve_gpus": 0}`` when none)."""
        return read_state(self.state_file)

    def apply(self, plan: ScalingPlan) -> ScalingResult:
        """Add ``plan.activate`` to the active standby nodes and set the burst reserve."""
        state = self.state()
        active = list(dict.fromkeys([*state.get("active_standby", []), *plan.activate]))
        state.update(active_standby=active, burst_reserve_gpus=plan.burst_reserve_gpus,
                     last_plan=plan.to_dict(), applied_at=time.time())
        write_state(self.state_file, state)
        return ScalingResult(self.name, True, plan.activate, plan.burst_reserve_gpus,
                             f"{len(active)} standby node(s) active; state in {self.state_file}")

    def deactivate(self, names: Sequence[str]) -> None:
        """Return nodes to standby (scale-in)."""
        state = self.state()
        state["active_standby"] = [n for n in state.get("active_standby", []) if n not in set(names)]
        write_state(self.state_file, state)


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


def react_to_waiting(
    ledger: Any, *, threshold_s: float, scaler: Scaler | None = None, now: float | None = None
) -> ReactiveScaleOut:
    """Switch on the standby nodes that tasks waiting longer than ``threshold_s`` need.

    Reads the ledger's queue (multi-node gang members with their membership) and fleet, applies
    :func:`gpusched.capacity.prescale.standby_for_waiting` through ``scaler`` (default
    ``$GPUSCHED_SCALER``) and records one ``scale_out_reactive`` event per node with the reason.
    The burst reserve of the last forecast plan is kept.
    """
    at = time.time() if now is None else now
    waiting = [WaitingTask(q.key, q.request, q.since, getattr(q, "gang", None)) for q in ledger.queue()]
    if not waiting:
        return ReactiveScaleOut((), ())
    decision = standby_for_waiting(waiting, ledger.snapshot(at), now=at, threshold_s=threshold_s)
    if not decision.activate:
        return decision
    scaler = scaler or scaler_from_spec()
    state = scaler.state() if isinstance(scaler, LocalFleetScaler) else {}
    reason = "; ".join(decision.reasons)
    plan = ScalingPlan(
        created_at=at, provisioning_delay_s=0, active_gpus=0, target_gpus=0,
        activate=decision.activate, surplus_gpus=0,
        burst_reserve_gpus=int(state.get("burst_reserve_gpus") or 0), steps=(), model="reactive",
        reason=f"reactive scale-out: {reason}",
    )
    result = scaler.apply(plan)
    for name in decision.activate:
        ledger.record_event(REACTIVE_SCALE_OUT, name, now=at, reason=reason, provider=result.provider,
                            applied=result.applied, detail=result.detail)
    return decision
