"""Pre-scaling: turn a demand forecast into a plan, and apply it through a scaler provider.

:func:`plan_prescale` (pure, in :mod:`gpusched.capacity.prescale`, re-exported here) says which standby
nodes to activate *now* so that they are ready before the predicted demand arrives, and how
many GPUs to hold back for the burst partition.

Providers implement :class:`Scaler` (``apply(plan) -> ScalingResult`` switches standby nodes on,
``release(names, ...) -> ScalingResult`` sends them back to standby):

* :class:`LocalFleetScaler` — the simulated / on-premises fleet: records the activated standby
  nodes and the burst reserve in ``state_dir()/scaling.json`` (read by the agent and the UI;
  :func:`activate_in_snapshot` applies it to a fleet snapshot);
* :class:`CommandScaler` — runs a configured command with the plan (``"action": "activate"``) or
  the nodes to release (``"action": "release"``) as JSON on stdin;
* :class:`WebhookScaler` — POSTs the same JSON to a URL (urllib, no extra dependency).

:func:`scaler_from_spec` builds one from ``GPUSCHED_SCALER`` (``local``, ``command:<cmd>``,
``webhook:<url>``). What the agent's cycle runs: :func:`react_to_waiting` (scale-out for waiting
work) and :func:`release_idle` (scale-in of idle switched-on standby nodes), both deciding with the
shared rules of :mod:`gpusched.capacity.standby_rules` and recording each node they switch in the
ledger's event log (:func:`switched_on` reads it back). :func:`record_plan` records a forecast
plan, so its burst reserve and target reach the scale-in whatever the provider.
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
from dataclasses import dataclass, replace
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
from gpusched.capacity.standby_rules import ScaleIn, SwitchedOn, scale_in
from gpusched.errors import ConfigurationError, ScalingError
from gpusched.hardware.standby import read_state, write_state
from gpusched.hardware.standby import state_file as standby_state_file
from gpusched.placement.feasible import feasible

__all__ = [
    "CommandScaler",
    "LocalFleetScaler",
    "ScaleStep",
    "Scaler",
    "ScalingPlan",
    "ScalingResult",
    "WebhookScaler",
    "activate_in_snapshot",
    "burst_reserve",
    "plan_prescale",
    "provisioning_timeout",
    "react_to_waiting",
    "record_plan",
    "release_idle",
    "scale_in_after",
    "scaler_from_spec",
    "switched_on",
]

REACTIVE_SCALE_OUT = "scale_out_reactive"
"""Ledger event kind of a reactive activation (subject: the node; detail: the reason)."""
SCALE_IN = "scale_in"
"""Ledger event kind of a scale-in (subject: the node sent back to standby; detail: the reason)."""
PRESCALE_PLAN = "prescale_plan"
"""Ledger event kind of a forecast plan applied (subject ``fleet``; detail: the plan and the result)."""
SCALE_OUT_FAILED = "scale_out_failed"
"""Ledger event kind of a reactive activation whose scaler call failed (subject: the node): the
node counts as not switched on, so a later decision may ask again."""
SCALE_IN_FAILED = "scale_in_failed"
"""Ledger event kind of a scale-in whose scaler call failed (subject: the node): it counts as
switched on again, idle from then."""
SCALER_CALL = "scaler_call"
"""Ledger event kind of one scaler call of the standby rules (subject: ``activate`` or
``release``; detail: the nodes, the provider and what it answered)."""
_FAULT_SCALE_OUT = "scale_out_request"
"""The fault chain's scale-out (gpusched.faults.remediation.SCALE_OUT; detail: ``activate``)."""
_SWITCH_KINDS = (REACTIVE_SCALE_OUT, PRESCALE_PLAN, _FAULT_SCALE_OUT, SCALE_IN, SCALE_OUT_FAILED,
                 SCALE_IN_FAILED)

PROVISIONING_DELAY_ENV = "GPUSCHED_PROVISIONING_DELAY_S"
"""Seconds a switched-on node needs to come up (default 900); one that has not come up in twice
that is asked for again by the reactive scale-out."""
DEFAULT_PROVISIONING_DELAY_S = 900.0
SCALE_IN_AFTER_ENV = "GPUSCHED_SCALE_IN_AFTER_S"
"""Seconds a switched-on standby node stays idle before the agent sends it back (``off``: never)."""
DEFAULT_SCALE_IN_AFTER_S = 1800.0


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

    def release(self, names: Sequence[str], *, reason: str, now: float) -> ScalingResult:
        """Send the switched-on standby nodes ``names`` back to standby (scale-in); raises
        :class:`~gpusched.errors.ScalingError` when it cannot."""
        ...


