"""Preemption in the GPU executors: stop lower-priority work so a waiting task gets its devices.

One implementation for both executors (it lives beside :class:`GPUScheduling`, the shared core).
``[gpusched] preemption`` (off | priority | partitions | service), ``preemption_grace_seconds`` and
``preemption_min_runtime_seconds`` (:mod:`gpusched.settings`) drive it.

With ``service`` (Tiresias-style, :mod:`gpusched.durations.service`), :meth:`Preemptor.rank`
orders every cycle's queue by each task's Gittins index (from the run-time distribution of its
prediction group in the ledger's finished runs, :attr:`DurationHistory.service`), at the GPU-time
its task instance has attained, earlier tries included (:mod:`gpusched.scheduler.attained`), and
a held task may also preempt running tasks of its own priority whose index, at the GPU-time
they have attained, is lower than its own by the model's margin.

After a cycle (:meth:`Preemptor.consider`), the highest-priority task held for capacity (or the
whole multi-node gang) gets a victim selection (:func:`gpusched.placement.preemption.select_victims`,
the same pure policy the simulator uses) over this executor's running GPU tasks, proven by
placement on the snapshot without the victims before anything is stopped. Each victim then:

1. gets a notice: a ``preempted`` ledger event, a line in its task log, an event-log row
   ``gpusched.preempted`` (Audit Log) and its task-instance note, and the ledger's notice that
   :func:`gpusched.airflow.checkpoint.preempted` reads in the task (``GPUSCHED_PREEMPTED``);
2. has ``preemption_grace_seconds`` to checkpoint; as soon as it reports a checkpoint after the
   notice, or when the grace runs out, its task instance is **cleared** (:meth:`Preemptor.advance`):
   Airflow 3.3 sets a running cleared instance to ``restarting``, its supervisor's next heartbeat
   (≤ 5 s) is refused and it sends the task SIGTERM (SIGKILL 5 s later);
3. when the process has ended the executor releases its devices (reason ``preempted …``) and
   Airflow, seeing a ``restarting`` instance end, raises ``max_tries`` by one try and schedules it
   again: the new try runs later without having used a retry (the same path as clearing a
   running task in the UI).

The notice is in the ledger, so a victim being stopped is not forgotten when the executor
restarts: a running try it adopts that carries a notice is stopped as before, its grace counted
from the notice (:meth:`Preemptor.restore`), and its beneficiary keeps waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpusched import settings
from gpusched.airflow.executor_compat import save_task_event
from gpusched.airflow.task_log import append_task_log
from gpusched.durations.service import aged_index, gpu_seconds, queue_rank
from gpusched.model import DeviceShare
from gpusched.placement import PendingTask, RunningTask
from gpusched.placement.migration import MIGRATE
from gpusched.placement.policy import QueueOrder
from gpusched.placement.preemption import (
    NoPreemption,
    PreemptionPlan,
    PreemptionRequest,
    Prover,
    check_mode,
    select_victims,
)
from gpusched.scheduler.attained import PREEMPTED_REASON
from gpusched.scheduler.cycle import CycleReply, CycleRequest, Hold, PendingWork, decide
from gpusched.scheduler.durations import task_name
from gpusched.scheduler.gangs import place_gang
from gpusched.scheduler.keys import task_of

__all__ = ["MAX_SELECTIONS_PER_CYCLE", "Eviction", "PreemptionCore", "Preemptor", "after_launches", "requeue"]

MAX_SELECTIONS_PER_CYCLE = 4
"""Victim selections per cycle (most urgent held work first), bounding the cycle's cost."""


class PreemptionCore(Protocol):
    """What the preemptor uses of :class:`~gpusched.airflow.gpu_scheduling.GPUScheduling`."""

    executor: Any
    conf: Any
    gpu_running: dict[Any, str]
    gangs: dict[str, set[Any]]
    durations: Any  # scheduler.durations.DurationHistory: its ``service`` history (mode service)
    attained: Any  # scheduler.attained.AttainedService: which running tries were preempted before
    clock: Any  # () -> now

    @property
    def log(self) -> Any: ...

    @property
    def ledger(self) -> Any: ...


