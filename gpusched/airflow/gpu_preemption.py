"""Preemption in the GPU executors: stop lower-priority work so a waiting task gets its devices.

One implementation for both executors (it lives beside :class:`GPUScheduling`, the shared core).
``[gpusched] preemption`` (off | priority | partitions | service), ``preemption_grace_seconds``,
``preemption_min_runtime_seconds``, ``preemption_max_unsaved_seconds`` and
``preemption_min_rerun_seconds`` (:mod:`gpusched.settings`) drive it.

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

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gpusched import settings
from gpusched.airflow.executor_compat import save_task_event
from gpusched.airflow.task_log import append_task_log
from gpusched.errors import ConfigurationError
from gpusched.model import DeviceShare
from gpusched.placement.migration import MIGRATE
from gpusched.placement.preemption import check_mode
from gpusched.scheduler.attained import AttainedService
from gpusched.scheduler.cycle import CycleReply, CycleRequest
from gpusched.scheduler.durations import DurationHistory, task_name
from gpusched.scheduler.keys import task_of
from gpusched.scheduler.preemption import (
    Eviction,
    PreemptionFacts,
    PreemptionRules,
    Preemptions,
    Started,
    after_launches,
)
from gpusched.scheduler.service import NamedHistory, service_indices, service_ranked

__all__ = ["Eviction", "PreemptionCore", "Preemptor", "after_launches", "requeue"]

if TYPE_CHECKING:  # typing only: the ledger loads its SQL tables, Airflow's executor its models
    from airflow.executors.base_executor import BaseExecutor, ExecutorConf
    from airflow.models.taskinstancekey import TaskInstanceKey

    from gpusched.scheduler.ledger_store import LedgerStore


class PreemptionCore(Protocol):
    """What the preemptor uses of :class:`~gpusched.airflow.gpu_scheduling.GPUScheduling`."""

    executor: BaseExecutor
    conf: ExecutorConf
    gpu_running: dict[TaskInstanceKey, str]
    gangs: dict[str, set[TaskInstanceKey]]
    durations: DurationHistory  # its ``service`` history (mode service)
    attained: AttainedService  # which running tries were preempted before
    clock: Callable[[], float]

    @property
    def log(self) -> logging.Logger: ...

    @property
    def ledger(self) -> LedgerStore: ...


class Preemptor:
    """The executors' face of :class:`~gpusched.scheduler.preemption.Preemptions`: reads what
    only the executor knows (checkpoints, tries preempted before, tasks it does not own) from
    the ledger, and carries out each started preemption through Airflow (see the module
    docstring)."""

    def __init__(self, core: PreemptionCore) -> None:
        self.core = core
        # ``migrate`` is run by :mod:`gpusched.airflow.gpu_migration` (no victims for waiting work).
        self.mode = check_mode(settings.get_str("preemption", core.conf), extra=(MIGRATE,))
        self.grace_s = settings.get_float("preemption_grace_seconds", core.conf)
        self.min_runtime_s = settings.get_float("preemption_min_runtime_seconds", core.conf)
        margin = core.durations.service.model.margin if self.mode == "service" else 2.0
        try:
            rules = PreemptionRules("off" if self.mode == MIGRATE else self.mode, self.grace_s,
                                    self.min_runtime_s, margin,
                                    settings.get_float("preemption_max_unsaved_seconds", core.conf),
                                    settings.get_float("preemption_min_rerun_seconds", core.conf))
        except ValueError as exc:  # a limit out of range, named by its setting
            raise ConfigurationError(str(exc)) from None
        self.preemptions = Preemptions(rules)
        self._seen: set[str] = set()  # running ledger keys already checked for a notice (restore)

    @property
    def enabled(self) -> bool:
        return self.mode not in ("off", MIGRATE)

    @property
    def evictions(self) -> dict[str, Eviction]:
        """Victim ledger key → its eviction (preempted, or the old try of a move)."""
        return self.preemptions.evictions

    @property
    def nominated(self) -> dict[str, tuple[DeviceShare, ...]]:
        return self.preemptions.nominated

    @property
    def first_pick(self) -> frozenset[str]:
        return self.preemptions.first_pick

    # ---- before a cycle (mode service) -----------------------------------------------------------

    def indices(self, request: CycleRequest) -> dict[str, float]:
        """Ledger key → Gittins index of the pending work (aged by its wait) and of the running
        tasks, each at the service its task instance attained (earlier tries from
        ``request.attained_gpu_s``, plus the current allocation for a running one:
        :func:`~gpusched.scheduler.service.service_indices`); empty unless the mode is ``service``."""
        if self.mode != "service":
            return {}
        return service_indices(request, NamedHistory(self.core.durations.service, task_name))

    def hold_nominated(self, request: CycleRequest) -> CycleRequest:
        """:meth:`Preemptions.hold_nominated` over this executor's running tries."""
        return self.preemptions.hold_nominated(request, set(self.core.gpu_running.values()))

    def decide(self, request: CycleRequest) -> CycleReply:
        """:meth:`Preemptions.decide`: the beneficiaries whose victims have just ended first."""
        return self.preemptions.decide(request)

    def rank(self, request: CycleRequest) -> CycleRequest:
        """``request`` with its queue ordered by the tasks' Gittins indices (mode ``service``:
        :func:`~gpusched.scheduler.service.service_ranked`)."""
        if self.mode != "service":
            return request
        return service_ranked(request, NamedHistory(self.core.durations.service, task_name))

    # ---- after a cycle ---------------------------------------------------------------------------

    def consider(self, request: CycleRequest, reply: CycleReply) -> CycleReply:
        """Preempt for the most urgent task held for capacity; return ``reply`` with its hold reason."""
        if not self.enabled or not reply.holds:
            return reply
        self.restore(request.now)  # an adopted victim being stopped is never selected a second time
        seen = after_launches(request, reply)
        mine = set(self.core.gpu_running.values())
        gang_members = {self.core.gpu_running.get(k) for ks in self.core.gangs.values() for k in ks}
        facts = PreemptionFacts(
            checkpoints=self.core.ledger.checkpoint_times(mine),
            protected=frozenset(r.key for r in seen.running if r.key not in mine or r.key in gang_members),
            restarted=self.core.attained.restarted(self.core.ledger, sorted(mine)),
            indices=self.indices(seen),
        )
        reply, started = self.preemptions.consider(request, reply, facts)
        if started is not None:
            self._notify(started)
        return reply

    def _notify(self, started: Started) -> None:
        """Tell each victim of ``started``: ledger notice and event, log lines, Audit Log."""
        by_ledger_key = {v: k for k, v in self.core.gpu_running.items()}
        proof = {k: [f"{s.node}:{s.index}" for s in v] for k, v in started.plan.placement.items()}
        ledger = self.core.ledger
        for eviction in started.evictions:
            airflow_key = by_ledger_key[eviction.victim]
            ledger.notify_preemption(eviction.victim, task_of(eviction.victim), eviction.reason,
                                     now=eviction.notice_at)
            ledger.record_event("preempted", eviction.victim, now=eviction.notice_at, by=eviction.beneficiary,
                                reason=eviction.reason, lost_gpu_s=round(eviction.lost_gpu_s, 1),
                                grace_s=self.grace_s, proof=proof)
            self.core.log.warning("gpusched: %s %s", eviction.victim, eviction.reason)
            append_task_log(airflow_key, f"gpusched: {eviction.reason}. Checkpoint now: this try is "
                            f"stopped within {self.grace_s:.0f} s and requeued; it does not use a retry",
                            level="warning")
            save_task_event(self.core.executor, event="gpusched.preempted", extra=eviction.reason,
                            ti_key=airflow_key)

    # ---- every heartbeat -------------------------------------------------------------------------

    def restore(self, now: float) -> list[str]:
        """Pick up victims whose stop an earlier executor began: each running try not seen before
        (adopted after a restart, or just launched) that has a preemption notice in the ledger
        becomes an eviction again, its grace counted from the notice and its beneficiary read
        from its ``preempted`` event (nominated again: it has the first pick once they end).
        Returns their ledger keys."""
        running = set(self.core.gpu_running.values())
        new = [k for k in running if k not in self._seen and k not in self.evictions]
        self._seen = running
        if not new:
            return []
        ledger = self.core.ledger
        restored = []
        for key, row in sorted(ledger.preemption_notices(new).items()):
            events = ledger.events(1, kinds=["preempted"], subject=key)
            beneficiary = str(events[0].detail.get("by", "")) if events else ""
            notice_at = float(row.notice_at or now)
            self.preemptions.adopt(Eviction(key, beneficiary, notice_at, notice_at + self.grace_s,
                                            row.notice_reason or "preempted"))
            ledger.record_event("preemption_resumed", key, now=now, by=beneficiary, notice_at=notice_at)
            self.core.log.warning("gpusched: %s was being preempted for %s when the executor restarted; "
                                  "stopping it", key, beneficiary or "another task")
            restored.append(key)
        return restored

    def advance(self, now: float | None = None) -> None:
        """Stop the victims whose grace ran out or who checkpointed; forget those that ended."""
        now = self.core.clock() if now is None else now
        self.restore(now)
        self.preemptions.forget_ended(set(self.core.gpu_running.values()))  # their beneficiaries may start
        by_ledger_key = {v: k for k, v in self.core.gpu_running.items()}

        def checkpointed_at(key: str) -> float | None:
            saved = self.core.ledger.checkpoint(key)
            return None if saved is None else saved.at

        for eviction in self.preemptions.due(now, checkpointed_at):
            outcome = requeue(by_ledger_key[eviction.victim], eviction.reason)
            self.core.log.warning("gpusched: %s %s: %s", eviction.victim,
                                  "checkpointed" if now < eviction.deadline else "grace over", outcome)

    def release_reason(self, ledger_key: str) -> str | None:
        """The release reason of a victim whose process ended (None: not a victim)."""
        return self.preemptions.release_reason(ledger_key)


def requeue(airflow_key: TaskInstanceKey, reason: str) -> str:
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