def release_payload(names: Sequence[str], *, reason: str, now: float) -> dict[str, Any]:
    """What command and webhook scalers receive for a scale-in."""
    return {"action": "release", "release": list(names), "reason": reason, "created_at": now}


def _activate_payload(plan: ScalingPlan) -> dict[str, Any]:
    return {"action": "activate", **plan.to_dict()}


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
        since = dict(state.get("activated_at") or {})
        since.update({name: plan.created_at for name in plan.activate if name not in since})
        state.update(active_standby=active, activated_at={n: since[n] for n in active if n in since},
                     burst_reserve_gpus=plan.burst_reserve_gpus, last_plan=plan.to_dict(),
                     applied_at=time.time())
        write_state(self.state_file, state)
        return ScalingResult(self.name, True, plan.activate, plan.burst_reserve_gpus,
                             f"{len(active)} standby node(s) active; state in {self.state_file}")

    def deactivate(self, names: Sequence[str]) -> None:
        """Return nodes to standby (scale-in)."""
        state = self.state()
        gone = set(names)
        state["active_standby"] = [n for n in state.get("active_standby", []) if n not in gone]
        since = dict(state.get("activated_at") or {})
        state["activated_at"] = {n: t for n, t in since.items() if n not in gone}
        write_state(self.state_file, state)

    def release(self, names: Sequence[str], *, reason: str, now: float) -> ScalingResult:
        """:meth:`deactivate` (the simulated backend reports the nodes as standby again)."""
        self.deactivate(names)
        left = self.state().get("active_standby", [])
        return ScalingResult(self.name, True, (), int(self.state().get("burst_reserve_gpus") or 0),
                             f"released {', '.join(names)}; {len(left)} standby node(s) active")


