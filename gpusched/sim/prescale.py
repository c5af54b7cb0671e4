"""A focused event simulation: predictive pre-scaling vs reactive scale-out for burst jobs.

The fleet is a pool of GPUs in whole nodes: ``active_nodes`` always on, ``standby_nodes`` that
take ``provisioning_delay_s`` to become usable once activated. Two job classes arrive:

* training jobs (1–8 GPUs, hours long) all day with a daily and weekly cycle;
* burst jobs (1–2 GPUs, ~20 min) in a daily burst window (heavier on weekdays).

Burst jobs go first; training jobs may not take the burst reserve. Strategies:

* ``reactive`` — the jobs that wait for capacity switch standby nodes on (ready after the delay);
  no reserve.
* ``predictive`` — every ``plan_every_s`` the demand forecast (:mod:`gpusched.capacity.forecast`, refit
  every ``refit_every_s`` on the simulated hourly history of total and burst demand) goes through
  :func:`gpusched.capacity.prescale.plan_prescale`, which activates standby nodes ahead of the predicted
  demand and sets the burst reserve; the reactive rule stays as a fallback.

Every decision comes from the rules the agent runs (:mod:`gpusched.capacity.standby_rules`):
the reactive scale-out (:func:`~gpusched.capacity.standby_rules.reactive_scale_out`, threshold 0,
over the pool as a :class:`PoolView`: GPU counts, capacity being provisioned counted as coming),
the burst reserve (:func:`~gpusched.capacity.standby_rules.usable_gpus`: in dispatching and in
what the scale-out counts as fitting) and the scale-in
(:func:`~gpusched.capacity.standby_rules.scale_in`: a switched-on node goes back to standby after
``idle_release_s``). This module keeps the pool's bookkeeping, the clock and the metrics. The pool
ignores which node a job sits on (jobs are at most one node wide), so a node counts as idle from
when it came up and scale-in assumes an idle node's worth of free GPUs can be handed back.
The first ``warmup_days`` run reactive for both strategies (to build forecasting history);
metrics cover the ``measure_days`` after.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpusched.capacity.forecast import DemandSeries, Forecast, fit_forecast
from gpusched.capacity.prescale import plan_prescale
from gpusched.capacity.standby_rules import (
    SwitchedOn,
    WaitingTask,
    reactive_scale_out,
    scale_in,
    usable_gpus,
)
from gpusched.catalog import default_catalog
from gpusched.model import Device, Node
from gpusched.request import GPURequest, Partition

__all__ = ["PoolView", "PrescaleConfig", "PrescaleResult", "compare", "generate_jobs", "simulate_prescale"]

HOUR = 3600
DAY = 86400


@dataclass(frozen=True, slots=True)
class PrescaleConfig:
    """Scenario knobs (defaults: 8 active + 8 standby nodes of 8 GPUs, 15-minute provisioning)."""

    active_nodes: int = 8
    standby_nodes: int = 8
    gpus_per_node: int = 8
    provisioning_delay_s: int = 900
    warmup_days: int = 14
    measure_days: int = 7
    training_per_hour: float = 6.0
    training_mean_s: float = 3 * HOUR
    burst_start_h: float = 9.0
    burst_hours: float = 1.5
    burst_per_hour: float = 60.0
    burst_mean_s: float = 20 * 60
    idle_release_s: int = 1800
    plan_every_s: int = 900
    refit_every_s: int = 6 * HOUR
    model: str = "ets"
    use_upper: bool = False  # plan on the mean (+ headroom); the burst reserve uses the upper bound
    seed: int = 0
    start: float = 1_700_006_400.0  # a Wednesday 00:00 UTC; days are aligned to midnight


@dataclass(frozen=True, slots=True)
class SimJob:
    """One arriving job."""

    arrival: float
    gpus: int
    duration: float
    burst: bool


@dataclass
class PrescaleResult:
    """Waits (seconds), standby node-hours paid for and activations, over the measured days."""

    strategy: str
    burst_jobs: int
    burst_wait_p50_s: float
    burst_wait_p95_s: float
    burst_wait_mean_s: float
    training_wait_mean_s: float
    standby_node_hours: float
    activations: int
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        return {k: getattr(self, k) for k in (
            "strategy", "burst_jobs", "burst_wait_p50_s", "burst_wait_p95_s", "burst_wait_mean_s",
            "training_wait_mean_s", "standby_node_hours", "activations")} | self.extra


def generate_jobs(cfg: PrescaleConfig) -> list[SimJob]:
    """The job stream of the whole run (warm-up + measured days), seeded."""
    rng = random.Random(cfg.seed)
    jobs: list[SimJob] = []
    end = cfg.start + (cfg.warmup_days + cfg.measure_days) * DAY
    peak = cfg.training_per_hour * 1.5 / HOUR
    t = cfg.start
    while True:  # thinning: daily cycle (busier afternoons), quieter weekends
        t += rng.expovariate(peak)
        if t >= end:
            break
        hour = (t % DAY) / HOUR
        weekday = int((t // DAY + 3) % 7) < 5
        rate = 1.0 + 0.5 * math.sin(2 * math.pi * (hour - 8) / 24)
        rate *= 1.0 if weekday else 0.6
        if rng.random() < rate / 1.5:
            duration = rng.expovariate(1 / cfg.training_mean_s)
            jobs.append(SimJob(t, rng.choice((1, 1, 2, 4, 8)), duration, False))
    for day in range(cfg.warmup_days + cfg.measure_days):
        base = cfg.start + day * DAY + cfg.burst_start_h * HOUR
        weekday = int((base // DAY + 3) % 7) < 5
        rate = cfg.burst_per_hour * (1.0 if weekday else 0.5) / HOUR
        t = base
        while True:
            t += rng.expovariate(rate)
            if t >= base + cfg.burst_hours * HOUR:
                break
            jobs.append(SimJob(t, rng.choice((1, 2)), rng.expovariate(1 / cfg.burst_mean_s) + 60, True))
    jobs.sort(key=lambda j: j.arrival)
    return jobs


def _standby_nodes(cfg: PrescaleConfig) -> list[Node]:
    model = default_catalog().get("A100-SXM-80GB")
    nodes = []
    for n in range(cfg.standby_nodes):
        name = f"standby-{n:02d}"
        devices = tuple(
            Device(f"{name}-gpu{i}", i, name, model.name, model.vendor, model.architecture,
                   model.memory_bytes)
            for i in range(cfg.gpus_per_node)
        )
        nodes.append(Node(name, "rack-0", devices, standby=True))
    return nodes


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool as the standby rules see it (:class:`~gpusched.capacity.standby_rules.CapacityView`):
    ``free`` GPUs (free now, plus those being provisioned in the view of capacity coming), the
    standby nodes not yet switched on (in the order they are offered), the GPUs per node and the
    burst reserve. A request holds when its GPUs fit the free GPUs its partition may use
    (:func:`~gpusched.capacity.standby_rules.usable_gpus`, as dispatching does); the pool has no
    multi-node gangs."""

    free: int
    standby: tuple[str, ...]
    gpus_per_node: int
    reserve: int = 0

    def holds(self, request: GPURequest) -> bool:
        """Whether ``request``'s GPUs fit the free GPUs its partition may use."""
        return request.count <= usable_gpus(self.free, self.reserve, partition=request.partition)

    def take(self, request: GPURequest) -> PoolView:
        """The pool with ``request``'s GPUs taken."""
        return replace(self, free=self.free - request.count)

    def switchable(self) -> tuple[str, ...]:
        """The standby nodes not switched on yet."""
        return self.standby

    def switch_on(self, names: Sequence[str]) -> PoolView:
        """The pool with those nodes' GPUs added."""
        return replace(self, free=self.free + len(names) * self.gpus_per_node,
                       standby=tuple(n for n in self.standby if n not in names))

    def gang_standby(self, request: GPURequest, size: int, same_rack: bool) -> tuple[str, ...] | None:
        """The pool scenario has no multi-node gangs: never any nodes for one."""
        return None