@dataclass
class Eviction:
    """One victim being stopped: its Airflow key, for whom, when it was told, and its deadline."""

    airflow_key: Any
    beneficiary: str
    notice_at: float
    deadline: float
    reason: str
    cleared: bool = False


class Preemptor:
    """Chooses victims after each cycle and stops them (see the module docstring)."""

    def __init__(self, core: PreemptionCore) -> None:
        self.core = core
        # ``migrate`` is run by :mod:`gpusched.airflow.gpu_migration` (no victims for waiting work).
        self.mode = check_mode(settings.get_str("preemption", core.conf), extra=(MIGRATE,))
        self.grace_s = settings.get_float("preemption_grace_seconds", core.conf)
        self.min_runtime_s = settings.get_float("preemption_min_runtime_seconds", core.conf)
        self.evictions: dict[str, Eviction] = {}  # victim ledger key -> eviction
        self._seen: set[str] = set()  # running ledger keys already checked for a notice (restore)
        self.nominated: dict[str, tuple[DeviceShare, ...]] = {}  # beneficiary -> its proven placement
        # Task instances (keys without the try: a restart may requeue one as its next try) of the
        # beneficiaries whose victims have just ended.
        self.first_pick: frozenset[str] = frozenset()

    @property
    def enabled(self) -> bool:
        return self.mode not in ("off", MIGRATE)

    # ---- before a cycle (mode service) -----------------------------------------------------------

    def indices(self, request: CycleRequest) -> dict[str, float]:
        """Ledger key → Gittins index of the pending work (aged by its wait) and of the running
        tasks, each at its attained service: the GPU-time of its task instance's earlier tries
        (``request.attained_gpu_s``, as the simulator keeps it: a requeued try does not start over)
        plus, for a running task, the GPU-time since its allocation started; empty unless the
        mode is ``service``."""
        if self.mode != "service":
            return {}
        history = self.core.durations.service
        halving = request.policy.service_halving_s
        before = request.attained_gpu_s
        items = [(w.request, task_name(w.key), before.get(w.key, 0.0)) for w in request.pending]
        items += [(r.request, task_name(r.key),
                   before.get(r.key, 0.0) + gpu_seconds(r.request, request.now - r.started_at))
                  for r in request.running]
        values = history.index_values(items)
        out = {w.key: aged_index(v, request.now - w.submitted_at, halving)
               for w, v in zip(request.pending, values, strict=False)}
        out.update({r.key: v for r, v in zip(request.running, values[len(request.pending):], strict=True)})
        return out

    def hold_nominated(self, request: CycleRequest) -> CycleRequest:
        """``request`` with the free devices of each preemption in flight taken in its snapshot:
        the room a plan was proven on is kept for its beneficiary while the victims stop, or work
        of lower priority queued meanwhile would take it and the beneficiary would need a second
        round of victims (Kubernetes' nominated node). The hold ends when its victims have ended;
        in that cycle the beneficiary, if it waits, has the first pick (:meth:`decide`)."""
        running = set(self.core.gpu_running.values())
        stopping = {e.beneficiary for k, e in self.evictions.items() if k in running}
        waiting = {task_of(w.key) for w in request.pending}
        self.first_pick = frozenset(task_of(b) for b in self.nominated
                                    if b not in stopping and task_of(b) in waiting)
        self.nominated = {b: shares for b, shares in self.nominated.items() if b in stopping}
        snapshot, held = request.snapshot, []
        for share in (s for shares in self.nominated.values() for s in shares):
            if snapshot.has_device(share.uuid):
                milli = min(share.milli, snapshot.free_milli(share.uuid))
                memory = min(share.memory_bytes, snapshot.free_memory(share.uuid))
                if milli > 0:
                    held.append(replace(share, milli=milli, memory_bytes=max(0, memory)))
        return replace(request, snapshot=snapshot.with_usage(held)) if held else request

    def decide(self, request: CycleRequest) -> CycleReply:
        """:func:`~gpusched.scheduler.cycle.decide`, with the beneficiaries whose victims have
        just ended (:attr:`first_pick`, a gang with all its members) placed first and the rest on
        what their launches leave. Without it, a victim requeued meanwhile, aged from its first
        queue time, or any work ahead in the queue order would take the room made for the
        beneficiary and it would need a second round of victims (the simulator evicts and starts
        the beneficiary in one step)."""
        picks = self.first_pick
        gangs = {w.gang.gang for w in request.pending if task_of(w.key) in picks and w.gang is not None}
        first = {w.key for w in request.pending
                 if task_of(w.key) in picks or (w.gang is not None and w.gang.gang in gangs)}
        if not first:
            return decide(request)
        head = decide(replace(request, pending=tuple(w for w in request.pending if w.key in first)))
        rest = replace(request, pending=tuple(w for w in request.pending if w.key not in first))
        tail = decide(after_launches(rest, head))
        return CycleReply(head.launches + tail.launches, head.holds + tail.holds)

    def rank(self, request: CycleRequest) -> CycleRequest:
        """``request`` with its queue ordered by the tasks' Gittins indices (mode ``service``:
        ``QueueOrder.RANKED``, ranks −log2 of the unaged index at the attained service of the
        task instance's earlier tries; the engine ages them)."""
        if self.mode != "service" or not request.pending:
            return request
        history = self.core.durations.service
        before = request.attained_gpu_s
        values = history.index_values([(w.request, task_name(w.key), before.get(w.key, 0.0))
                                       for w in request.pending])
        pending = tuple(replace(w, rank=queue_rank(v)) for w, v in zip(request.pending, values, strict=True))
        ranked = replace(request.policy, queue_order=QueueOrder.RANKED)
        return replace(request, pending=pending, policy=ranked)

    # ---- after a cycle ---------------------------------------------------------------------------

    def consider(self, request: CycleRequest, reply: CycleReply) -> CycleReply:
        """Preempt for the most urgent task held for capacity; return ``reply`` with its hold reason."""
        if not self.enabled or not reply.holds:
            return reply
        self.restore(request.now)  # an adopted victim being stopped is never selected a second time
        request = after_launches(request, reply)
        works = {w.key: w for w in request.pending}
        waiting_for = {task_of(e.beneficiary) for e in self.evictions.values()}  # any try of it
        reasons: dict[str, str] = {}
        started, tries = False, 0
        indices = self.indices(request)
        restarted = self.core.attained.restarted(self.core.ledger, sorted(self.core.gpu_running.values()))
        for group in self._groups(reply.holds, works, indices):
            keys = [w.key for w in group]
            tasks = {task_of(k) for k in keys}
            if tasks & waiting_for:
                victims = sorted(v for v, e in self.evictions.items() if task_of(e.beneficiary) in tasks)
                reasons.update({k: f"waiting for preempted {', '.join(victims)} to stop" for k in keys})
                continue
            if started or tries >= MAX_SELECTIONS_PER_CYCLE:
                continue  # one new preemption per cycle: the next cycle sees its effect
            tries += 1
            outcome = select_victims(self._request(request, group, indices, restarted),
                                     self._prover(request, group))
            if isinstance(outcome, NoPreemption):
                self.core.log.debug("gpusched: no preemption for %s: %s", keys[0], outcome.reason)
                continue
            self._start(outcome, group, request.now)
            started = True
            reasons.update({k: f"{outcome.reason}; starts once their devices are free" for k in keys})
        if not reasons:
            return reply
        holds = tuple(Hold(h.key, reasons.get(h.key, h.reason), h.permanent) for h in reply.holds)
        return CycleReply(reply.launches, holds)

    def _groups(self, holds: tuple[Hold, ...], works: dict[str, PendingWork],
                indices: dict[str, float]) -> list[list[PendingWork]]:
        """Held work that waits for capacity, as units (a gang is one), most urgent first."""
        units: dict[str, list[PendingWork]] = {}
        for hold in holds:
            work = works.get(hold.key)
            if hold.permanent or work is None or work.existing:
                continue
            unit = work.gang.gang if work.gang is not None else work.key
            units.setdefault(unit, []).append(work)
        complete = [u for u in units.values()
                    if u[0].gang is None or len({w.gang.rank for w in u if w.gang}) == u[0].gang.size]
        return sorted(complete, key=lambda u: (-max(w.request.priority for w in u),
                                               -max(indices.get(w.key, 0.0) for w in u),
                                               min(w.submitted_at for w in u)))

    def _request(self, request: CycleRequest, group: list[PendingWork], indices: dict[str, float],
                 restarted: frozenset[str] = frozenset()) -> PreemptionRequest:
        mine = set(self.core.gpu_running.values())
        gang_members = {self.core.gpu_running.get(k) for ks in self.core.gangs.values() for k in ks}
        protected = frozenset(r.key for r in request.running
                              if r.key not in mine or r.key in gang_members or r.key in self.evictions)
        return PreemptionRequest(
            tuple(PendingTask(w.key, w.request, w.submitted_at) for w in group), request.snapshot,
            request.running, request.policy, request.now, request.quota, mode=self.mode,
            min_runtime_s=self.min_runtime_s, checkpoints=self.core.ledger.checkpoint_times(mine),
            protected=protected, indices=indices,
            index_margin=self.core.durations.service.model.margin if indices else 2.0,
            restarted=restarted,
        )

    @staticmethod
    def _prover(request: CycleRequest, group: list[PendingWork]) -> Prover | None:
        if group[0].gang is None:
            return None  # placement of the task itself, with the quota

        def prove(snapshot: Any, running: Any) -> Any:
            plan = place_gang(group, snapshot, request.policy, now=request.now, running=running,
                              addresses=request.addresses)
            return (plan.shares or None), plan.reason

        return prove

    def _start(self, plan: PreemptionPlan, group: list[PendingWork], now: float) -> None:
        by_ledger_key = {v: k for k, v in self.core.gpu_running.items()}
        beneficiary = group[0].key if len(group) == 1 else f"gang {group[0].gang.gang}"  # type: ignore[union-attr]
        self.nominated[group[0].key] = tuple(s for shares in plan.placement.values() for s in shares)
        for victim in plan.victims:
            airflow_key = by_ledger_key[victim.key]
            reason = (f"{PREEMPTED_REASON} for {beneficiary} ({victim.reason}); "
                      f"{victim.lost_gpu_s:.0f} GPU-s since its last checkpoint")
            self.evictions[victim.key] = Eviction(airflow_key, group[0].key, now, now + self.grace_s, reason)
            ledger = self.core.ledger
            ledger.notify_preemption(victim.key, task_of(victim.key), reason, now=now)
            ledger.record_event("preempted", victim.key, now=now, by=group[0].key, reason=reason,
                                lost_gpu_s=round(victim.lost_gpu_s, 1), grace_s=self.grace_s,
                                proof={k: [f"{s.node}:{s.index}" for s in v]
                                       for k, v in plan.placement.items()})
            self.core.log.warning("gpusched: %s %s", victim.key, reason)
            append_task_log(airflow_key, f"gpusched: {reason}. Checkpoint now: this try is stopped within "
                            f"{self.grace_s:.0f} s and requeued; it does not use a retry", level="warning")
            save_task_event(self.core.executor, event="gpusched.preempted", extra=reason, ti_key=airflow_key)

    # ---- every heartbeat -------------------------------------------------------------------------

    def restore(self, now: float) -> list[str]:
        """Pick up victims whose stop an earlier executor began: each running try not seen before
        (adopted after a restart, or just launched) that has a preemption notice in the ledger
        becomes an eviction again, its grace counted from the notice and its beneficiary read
        from its ``preempted`` event (nominated again: it has the first pick once they end).
        Returns their ledger keys."""
        by_ledger_key = {v: k for k, v in self.core.gpu_running.items()}
        new = [k for k in by_ledger_key if k not in self._seen and k not in self.evictions]
        self._seen = set(by_ledger_key)
        if not new:
            return []
        ledger = self.core.ledger
        restored = []
        for key, row in sorted(ledger.preemption_notices(new).items()):
            events = ledger.events(1, kinds=["preempted"], subject=key)
            beneficiary = str(events[0].detail.get("by", "")) if events else ""
            notice_at = float(row.notice_at or now)
            self.evictions[key] = Eviction(by_ledger_key[key], beneficiary, notice_at,
                                           notice_at + self.grace_s, row.notice_reason or "preempted")
            if beneficiary:  # its first pick once the victims end (the held room is not restored)
                self.nominated.setdefault(beneficiary, ())
            ledger.record_event("preemption_resumed", key, now=now, by=beneficiary, notice_at=notice_at)
            self.core.log.warning("gpusched: %s was being preempted for %s when the executor restarted; "
                                  "stopping it", key, beneficiary or "another task")
            restored.append(key)
        return restored

    def advance(self, now: float | None = None) -> None:
        """Stop the victims whose grace ran out or who checkpointed; forget those that ended."""
        now = self.core.clock() if now is None else now
        self.restore(now)
        running = set(self.core.gpu_running.values())
        for key, eviction in list(self.evictions.items()):
            if key not in running:
                del self.evictions[key]  # ended (and released): its beneficiary may start
                continue
            if eviction.cleared:
                continue
            saved = self.core.ledger.checkpoint(key)
            ready = saved is not None and saved.at is not None and saved.at >= eviction.notice_at
            if ready or now >= eviction.deadline:
                eviction.cleared = True
                outcome = requeue(eviction.airflow_key, eviction.reason)
                self.core.log.warning("gpusched: %s %s: %s", key,
                                      "checkpointed" if ready else "grace over", outcome)

    def release_reason(self, ledger_key: str) -> str | None:
        """The release reason of a victim whose process ended (None: not a victim)."""
        eviction = self.evictions.get(ledger_key)
        return None if eviction is None else f"{eviction.reason}; requeued"


