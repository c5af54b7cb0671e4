"""Would a DAG's GPU tasks fit a fleet, and where? (``gpusched check`` and its pytest helper.)

DAG files are parsed as Airflow's dag-processor parses them (``DagBag``, the configured safe
mode). Every GPU task (:func:`~gpusched.airflow.authoring.is_gpu_task`: plain, fractional,
hard-isolated slices) is one unit; the members of a multi-node gang
(:func:`gpusched.gang.gang_member`) are one unit together. Each unit gets one :class:`Verdict`:

* ``fits now`` — on the devices free now (a live ledger only);
* ``fits when idle`` — on the fleet with nothing running;
* ``fits only with standby nodes`` — on the idle fleet once every standby node is switched on
  (:func:`gpusched.capacity.prescale.activate_in_snapshot`);
* ``fits after a re-partition`` — a hard-isolated slice no existing MIG instance / compute
  partition holds, but a GPU of the fleet can be re-partitioned into one (the reason names it:
  dynamic MIG or an operator does it; :func:`gpusched.placement.reasons.repartition_wait`);
* ``never fits`` — not even then.

No feasibility rule of its own: each answer is the scheduling cycle's decision
(:func:`gpusched.scheduler.cycle.decide`, which places gangs with
:func:`gpusched.scheduler.gangs.place_gang`) under the configured ``[gpusched] policy`` and
``policy_parts``, so a reason reads as the queue view shows it. Only capacity is judged: tenant
budgets and partition shares (the quota file) are not. ``where`` is the placement on the idle
fleet (with standby nodes on when it needs them): node and device indices per member.

Authors use :func:`assert_gpu_tasks_fit` in their DAG tests::

    from gpusched.airflow.fit_check import assert_gpu_tasks_fit

    def test_training_dag_fits_the_fleet():
        assert_gpu_tasks_fit("dags/train.py", fleet="fleets/prod.yaml")
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from gpusched.airflow.authoring import CONFIG_KEY, request_from_executor_config
from gpusched.capacity.prescale import activate_in_snapshot
from gpusched.errors import ConfigurationError, GPURequestError
from gpusched.fleetfile import load_fleet
from gpusched.gang import GANG_KEY, gang_member
from gpusched.hardware.detect import fleet_path_from_env
from gpusched.model import DeviceShare, FleetSnapshot, Node
from gpusched.placement import Policy, RunningTask
from gpusched.placement.reasons import is_repartition_wait
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleReply, CycleRequest, Hold, PendingWork, decide
from gpusched.settings import get_str

__all__ = [
    "FitReport", "GpuUnit", "Spot", "Verdict", "assert_gpu_tasks_fit", "check_fit", "configured_policy",
    "fleet_snapshot", "gpu_units", "judge", "load_dags", "quiet",
]

_RUN_ID = "check"
"""The run a checked task is judged in (gang ids and keys need one; no run is created)."""


class Verdict(StrEnum):
    """Where a GPU task (or gang) can run, best first."""

    FITS_NOW = "fits now"
    FITS_WHEN_IDLE = "fits when idle"
    NEEDS_STANDBY = "fits only with standby nodes"
    NEEDS_REPARTITION = "fits after a re-partition"
    NEVER = "never fits"


@dataclass(frozen=True, slots=True)
class GpuUnit:
    """What the scheduler places at once: one GPU task, or every member of a multi-node gang.

    ``name`` is the task id, or the gang's name; ``work`` holds one pending workload per task
    (empty when ``problem`` says the request is invalid).
    """

    dag_id: str
    name: str
    task_ids: tuple[str, ...]
    file: str
    work: tuple[PendingWork, ...]
    problem: str = ""

    @property
    def is_gang(self) -> bool:
        """True for a multi-node gang."""
        return any(w.gang is not None for w in self.work)


@dataclass(frozen=True, slots=True)
class Spot:
    """Where one task would run: its node and its shares of devices there."""

    task_id: str
    node: str
    shares: tuple[DeviceShare, ...]
    profiles: tuple[str | None, ...]

    @property
    def devices(self) -> tuple[int, ...]:
        """The device indices on the node (as ``*_VISIBLE_DEVICES`` counts them)."""
        return tuple(s.index for s in self.shares)

    def describe(self) -> str:
        """``a-h100-1 GPU 0-3``, ``a-a100mig-1 GPU 0 (3g.40gb)``, ``a-l40s-1 GPU 2 (0.5)``."""
        parts = []
        for share, profile in zip(self.shares, self.profiles, strict=True):
            note = profile or (f"{share.milli / 1000:g}" if share.milli < 1000 else "")
            parts.append(f"{share.index}" + (f" ({note})" if note else ""))
        indices = [s.index for s in self.shares]
        whole = all(s.milli >= 1000 for s in self.shares) and not any(self.profiles)
        if whole and len(indices) > 2 and indices == list(range(indices[0], indices[-1] + 1)):
            parts = [f"{indices[0]}-{indices[-1]}"]
        return f"{self.node} GPU {','.join(parts)}"

    def to_dict(self) -> dict[str, Any]:
        """JSON form: task_id, node, devices (indices) and shares (uuid, index, milli, memory, profile)."""
        return {
            "task_id": self.task_id, "node": self.node, "devices": list(self.devices),
            "shares": [{**share.to_dict(), "profile": profile}
                       for share, profile in zip(self.shares, self.profiles, strict=True)],
        }


@dataclass(frozen=True, slots=True)
class FitReport:
    """The verdict on one :class:`GpuUnit`, why, and where it would go on the idle fleet.

    ``reason`` is the scheduler's hold reason: why it never fits, why it needs standby nodes
    (the reason on the active fleet), or why it waits now (live ledger, ``fits when idle``);
    empty when nothing holds it back.
    """

    dag_id: str
    name: str
    task_ids: tuple[str, ...]
    file: str
    request: GPURequest | None
    gang: bool
    verdict: Verdict
    reason: str
    where: tuple[Spot, ...]

    @property
    def fits(self) -> bool:
        """False only for ``never fits``."""
        return self.verdict is not Verdict.NEVER

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``gpusched check --json``."""
        return {
            "dag_id": self.dag_id, "task": self.name, "task_ids": list(self.task_ids), "file": self.file,
            "gang": self.gang, "request": self.request.to_dict() if self.request else None,
            "describe": self.request.describe() if self.request else None,
            "verdict": str(self.verdict), "fits": self.fits, "reason": self.reason,
            "where": [spot.to_dict() for spot in self.where],
        }