class CommandScaler:
    """Runs ``argv`` with the plan as JSON on stdin; a non-zero exit is a ScalingError."""

    name = "command"

    def __init__(self, argv: Sequence[str], *, timeout_s: float = 60.0) -> None:
        if not argv:
            raise ConfigurationError("CommandScaler needs a command, e.g. command:/usr/local/bin/scale-up")
        self.argv = list(argv)
        self.timeout_s = timeout_s

    def apply(self, plan: ScalingPlan) -> ScalingResult:
        """Run the command with the plan; its stdout (trimmed) becomes the result's detail."""
        return ScalingResult(self.name, True, plan.activate, plan.burst_reserve_gpus,
                             self._run(_activate_payload(plan)))

    def release(self, names: Sequence[str], *, reason: str, now: float) -> ScalingResult:
        """Run the command with ``{"action": "release", "release": [...], ...}`` on stdin."""
        detail = self._run(release_payload(names, reason=reason, now=now))
        return ScalingResult(self.name, True, (), 0, detail)

    def _run(self, payload: Mapping[str, Any]) -> str:
        try:
            done = subprocess.run(
                self.argv, input=json.dumps(payload), capture_output=True, text=True,
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
        return done.stdout.strip()[-500:]


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
        ok, text = self._post(_activate_payload(plan))
        return ScalingResult(self.name, ok, plan.activate, plan.burst_reserve_gpus, text)

    def release(self, names: Sequence[str], *, reason: str, now: float) -> ScalingResult:
        """POST ``{"action": "release", "release": [...], ...}``."""
        ok, text = self._post(release_payload(names, reason=reason, now=now))
        return ScalingResult(self.name, ok, (), 0, text)

    def _post(self, payload: Mapping[str, Any]) -> tuple[bool, str]:
        body = json.dumps(payload).encode("utf-8")
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
        return 200 <= status < 300, text.strip()[-500:]


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


def provisioning_timeout(value: str | None = None) -> float:
    """How long a node switched on may take to come up before the reactive scale-out asks for it
    again: twice ``value`` or ``$GPUSCHED_PROVISIONING_DELAY_S`` (default 900 s)."""
    text = (value if value is not None else os.environ.get(PROVISIONING_DELAY_ENV, "")).strip()
    try:
        delay = float(text) if text else DEFAULT_PROVISIONING_DELAY_S
    except ValueError:
        delay = -1.0
    if not 0.0 <= delay < float("inf"):
        raise ConfigurationError(f"{PROVISIONING_DELAY_ENV}={text!r} is not a number of seconds ≥ 0; "
                                 "e.g. 900")
    return 2.0 * delay


def react_to_waiting(
    ledger: Any, *, threshold_s: float, scaler: Scaler | None = None, now: float | None = None,
    provision_timeout_s: float | None = None,
) -> ReactiveScaleOut:
    """Switch on the standby nodes that tasks waiting longer than ``threshold_s`` need.

    Reads the ledger's queue (multi-node gang members with their membership) and fleet, applies
    :func:`gpusched.capacity.prescale.standby_for_waiting` through ``scaler`` (default
    ``$GPUSCHED_SCALER``) and records one ``scale_out_reactive`` event per node with the reason.
    The burst reserve of the last forecast plan is kept.

    One decision is one scaler call, however many agents run this rule over one ledger: nodes
    already switched on and not yet in service (their host still booting, :func:`switched_on`)
    count as capacity on its way, and each node is claimed in the ledger before the call
    (:meth:`~gpusched.ledger.Ledger.claim_event`: of agents deciding at once, one records the
    ``scale_out_reactive`` event and calls; the others find it and call nothing). A failed call
    records ``scale_out_failed``, so a later cycle may ask again; so does a node switched on that
    is still standby after ``provision_timeout_s`` (default :func:`provisioning_timeout`: the
    host never came up), claimed the same way so that it is asked for once more, not once per agent.
    """
    at = time.time() if now is None else now
    waiting = [WaitingTask(q.key, q.request, q.since, getattr(q, "gang", None)) for q in ledger.queue()]
    if not waiting:
        return ReactiveScaleOut((), ())
    scaler = scaler or scaler_from_spec()
    snapshot = ledger.snapshot(at)
    on = switched_on(ledger, scaler)
    timeout = provisioning_timeout() if provision_timeout_s is None else provision_timeout_s
    standby = {n.name for n in snapshot.nodes if n.standby}
    for name, since in list(on.items()):
        if name in standby and at - since >= timeout:  # its host never came up: ask again
            on.pop(name)
            ledger.claim_event(SCALE_OUT_FAILED, name, among=(REACTIVE_SCALE_OUT,), since=since, now=at,
                               reason=f"switched on {at - since:.0f} s ago and still not up "
                                      f"(more than {timeout:.0f} s, twice {PROVISIONING_DELAY_ENV})",
                               provider=scaler.name)
    coming = list(on)  # those still standby are on their way
    decision = standby_for_waiting(waiting, snapshot, now=at, threshold_s=threshold_s, coming=coming)
    if not decision.activate:
        return decision
    reason = "; ".join(decision.reasons)
    claimed = tuple(name for name in decision.activate if ledger.claim_event(
        REACTIVE_SCALE_OUT, name, among=(SCALE_IN, SCALE_OUT_FAILED), now=at, reason=reason,
        provider=scaler.name, applied=True))
    if not claimed:  # another agent made this decision first and called the scaler
        return ReactiveScaleOut((), ())
    state = scaler.state() if isinstance(scaler, LocalFleetScaler) else {}
    plan = ScalingPlan(
        created_at=at, provisioning_delay_s=0, active_gpus=0, target_gpus=0,
        activate=claimed, surplus_gpus=0,
        burst_reserve_gpus=int(state.get("burst_reserve_gpus") or 0), steps=(), model="reactive",
        reason=f"reactive scale-out: {reason}",
    )
    try:
        result = scaler.apply(plan)
    except Exception as exc:
        for name in claimed:
            ledger.record_event(SCALE_OUT_FAILED, name, now=at, reason=str(exc), provider=scaler.name)
        raise
    ledger.record_event(SCALER_CALL, "activate", now=at, nodes=list(claimed), provider=result.provider,
                        applied=result.applied, detail=result.detail)
    return decision if claimed == decision.activate else ReactiveScaleOut(claimed, decision.reasons)


def record_plan(ledger: Any, plan: ScalingPlan, result: ScalingResult) -> None:
    """Record a forecast plan carried out by ``result`` (one ``prescale_plan`` event): the scale-in
    keeps its burst reserve and its target, and its nodes count as switched on, whatever the provider."""
    ledger.record_event(PRESCALE_PLAN, "fleet", now=plan.created_at, plan=plan.to_dict(),
                        provider=result.provider, applied=result.applied, activate=list(result.activated),
                        detail=result.detail)


def switched_on(ledger: Any, scaler: Scaler) -> dict[str, float]:
    """The standby nodes a scaler switched on and not yet released, with since when, oldest first.

    :class:`LocalFleetScaler`: its state file (the simulated backend's truth). Other providers keep
    no state here, so the ledger's event log says: reactive scale-outs, forecast plans
    (:func:`record_plan`) and the fault chain's scale-outs switch nodes on, ``scale_in`` events off.
    """
    on: dict[str, float] = {}
    for event in reversed(ledger.events(1000, kinds=_SWITCH_KINDS)):
        detail = event.detail
        if event.kind in (SCALE_IN, SCALE_OUT_FAILED):
            on.pop(event.subject, None)
            continue
        if event.kind == SCALE_IN_FAILED:  # still on: idle from now, released after a cool-down
            on[event.subject] = float(event.at)
            continue
        if event.kind == REACTIVE_SCALE_OUT:
            names = [event.subject] if detail.get("applied", True) else []
        elif event.kind == PRESCALE_PLAN:
            names = list(detail.get("activate") or []) if detail.get("applied", True) else []
        else:  # the fault chain: its scaler line is None or "scaler failed: ..." when nothing was done
            done = str(detail.get("scaler") or "")
            failed = not done or done.startswith("scaler failed")
            names = [] if failed else list(detail.get("activate") or [])
        for name in names:
            on.setdefault(str(name), float(event.at))
    if isinstance(scaler, LocalFleetScaler):
        state = scaler.state()
        since = dict(state.get("activated_at") or {})
        fallback = float(state.get("applied_at") or 0.0)
        nodes = [str(n) for n in state.get("active_standby", [])]
        found = {n: float(since.get(n, on.get(n, fallback))) for n in nodes}
        return dict(sorted(found.items(), key=lambda item: item[1]))
    return on


def _last_plan(ledger: Any, scaler: Scaler | None) -> tuple[int, int, float]:
    """(burst reserve, target GPUs, until when the target holds) of the last forecast plan."""
    events = ledger.events(1, kinds=[PRESCALE_PLAN])
    if events and isinstance(events[0].detail.get("plan"), dict):
        plan = ScalingPlan.from_dict(events[0].detail["plan"])
        # The plan looks from its creation to one hour past the provisioning delay (plan_prescale).
        return plan.burst_reserve_gpus, plan.target_gpus, plan.created_at + plan.provisioning_delay_s + 3600
    state = scaler.state() if isinstance(scaler, LocalFleetScaler) else {}
    return int(state.get("burst_reserve_gpus") or 0), 0, float("-inf")


def burst_reserve(ledger: Any, now: float) -> int:
    """The GPUs the executors' placement keeps free for burst work at ``now``: the burst reserve
    of the last forecast plan (its ``prescale_plan`` event) while that plan holds (until one hour
    past its provisioning delay, as its target), else 0 — a forecast DAG that stopped running
    leaves no reserve behind. Placement applies it through the quota gate
    (``QuotaState.burst_reserve_gpus``, :func:`gpusched.quota.policy.usable_gpus`)."""
    reserve, _, until = _last_plan(ledger, None)
    return reserve if now < until else 0


def release_idle(
    ledger: Any, *, cool_down_s: float, scaler: Scaler | None = None, now: float | None = None
) -> ScaleIn:
    """Send the switched-on standby nodes idle for ``cool_down_s`` back to standby (scale-in).

    The decision is :func:`gpusched.capacity.standby_rules.scale_in` over the nodes
    :func:`switched_on` names that are in service: a node is busy while an unreleased allocation
    (quarantined ones included) holds one of its devices, idle since its last allocation ended
    or since it was switched on; nothing goes back while a waiting task needs these nodes (it
    fits once every standby node is on, but not without the idle switched-on ones; a task held
    by a budget that fits elsewhere does not count); the last forecast plan's burst reserve stays
    free and its target active. Carried out through ``scaler`` (default ``$GPUSCHED_SCALER``,
    :meth:`Scaler.release`); one ``scale_in`` event per node with the reason.
    """
    at = time.time() if now is None else now
    scaler = scaler or scaler_from_spec()
    on = switched_on(ledger, scaler)
    if not on:
        return ScaleIn((), ())
    snapshot = ledger.snapshot(at)
    busy: set[str] = set()
    ended: dict[str, float] = {}
    window = at - cool_down_s - 60.0  # idle since at least then when nothing ended after it
    for allocation in ledger.history(window, at):
        for node in {share.node for share in allocation.shares}:
            if allocation.released_at is None:
                busy.add(node)
            else:
                ended[node] = max(ended.get(node, allocation.released_at), allocation.released_at)
    known = {node.name: node for node in snapshot.nodes}
    candidates = []
    for name, since in on.items():
        node = known.get(name)
        if node is None or node.standby or node.cordoned:  # not joined yet, or already off
            continue
        idle = None if name in busy else max(since, ended.get(name, window))
        candidates.append(SwitchedOn(name, _gpus(node), idle))
    if not candidates:
        return ScaleIn((), ())
    active = [n for n in snapshot.nodes if not n.standby and not n.cordoned]
    used_parents = {d.parent for n in active for d in n.devices
                    if d.parent is not None and snapshot.used(d.uuid).used_milli > 0}
    free = sum(1 for n in active for d in n.devices
               if d.parent is None and snapshot.used(d.uuid).used_milli == 0 and d.uuid not in used_parents)
    reserve, target, until = _last_plan(ledger, scaler)
    # Work that waits for these nodes: it fits once every standby node is on, but not without the
    # idle switched-on ones (a task about to be placed there, or one waiting for standby capacity).
    resting = [replace(known[c.name], standby=True) for c in candidates if c.idle_since is not None]
    without = snapshot.with_nodes(resting)
    every = activate_in_snapshot(snapshot, [n.name for n in snapshot.nodes if n.standby])
    waiting = any(not feasible(entry.request, without) and feasible(entry.request, every)
                  for entry in ledger.queue()) if resting else False
    decision = scale_in(candidates, now=at, cool_down_s=cool_down_s, free_gpus=free,
                        active_gpus=sum(_gpus(n) for n in active), reserve_gpus=reserve,
                        keep_gpus=target if at < until else 0, waiting=waiting)
    if not decision.release:
        return decision
    # One decision, one call (as in react_to_waiting): each node is claimed before the call.
    chosen = [(name, reason) for name, reason in zip(decision.release, decision.reasons, strict=True)
              if ledger.claim_event(SCALE_IN, name, among=(REACTIVE_SCALE_OUT, SCALE_IN_FAILED),
                                    since=on[name], now=at, reason=reason, provider=scaler.name,
                                    applied=True)]
    if not chosen:
        return ScaleIn((), ())
    # The GPU hosts of these nodes go to standby before they are powered off: nothing new is
    # placed there, and their agents' silence is no lost host (scheduler.hosts judges live ones).
    # A host that took a task since the decision stays in service (its nodes: not released).
    node_hosts = ledger.node_hosts()
    host_of = {name: node_hosts[name][0] for name, _ in chosen if name in node_hosts}
    hosts: list[str] = []
    kept: set[str] = set()
    for host in sorted(set(host_of.values())):
        if ledger.standby_host(host, reason=f"released by the scale-in ({scaler.name} scaler)", now=at):
            hosts.append(host)
            continue
        for name in (n for n, h in host_of.items() if h == host):
            kept.add(name)
            ledger.record_event(SCALE_IN_FAILED, name, now=at, provider=scaler.name,
                                reason=f"GPU host {host} took a task since the scale-in decided; kept on")
    chosen = [(name, reason) for name, reason in chosen if name not in kept]
    if not chosen:
        return ScaleIn((), ())
    names = tuple(name for name, _ in chosen)
    try:
        result = scaler.release(names, reason="; ".join(r for _, r in chosen), now=at)
    except Exception as exc:
        for name in names:
            ledger.record_event(SCALE_IN_FAILED, name, now=at, reason=str(exc), provider=scaler.name)
        for host in hosts:  # still powered: back in service
            ledger.resume_host(host, f"the release failed: {exc}", now=at)
        raise
    ledger.record_event(SCALER_CALL, "release", now=at, nodes=list(names), provider=result.provider,
                        applied=result.applied, detail=result.detail)
    return decision if names == decision.release else ScaleIn(names, tuple(r for _, r in chosen))


def _gpus(node: Any) -> int:
    """Whole GPUs of a node (MIG instances and partitions count with their GPU)."""
    return sum(1 for d in node.devices if d.parent is None)


def scale_in_after(value: str | None = None) -> float | None:
    """The agent's scale-in cool-down from ``value`` or ``$GPUSCHED_SCALE_IN_AFTER_S``: seconds
    (default 1800), or ``off`` for never."""
    text = (value if value is not None else os.environ.get(SCALE_IN_AFTER_ENV, "")).strip().lower()
    if not text:
        return DEFAULT_SCALE_IN_AFTER_S
    if text in ("off", "never", "none"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.0 <= seconds < float("inf"):
        raise ConfigurationError(f"{SCALE_IN_AFTER_ENV}={text!r} is not a number of seconds ≥ 0 or 'off'; "
                                 "e.g. 1800")
    return seconds