def after_launches(request: CycleRequest, reply: CycleReply) -> CycleRequest:
    """``request`` as the cycle's launches leave it: their devices taken in the snapshot and the
    tasks running (not this executor's yet, so never victims). A victim selection proven on the
    snapshot from before the launches could count a device a launch of the same cycle takes."""
    new = [launch for launch in reply.launches if not launch.reused]  # reused: already counted
    if not new:
        return request
    snapshot = request.snapshot.with_usage(s for launch in new for s in launch.shares)
    started = tuple(RunningTask(launch.key, launch.request, launch.shares, request.now, None)
                    for launch in new)
    return replace(request, snapshot=snapshot, running=(*request.running, *started))


def requeue(airflow_key: Any, reason: str) -> str:
    """Clear try ``airflow_key`` so that Airflow stops it and runs it again without using a retry.

    A running instance becomes ``restarting`` (Airflow's supervisor then terminates the task and
    the scheduler schedules it again with ``max_tries`` raised); a queued one goes back to
    scheduling. The note says it was preempted. Returns what was done.
    """
    from airflow.models.taskinstance import TaskInstance, clear_task_instances
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import select

    ti_model = TaskInstance
    with create_session() as session:
        ti = session.scalars(select(ti_model).where(
            ti_model.dag_id == airflow_key.dag_id, ti_model.task_id == airflow_key.task_id,
            ti_model.run_id == airflow_key.run_id, ti_model.map_index == airflow_key.map_index,
        )).one_or_none()
        if ti is None or ti.try_number != airflow_key.try_number:
            return "superseded; nothing to stop"
        if ti.state not in (TaskInstanceState.RUNNING, TaskInstanceState.QUEUED):
            return f"already {ti.state}; nothing to stop"
        ti.note = f"gpusched: try {ti.try_number} {reason}; requeued (not a failed try)"[:1000]
        clear_task_instances([ti], session, dag_run_state=False)
        return f"cleared (was {airflow_key.try_number}: {ti.state})"