class _Pool:
    """GPU pool state and the hourly demand history the forecaster learns from."""

    def __init__(self, cfg: PrescaleConfig) -> None:
        self.cfg = cfg
        self.active = cfg.active_nodes * cfg.gpus_per_node
        self.provisioning = 0  # GPUs activated but not yet ready
        self.used = 0
        self.reserve = 0
        self.standby = [n.name for n in _standby_nodes(cfg)]
        self.on: list[tuple[str, float]] = []  # activated standby nodes (name, since)
        self.node_seconds = 0.0
        self.activations = 0
        self.queue_burst: deque[tuple[int, SimJob]] = deque()
        self.queue_train: deque[tuple[int, SimJob]] = deque()
        self.hist_total: list[float] = []
        self.hist_burst: list[float] = []
        self._acc = [0.0, 0.0]
        self._last = cfg.start
        self.burst_used = 0
        self.measure_from = cfg.start + cfg.warmup_days * DAY

    def demand(self) -> tuple[int, int]:
        burst_q = sum(j.gpus for _, j in self.queue_burst)
        train_q = sum(j.gpus for _, j in self.queue_train)
        return self.used + burst_q + train_q, self.burst_used + burst_q

    def advance(self, now: float) -> None:
        """Integrate demand into hourly buckets and standby node time up to ``now``."""
        while self._last < now:
            boundary = (math.floor((self._last - self.cfg.start) / HOUR) + 1) * HOUR + self.cfg.start
            step = min(now, boundary) - self._last
            total, burst = self.demand()
            self._acc[0] += total * step
            self._acc[1] += burst * step
            if self._last >= self.measure_from:
                self.node_seconds += step * (len(self.on) + self.provisioning / self.cfg.gpus_per_node)
            self._last += step
            if self._last >= boundary:
                self.hist_total.append(self._acc[0] / HOUR)
                self.hist_burst.append(self._acc[1] / HOUR)
                self._acc = [0.0, 0.0]