def load_dags(path: str | Path) -> list[Any]:
    """The DAGs of a DAG file or DAGs folder, parsed as the dag-processor does, by ``dag_id``.

    Airflow's own log lines and whatever the DAG files print are kept off stdout (so that
    ``--json`` stays JSON).

    Raises:
        ConfigurationError: the path does not exist, a DAG file fails to import (naming the
            file and its error), or no DAG is found there.
    """
    from airflow.dag_processing.dagbag import DagBag

    where = Path(path)
    if not where.exists():
        raise ConfigurationError(f"no DAG file or folder at {path}; give a DAG file or a DAGs folder")
    with quiet():
        bag = DagBag(dag_folder=str(where), load_op_links=False)
    if bag.import_errors:
        file, trace = sorted(bag.import_errors.items())[0]
        lines = [line.strip() for line in str(trace).strip().splitlines() if line.strip()]
        more = len(bag.import_errors) - 1
        also = f" ({more} more DAG file(s) fail to import)" if more else ""
        raise ConfigurationError(
            f"DAG file {file} fails to import: {lines[-1] if lines else 'unknown error'}{also}; "
            "fix the file (it is what the dag-processor would show as an import error)"
        )
    if not bag.dags:
        raise ConfigurationError(
            f"no DAG found in {path}; a DAG file must define a DAG (and, in safe mode, mention "
            "'airflow' and 'dag')"
        )
    return [bag.dags[dag_id] for dag_id in sorted(bag.dags)]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep log lines and prints off stdout (and stderr's logs) while inside: once Airflow is
    imported, it logs through logging and through structlog printing to stdout (alembic's
    migration notes when a ledger is opened, the DagBag's progress)."""
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def gpu_units(dag: Any, *, now: float = 0.0) -> list[GpuUnit]:
    """The GPU units of ``dag`` in task order (a gang where its first member is, members by rank)."""
    units: dict[str, GpuUnit] = {}  # by task id, or by gang id for the members of a gang
    file = str(getattr(dag, "fileloc", "") or "")
    for task in dag.tasks:
        config = getattr(task, "executor_config", None)
        if not isinstance(config, Mapping) or (CONFIG_KEY not in config and GANG_KEY not in config):
            continue
        try:
            request = request_from_executor_config(config)
            member = gang_member(config, dag_id=dag.dag_id, run_id=_RUN_ID)
            if request is None:
                raise GPURequestError(CONFIG_KEY, None, "a GPU request (use gpu() or gang_task)")
        except GPURequestError as exc:
            # the words the executor fails such a task with
            units[task.task_id] = GpuUnit(dag.dag_id, task.task_id, (task.task_id,), file, (),
                                          f"invalid GPU request in executor_config: {exc}")
            continue
        work = PendingWork(f"{dag.dag_id}/{task.task_id}", request, now, gang=member)
        if member is None:
            units[task.task_id] = GpuUnit(dag.dag_id, task.task_id, (task.task_id,), file, (work,))
            continue
        gang = units.get(member.gang)
        task_ids, works = (gang.task_ids, gang.work) if gang else ((), ())
        units[member.gang] = GpuUnit(dag.dag_id, member.gang.rsplit("/", 1)[-1], (*task_ids, task.task_id),
                                     file, (*works, work))
    return [_members_by_rank(unit) for unit in units.values()]


def _members_by_rank(unit: GpuUnit) -> GpuUnit:
    if not unit.is_gang:
        return unit
    ranked = sorted(zip(unit.work, unit.task_ids, strict=True),
                    key=lambda member: member[0].gang.rank if member[0].gang else 0)
    return replace(unit, task_ids=tuple(t for _, t in ranked), work=tuple(w for w, _ in ranked))


def configured_policy(conf: Any = None) -> Policy:
    """The placement policy the executor uses: ``[gpusched] policy`` changed by ``policy_parts``
    (Airflow's config, ``AIRFLOW__GPUSCHED__POLICY`` … included; their defaults without one).

    Raises:
        ConfigurationError: an unknown policy or a wrong part (one line).
    """
    if conf is None:
        from airflow.configuration import conf as airflow_conf

        conf = airflow_conf
    return Policy.configured(get_str("policy", conf), get_str("policy_parts", conf))


def fleet_snapshot(fleet: str | Path | FleetSnapshot | Sequence[Node] | None = None) -> FleetSnapshot:
    """``fleet`` as a snapshot: a fleet YAML, a snapshot, nodes, or None for the fleet the main job
    uses without real devices (``GPUSCHED_FLEET``, else the bundled default fleet).

    Raises:
        FleetFileError: the fleet file is missing or invalid (one line naming the file).
    """
    if isinstance(fleet, FleetSnapshot):
        return fleet
    if fleet is None or isinstance(fleet, str | Path):
        path = fleet_path_from_env() if fleet is None else Path(fleet)
        return FleetSnapshot(tuple(load_fleet(path)), source=f"fleet file {path}")
    return FleetSnapshot(tuple(fleet), source="nodes")


def judge(
    unit: GpuUnit,
    snapshot: FleetSnapshot,
    policy: Policy,
    *,
    live: bool = False,
    running: Sequence[RunningTask] = (),
    now: float | None = None,
) -> FitReport:
    """The verdict on ``unit`` against ``snapshot`` (see the module docstring).

    ``live``: ``snapshot`` is the ledger's fleet now, with its usage and ``running`` tasks, so
    ``fits now`` can be answered; otherwise the snapshot is judged idle whatever its usage.
    """
    at = time.time() if now is None else now
    if unit.problem:
        return _report(unit, Verdict.NEVER, unit.problem, None)
    idle = FleetSnapshot(snapshot.nodes, {}, snapshot.source, snapshot.taken_at)
    on_active = _decide(unit, idle, policy, (), at)
    if not on_active.holds:
        reason = ""
        verdict = Verdict.FITS_WHEN_IDLE
        if live:
            now_reply = _decide(unit, snapshot, policy, running, at)
            verdict = Verdict.FITS_NOW if not now_reply.holds else Verdict.FITS_WHEN_IDLE
            reason = now_reply.holds[0].reason if now_reply.holds else ""
        return _report(unit, verdict, reason, on_active)
    hold = on_active.holds[0]
    if not hold.permanent and is_repartition_wait(hold.reason):
        return _report(unit, Verdict.NEEDS_REPARTITION, hold.reason, None)
    standby = [n.name for n in snapshot.nodes if n.standby]
    if not standby:
        return _report(unit, Verdict.NEVER, hold.reason, None)
    with_standby = _decide(unit, activate_in_snapshot(idle, standby), policy, (), at)
    if not with_standby.holds:
        return _report(unit, Verdict.NEEDS_STANDBY, on_active.holds[0].reason, with_standby)
    return _report(unit, Verdict.NEVER, with_standby.holds[0].reason, None)


def _decide(unit: GpuUnit, snapshot: FleetSnapshot, policy: Policy, running: Sequence[RunningTask],
            now: float) -> _Decision:
    reply = decide(CycleRequest(unit.work, snapshot, policy, tuple(running), now, QuotaState.unlimited()))
    return _Decision(reply, snapshot)


@dataclass(frozen=True, slots=True)
class _Decision:
    reply: CycleReply
    snapshot: FleetSnapshot

    @property
    def holds(self) -> tuple[Hold, ...]:
        return self.reply.holds

    def spots(self, unit: GpuUnit) -> tuple[Spot, ...]:
        task_of = {w.key: t for w, t in zip(unit.work, unit.task_ids, strict=True)}
        return tuple(
            Spot(task_of[launch.key], launch.shares[0].node, launch.shares,
                 tuple(self.snapshot.device(s.uuid).profile for s in launch.shares))
            for launch in self.reply.launches
        )


def _report(unit: GpuUnit, verdict: Verdict, reason: str, placed: _Decision | None) -> FitReport:
    request = unit.work[0].request if unit.work else None
    where = placed.spots(unit) if placed is not None else ()
    return FitReport(unit.dag_id, unit.name, unit.task_ids, unit.file, request, unit.is_gang, verdict,
                     reason, where)


def check_fit(
    dags: Sequence[Any],
    snapshot: FleetSnapshot,
    policy: Policy,
    *,
    live: bool = False,
    running: Sequence[RunningTask] = (),
) -> list[FitReport]:
    """One report per GPU unit of ``dags`` (in order: DAG, then task), judged one by one
    (:func:`judge`): each as if it were the only work waiting."""
    now = time.time()
    return [judge(unit, snapshot, policy, live=live, running=running, now=now)
            for dag in dags for unit in gpu_units(dag, now=now)]


def assert_gpu_tasks_fit(
    dag_or_path: Any,
    fleet: str | Path | FleetSnapshot | Sequence[Node] | None = None,
    *,
    standby: bool = True,
    policy: Policy | None = None,
) -> list[FitReport]:
    """Assert that every GPU task of a DAG (a DAG object, or a DAG file or folder to parse) can run
    on ``fleet`` (see :func:`fleet_snapshot`; default: the main job's simulated fleet).

    Args:
        standby: count ``fits only with standby nodes`` as fitting (False: the active fleet must
            hold it).
        policy: the placement policy (default :func:`configured_policy`).

    Returns:
        The reports, for further assertions (``report.where[0].node`` …).

    Raises:
        AssertionError: naming each task that does not fit, its verdict and the scheduler's reason.
        ConfigurationError: a path with no DAG or a DAG file that fails to import; a bad fleet file.
    """
    dags = load_dags(dag_or_path) if isinstance(dag_or_path, str | Path) else [dag_or_path]
    reports = check_fit(dags, fleet_snapshot(fleet), policy or configured_policy())
    refused = {Verdict.NEVER} if standby else {Verdict.NEVER, Verdict.NEEDS_STANDBY}
    failing = [r for r in reports if r.verdict in refused]
    if failing:
        lines = [f"{r.dag_id}.{r.name}: {r.verdict}: {r.reason}" for r in failing]
        raise AssertionError(f"{len(failing)} GPU task(s) do not fit the fleet:\n" + "\n".join(lines))
    return reports
