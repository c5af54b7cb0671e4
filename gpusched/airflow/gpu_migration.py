"""Migration between GPU types in the GPU executors: ``[gpusched] preemption = migrate``.

The same pure rule as the simulator's ``migrate`` mode
(:func:`gpusched.placement.migration.plan_migrations`, the Gavel benchmark's column): at most
every ``migration_interval_seconds`` the executor hands it its running tasks, each with its job
type (``gpu(job_type=...)``) and the ``throughput_file`` table in the policy, the restart cost
``migration_restart_seconds`` and the interval as the horizon (``migration_horizon = age``: a
task's run time at least). Only this executor's single-GPU tasks may move; gang members, tasks
being preempted or moved and tasks younger than ``preemption_min_runtime_seconds`` stay.

Each move of try ``N`` (from model ``a`` to devices of model ``b``):

1. **hold**: the target devices are allocated in the ledger at once under the key of try
   ``N+1`` (one transaction that re-checks capacity: nothing is double-booked; if they were
   taken meanwhile the move is dropped). A target that another mover still holds (an exchange,
   or a device a mover frees) is claimed when that mover's old try has released it, before this
   executor's next placement; if another scheduler takes it first, the next try still runs on a
   device of model ``b`` when one is free (its pin), or waits for one;
2. **pin**: try ``N+1`` is pinned to model ``b`` in the ledger's overrides table
   (:meth:`gpusched.ledger.Ledger.pin_try`, exactly that try; the fault chain's overrides of
   later tries are untouched). When try ``N+1`` is queued, the executor launches it on the held
   devices (the allocation already under its key, as after a scheduler restart);
3. **notice**: a ``migrated`` ledger event, a line in try ``N``'s log, an Audit Log row
   ``gpusched.migrated``, the ledger's notice that ``gpusched.airflow.checkpoint.preempted()``
   reads; then the preemption path (:class:`gpusched.airflow.gpu_preemption.Preemptor`): after a
   checkpoint or the grace the try is cleared, stopped by Airflow and requeued **without using a
   retry**; its devices are released with the reason ``moving to <b> …; requeued``.

A move is given up (hold released, pin removed, event ``migration_abandoned``) when try
``N+1`` has not started ``MIGRATION_REQUEUE_WAIT_S`` after try ``N`` ended (it finished before
being stopped, or was failed): its next try, if any, is placed as usual.

Each move in flight is also written to the ledger (:meth:`gpusched.ledger.Ledger.record_move`,
after its hold and before its pin) and forgotten when it is done or given up, so a restarted
executor (a new object over the same ledger, same holder) picks it up (:meth:`Migrator.restore`,
before its first reconcile, which then leaves the held devices alone): the hold is kept for try
``N+1`` (or held again when it was lost), the pin is written again if it was missing, an old try
still running under this executor is stopped after its grace as before, and the next try is
launched on the held devices; a move whose next try does not come within
``MIGRATION_REQUEUE_WAIT_S`` of the restart (or of the old try's end), or every move when
``preemption`` is no longer ``migrate``, is given up with its hold released and its pin removed.
A move whose next try had already started is just forgotten (its pin removed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from gpusched import settings
from gpusched.airflow.executor_compat import save_task_event
from gpusched.airflow.gpu_preemption import Preemptor
from gpusched.airflow.task_log import append_task_log
from gpusched.errors import AllocationConflictError, ConfigurationError
from gpusched.ledger.moves import MoveIntent
from gpusched.placement.migration import MIGRATE, MigrationRequest, Move, plan_migrations
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import running_tasks
from gpusched.scheduler.keys import parse_ti_key, task_of, ti_key
from gpusched.scheduler.preemption import Eviction
from gpusched.scheduler.quota import cycle_quota
from gpusched.throughputs import load_throughputs

__all__ = ["MIGRATION_REQUEUE_WAIT_S", "MigrationCore", "Migrator", "Moving", "throughput_table"]

if TYPE_CHECKING:  # typing only: the ledger loads its SQL tables, Airflow's executor its models
    from airflow.executors.base_executor import BaseExecutor, ExecutorConf
    from airflow.models.taskinstancekey import TaskInstanceKey

    from gpusched.placement import Policy
    from gpusched.scheduler.ledger_store import LedgerStore

MIGRATION_REQUEUE_WAIT_S = 180.0
"""How long after a moved try ended its next try may take to start on the held devices."""


def throughput_table(conf: ExecutorConf | None) -> dict[str, dict[str, float]]:
    """``[gpusched] throughput_file`` read (empty setting: no table)."""
    path = settings.get_str("throughput_file", conf).strip()
    if not path:
        return {}

    return load_throughputs(path)


class MigrationCore(Protocol):
    """What the migrator uses of :class:`~gpusched.airflow.gpu_scheduling.GPUScheduling`."""

    executor: BaseExecutor
    conf: ExecutorConf
    holder: str
    process: Any  # a HolderProcess once the executor started (gpusched.ledger.liveness)
    gpu_running: dict[TaskInstanceKey, str]
    gangs: dict[str, set[TaskInstanceKey]]
    preemption: Preemptor
    clock: Callable[[], float]

    @property
    def log(self) -> logging.Logger: ...

    @property
    def ledger(self) -> LedgerStore: ...


@dataclass
class Moving:
    """One move in flight: try ``old_key`` stops, its next try ``next_key`` runs on ``move.placement``."""

    old_key: str
    next_key: str
    airflow_key: TaskInstanceKey
    move: Move
    request: GPURequest  # pinned to the target model (steers a placement if the hold is lost)
    author: GPURequest  # what the ledger records, so the task may move again later
    at: float
    held: bool = False
    ended_at: float | None = None
    reason: str = ""
    deadline: float = 0.0
    restored: bool = False  # read back after a restart: the old try's end is read from the ledger

    def intent(self, holder: str) -> MoveIntent:
        """What the ledger keeps of this move (:class:`gpusched.ledger.moves.MoveIntent`)."""
        m = self.move
        return MoveIntent(self.next_key, self.old_key, holder, m.from_model, m.to_model, m.shares,
                          m.placement, m.gain, self.request, self.author, self.reason, self.at, self.deadline)


class Migrator:
    """Runs the migration rule over this executor's running tasks (see the module docstring)."""

    def __init__(self, core: MigrationCore, *, lease_s: int = 600) -> None:
        self.core = core
        self.lease_s = lease_s
        self.enabled = settings.get_str("preemption", core.conf).strip().lower() == MIGRATE
        self.interval_s = settings.get_float("migration_interval_seconds", core.conf)
        self.restart_s = settings.get_float("migration_restart_seconds", core.conf)
        self.min_runtime_s = settings.get_float("preemption_min_runtime_seconds", core.conf)
        horizon = settings.get_str("migration_horizon", core.conf).strip().lower()
        if horizon not in ("round", "age"):
            raise ConfigurationError(f"[gpusched] migration_horizon = {horizon!r} is not round or age; "
                                     "e.g. migration_horizon = round")
        self.by_age = horizon == "age"
        if self.enabled and not (self.interval_s > 0 and self.restart_s >= 0):
            raise ConfigurationError("[gpusched] migration_interval_seconds must be > 0 and "
                                     "migration_restart_seconds >= 0; e.g. 360 and 60")
        self.moving: dict[str, Moving] = {}  # next try's ledger key -> move in flight
        self._last = 0.0
        self._restored = False

    def holds(self, ledger_key: str) -> bool:
        """Whether ``ledger_key`` is the next try of a move in flight (its devices held or to be)."""
        self.restore()
        return ledger_key in self.moving

    def held_keys(self) -> set[str]:
        """Ledger keys of the held allocations (reconcile must leave them alone)."""
        self.restore()
        return {k for k, m in self.moving.items() if m.held}

    # ---- every heartbeat ---------------------------------------------------------------------

    def tick(self, policy: Policy, now: float) -> list[Moving]:
        """Claim freed targets and finish or give up moves; run the rule when its interval is over."""
        self.claim(now)
        return self.consider(policy, now)

    def consider(self, policy: Policy, now: float | None = None) -> list[Moving]:
        """Run the rule if ``migration_interval_seconds`` have passed; start the moves it proves."""
        now = self.core.clock() if now is None else now
        self.restore(now)
        if not self.enabled or now - self._last < self.interval_s:
            return []
        self._last = now
        ledger = self.core.ledger
        snapshot, active = ledger.cycle_view(now)
        running = running_tasks(active)
        quota = cycle_quota(ledger, snapshot, now)  # the proof places as the cycle does
        mine = set(self.core.gpu_running.values())
        gang_members = {self.core.gpu_running.get(k) for ks in self.core.gangs.values() for k in ks}
        stopping = set(self.core.preemption.evictions) | {m.old_key for m in self.moving.values()}
        protected = frozenset(r.key for r in running
                              if r.key not in mine or r.key in gang_members or r.key in stopping)
        plan = plan_migrations(MigrationRequest(
            snapshot, tuple(running), policy, now, quota,
            job_types={r.key: r.request.job_type for r in running}, restart_s=self.restart_s,
            horizon_s=self.interval_s, min_runtime_s=self.min_runtime_s, protected=protected,
            by_age=self.by_age,
        ))
        self.core.log.debug("gpusched: migration: %s", plan.reason)
        requests = {r.key: r.request for r in running}
        by_ledger_key = {v: k for k, v in self.core.gpu_running.items()}
        # Devices the movers leave: a target among them is claimed once its mover's old try stopped.
        leaving = {s.uuid for m in (*plan.moves, *(x.move for x in self.moving.values())) for s in m.shares}
        started = [self._start(move, requests[move.key], by_ledger_key[move.key], leaving, now)
                   for move in plan.moves]
        self.claim(now)  # exchanges: targets freed by earlier movers are claimed as they stop
        return [m for m in started if m is not None]

    def _start(
        self, move: Move, request: GPURequest, airflow_key: TaskInstanceKey, leaving: set[str], now: float
    ) -> Moving | None:
        parts = parse_ti_key(move.key)
        if parts is None:
            return None
        next_key = ti_key(parts.dag_id, parts.task_id, parts.run_id, parts.try_number + 1, parts.map_index)
        pinned = replace(request, models=frozenset({move.to_model}))
        moving = Moving(move.key, next_key, airflow_key, move, pinned, request, now)
        if not self._hold(moving, now) and not all(s.uuid in leaving for s in move.placement):
            return None  # the target was taken meanwhile and no mover frees it: drop the move
        ledger = self.core.ledger
        devices = ", ".join(f"{s.node}:{s.index}" for s in move.placement)
        reason = (f"moving to {move.to_model} ({devices}) from {move.from_model}: gains "
                  f"{move.gain:.0f} best-GPU-s over {self.interval_s:.0f} s net of a "
                  f"{self.restart_s:.0f} s restart")
        grace = self.core.preemption.grace_s
        moving.reason, moving.deadline = reason, now + grace
        ledger.record_move(moving.intent(self.core.holder))  # a restarted executor completes it
        self._pin(moving, now)
        self.core.preemption.evictions[move.key] = Eviction(move.key, next_key, now, now + grace, reason)
        ledger.notify_preemption(move.key, task_of(move.key), reason, now=now)
        ledger.record_event("migrated", move.key, now=now, next_try=next_key, from_model=move.from_model,
                            from_devices=[f"{s.node}:{s.index}" for s in move.shares],
                            to_model=move.to_model, devices=[f"{s.node}:{s.index}" for s in move.placement],
                            gain_gpu_s=round(move.gain, 1), held=moving.held, grace_s=grace, reason=reason)
        self.core.log.warning("gpusched: %s %s", move.key, reason)
        append_task_log(airflow_key, f"gpusched: {reason}. Checkpoint now: this try is stopped within "
                        f"{grace:.0f} s and its next try runs on {move.to_model}; it does not use a retry",
                        level="warning")
        save_task_event(self.core.executor, event="gpusched.migrated", extra=reason, ti_key=airflow_key)
        self.moving[next_key] = moving
        return moving

    def _hold(self, moving: Moving, now: float) -> bool:
        try:
            self.core.ledger.allocate(moving.next_key, moving.author, moving.move.placement,
                                      holder=self.core.holder, lease_s=self.lease_s, now=now,
                                      process=self.core.process)
        except AllocationConflictError:
            return False
        moving.held = True
        return True

    def claim(self, now: float | None = None) -> None:
        """Hold the targets that movers' old tries have freed; finish or give up moves."""
        self.restore(now)
        if not self.moving:
            return
        now = self.core.clock() if now is None else now
        running = set(self.core.gpu_running.values())
        for next_key, moving in list(self.moving.items()):
            if next_key in running:  # the next try started: the move is done
                del self.moving[next_key]
                self.core.ledger.forget_move(next_key)
                self._unpin(moving, "the moved try started", now)
                continue
            if moving.restored and moving.ended_at is None:
                self._resume(moving, running, now)
            elif moving.ended_at is None and moving.old_key not in running:
                moving.ended_at = now
            if not moving.held:
                self._hold(moving, now)
            if moving.ended_at is not None and now - moving.ended_at > MIGRATION_REQUEUE_WAIT_S:
                self._abandon(moving, now)

    def _abandon(self, moving: Moving, now: float, why: str = "") -> None:
        self.moving.pop(moving.next_key, None)
        why = why or f"try {moving.next_key} did not start within {MIGRATION_REQUEUE_WAIT_S:.0f} s"
        if moving.held:
            self.core.ledger.release(moving.next_key, reason=f"migration abandoned: {why}", now=now)
        self.core.ledger.forget_move(moving.next_key)
        self._unpin(moving, why, now)
        self.core.ledger.record_event("migration_abandoned", moving.old_key, now=now, reason=why)
        self.core.log.warning("gpusched: migration of %s abandoned: %s", moving.old_key, why)

    def _unpin(self, moving: Moving, why: str, now: float) -> None:
        parts = parse_ti_key(moving.next_key)
        if parts is not None:
            self.core.ledger.unpin_try(parts.dag_id, parts.task_id, parts.run_id, parts.try_number,
                                       reason=why, now=now)

    def _pin(self, moving: Moving, now: float) -> None:
        parts = parse_ti_key(moving.next_key)
        if parts is not None:
            why = f"moved from {moving.move.from_model} by the migrate preemption mode"
            self.core.ledger.pin_try(parts.dag_id, parts.task_id, parts.run_id, parts.try_number,
                                     moving.request, reason=why, now=now)

    # ---- after a restart -------------------------------------------------------------------------

    def restore(self, now: float | None = None) -> list[Moving]:
        """Pick up this holder's moves in flight from the ledger (once; see the module docstring).

        Returns the moves resumed. A move whose next try already started is forgotten; with
        ``preemption`` no longer ``migrate`` every move is given up.
        """
        if self._restored:
            return []
        now = self.core.clock() if now is None else now
        ledger = self.core.ledger
        resumed: list[Moving] = []
        for intent in ledger.moves(self.core.holder):
            if intent.next_key in self.moving:
                continue
            moving = _moving_of(intent)
            if moving is None:
                ledger.forget_move(intent.next_key)
                continue
            alloc = ledger.get(intent.next_key)
            if alloc is not None and alloc.released_at is None:
                targets = sorted(s.uuid for s in intent.placement)
                if any(p.role != "executor" for p in alloc.processes) or sorted(alloc.devices) != targets:
                    ledger.forget_move(intent.next_key)  # its next try had started: the move is done
                    self._unpin(moving, "the moved try started", now)
                    continue
                moving.held = True
            if not self.enabled:
                self._abandon(moving, now, "[gpusched] preemption is no longer migrate")
                continue
            parts = parse_ti_key(moving.next_key)
            pins = ledger.request_overrides([(parts.dag_id, parts.task_id)]) if parts else []
            if parts and not any(o.pinned and o.run_id == parts.run_id and o.try_number == parts.try_number
                                 for o in pins):
                self._pin(moving, now)  # the executor stopped between recording the move and its pin
            self.moving[moving.next_key] = moving
            resumed.append(moving)
            ledger.record_event("migration_resumed", moving.old_key, now=now, next_try=moving.next_key,
                                held=moving.held, to_model=moving.move.to_model)
            self.core.log.warning("gpusched: resumed the move of %s to %s after a restart (target %s)",
                                  moving.old_key, moving.move.to_model, "held" if moving.held else "to hold")
        self._restored = True
        return resumed

    def _resume(self, moving: Moving, running: set[str], now: float) -> None:
        """A restored move: stop its old try as before if this executor runs it (adopted), or
        start the wait for the next try once the ledger says the old try ended."""
        if moving.old_key in running:
            evictions = self.core.preemption.evictions
            if moving.old_key not in evictions:
                evictions[moving.old_key] = Eviction(moving.old_key, moving.next_key, moving.at,
                                                     moving.deadline, moving.reason)
            return
        old = self.core.ledger.get(moving.old_key)
        if old is None or old.released_at is not None:
            moving.ended_at = now  # the next try gets the whole wait from here


def _moving_of(intent: MoveIntent) -> Moving | None:
    """The move in flight the ledger kept (None when its old key is not a task try)."""
    from airflow.models.taskinstancekey import TaskInstanceKey

    parts = parse_ti_key(intent.old_key)
    if parts is None:
        return None
    move = Move(intent.old_key, intent.from_model, intent.to_model, intent.shares, intent.placement,
                intent.gain)
    airflow_key = TaskInstanceKey(parts.dag_id, parts.task_id, parts.run_id, parts.try_number,
                                  parts.map_index)
    return Moving(intent.old_key, intent.next_key, airflow_key, move, intent.request, intent.author,
                  intent.notice_at, reason=intent.reason, deadline=intent.deadline, restored=True)