def simulate_prescale(cfg: PrescaleConfig, strategy: str, jobs: list[SimJob] | None = None) -> PrescaleResult:
    """Run one strategy (``"reactive"`` or ``"predictive"``) on the scenario."""

    if strategy not in ("reactive", "predictive"):
        raise ValueError(f"strategy must be 'reactive' or 'predictive', not {strategy!r}")
    jobs = generate_jobs(cfg) if jobs is None else jobs
    pool = _Pool(cfg)
    standby_by_name = {n.name: n for n in _standby_nodes(cfg)}
    measure_from = cfg.start + cfg.warmup_days * DAY
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, data: Any = None) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    for i, job in enumerate(jobs):
        push(job.arrival, "arrive", i)
    end = cfg.start + (cfg.warmup_days + cfg.measure_days) * DAY
    t = cfg.start
    while t < end:
        t += cfg.plan_every_s
        push(t, "tick")
    waits: dict[bool, list[float]] = {True: [], False: []}
    forecasts: tuple[Forecast, Forecast] | None = None
    last_fit = -math.inf

    requests: dict[tuple[int, bool], GPURequest] = {}

    def request_of(job: SimJob) -> GPURequest:
        shape = (job.gpus, job.burst)
        if shape not in requests:
            requests[shape] = GPURequest(count=job.gpus,
                                         partition=Partition.BURST if job.burst else Partition.TRAINING)
        return requests[shape]

    def activate(names: Sequence[str], now: float) -> None:
        for name in names:
            pool.standby.remove(name)
            pool.provisioning += cfg.gpus_per_node
            pool.activations += now >= measure_from
            push(now + cfg.provisioning_delay_s, "ready", name)

    def dispatch(now: float) -> None:
        for queue, burst in ((pool.queue_burst, True), (pool.queue_train, False)):
            partition = Partition.BURST if burst else Partition.TRAINING
            while queue:
                _, job = queue[0]
                if job.gpus > usable_gpus(pool.active - pool.used, pool.reserve, partition=partition):
                    break
                queue.popleft()
                pool.used += job.gpus
                pool.burst_used += job.gpus if burst else 0
                if job.arrival >= measure_from:
                    waits[burst].append(now - job.arrival)
                push(now + job.duration, "done", job)
        if not pool.queue_burst and not pool.queue_train:
            return
        # The reactive rule (also the predictive strategy's fallback): the agent's, at once.
        waiting = [WaitingTask(f"{i:07d}", request_of(job), job.arrival)
                   for queue in (pool.queue_burst, pool.queue_train) for i, job in queue]
        free, standby = pool.active - pool.used, tuple(pool.standby)
        decision = reactive_scale_out(
            waiting, PoolView(free, standby, cfg.gpus_per_node, pool.reserve), now=now, threshold_s=0.0,
            coming=PoolView(free + pool.provisioning, standby, cfg.gpus_per_node, pool.reserve),
        )
        activate(decision.activate, now)

    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > end and kind == "tick":
            continue
        pool.advance(now)
        if kind == "arrive":
            job = jobs[data]
            (pool.queue_burst if job.burst else pool.queue_train).append((data, job))
        elif kind == "done":
            pool.used -= data.gpus
            pool.burst_used -= data.gpus if data.burst else 0
        elif kind == "ready":
            pool.provisioning -= cfg.gpus_per_node
            pool.active += cfg.gpus_per_node
            pool.on.append((data, now))
        elif kind == "tick":
            target = 0
            if strategy == "predictive" and now >= measure_from - DAY and len(pool.hist_total) >= 3 * 24:
                if now - last_fit >= cfg.refit_every_s or forecasts is None:
                    start = now - len(pool.hist_total) * HOUR
                    window = 21 * 24
                    total = DemandSeries(start, HOUR, tuple(pool.hist_total))
                    burst = DemandSeries(start, HOUR, tuple(pool.hist_burst))
                    forecasts = (fit_forecast(total, cfg.model, 24, train_window=window),
                                 fit_forecast(burst, cfg.model, 24, train_window=window))
                    last_fit = now
                standby = [standby_by_name[n] for n in pool.standby]
                plan = plan_prescale(forecasts[0], pool.active + pool.provisioning, cfg.provisioning_delay_s,
                                     now=now, standby=standby, burst_forecast=forecasts[1],
                                     max_burst_fraction=0.5, use_upper=cfg.use_upper)
                activate(plan.activate, now)
                pool.reserve = plan.burst_reserve_gpus
                target = plan.target_gpus
            # Scale-in: the agent's rule; a node counts as idle from when it came up (the pool
            # cannot tell which node a job sits on).
            released = scale_in(
                [SwitchedOn(name, cfg.gpus_per_node, since) for name, since in pool.on],
                now=now, cool_down_s=cfg.idle_release_s, free_gpus=pool.active - pool.used,
                active_gpus=pool.active, reserve_gpus=pool.reserve,
                keep_gpus=max(target, cfg.active_nodes * cfg.gpus_per_node),
                waiting=bool(pool.queue_burst or pool.queue_train),
            ).release
            for name in released:
                pool.on = [(n, since) for n, since in pool.on if n != name]
                pool.active -= cfg.gpus_per_node
                pool.standby.append(name)
        dispatch(now)
    burst_waits = sorted(waits[True])

    def pct(q: float) -> float:
        if not burst_waits:
            return 0.0
        return burst_waits[min(len(burst_waits) - 1, round(q / 100 * (len(burst_waits) - 1)))]

    measured_hours = cfg.measure_days * 24
    return PrescaleResult(
        strategy=strategy, burst_jobs=len(burst_waits), burst_wait_p50_s=pct(50), burst_wait_p95_s=pct(95),
        burst_wait_mean_s=sum(burst_waits) / max(1, len(burst_waits)),
        training_wait_mean_s=sum(waits[False]) / max(1, len(waits[False])),
        standby_node_hours=pool.node_seconds / HOUR, activations=pool.activations,
        extra={"hours_measured": measured_hours, "model": cfg.model if strategy == "predictive" else None},
    )


def compare(cfg: PrescaleConfig) -> dict[str, Any]:
    """Both strategies on the same job stream; ratios predictive / reactive."""
    jobs = generate_jobs(cfg)
    reactive = simulate_prescale(cfg, "reactive", jobs)
    predictive = simulate_prescale(cfg, "predictive", jobs)
    return {
        "provisioning_delay_s": cfg.provisioning_delay_s,
        "active_nodes": cfg.active_nodes, "standby_nodes": cfg.standby_nodes,
        "gpus_per_node": cfg.gpus_per_node, "warmup_days": cfg.warmup_days, "measure_days": cfg.measure_days,
        "jobs": len(jobs), "model": cfg.model, "plan_on": "upper bound" if cfg.use_upper else "mean",
        "reactive": reactive.to_dict(), "predictive": predictive.to_dict(),
        "burst_p95_ratio": (predictive.burst_wait_p95_s / reactive.burst_wait_p95_s
                            if reactive.burst_wait_p95_s else None),
        "standby_node_hours_ratio": (predictive.standby_node_hours / reactive.standby_node_hours
                                     if reactive.standby_node_hours else None),
    }
