"""One speed rule for the greedy chooser and the genetic objective (gpusched.placement.speeds)."""

from __future__ import annotations

import numpy as np

from gpusched.placement import PendingTask, Policy
from gpusched.placement.engine import Placer
from gpusched.placement.ga_objective import DEFAULT_DURATION_S, Problem
from gpusched.placement.index import fleet_index
from gpusched.placement.speeds import model_speeds, relative_speeds
from gpusched.quota.policy import QuotaState
from gpusched.request import GPURequest
from gpusched.scheduler.cycle import CycleReply, CycleRequest, PendingWork, decide
from gpusched.sim.fleets import gavel_fleet
from gpusched.throughputs import parse_throughputs

# A job type that runs 10× faster on a K80 than on the others: the table must overrule the catalog.
TABLE = {"odd": {"K80": 10.0, "V100-SXM2-16GB": 1.0, "P100-PCIE-16GB": 2.0}}


def _problem(policy: Policy) -> Problem:
    snapshot = gavel_fleet(per_type=4)
    return Problem(fleet_index(snapshot), snapshot, policy, 0.0, (1.0, 1.0, 0.1), 6, 4 * 3600.0)


def test_greedy_and_the_optimiser_read_the_same_speeds() -> None:
    policy = Policy.named("gpusched", throughput=TABLE)
    placer = Placer(gavel_fleet(per_type=4), policy)
    for job_type in ("odd", None, "unknown"):
        assert np.array_equal(placer.model_speed(job_type)[0], model_speeds(policy, placer.index, job_type))


def test_the_objective_values_run_time_by_the_job_types_table() -> None:
    policy = Policy.named("gpusched", throughput=TABLE)
    problem = _problem(policy)
    names = list(problem.index.model_names)
    every = np.arange(len(names))
    typed = PendingTask("t", GPURequest.build(gpus=1), 0.0, job_type="odd")
    run = dict(zip(names, problem.runtime_s(typed, every), strict=True))
    # Unknown duration: 1 h on the fastest model for this type (K80), 10× on a V100, 5× on a P100.
    assert run["K80"] == DEFAULT_DURATION_S
    assert run["V100-SXM2-16GB"] == 10 * DEFAULT_DURATION_S
    assert run["P100-PCIE-16GB"] == 5 * DEFAULT_DURATION_S
    # An expected duration, where the task has one, is the run time on that fastest model.
    timed = PendingTask("u", GPURequest.build(gpus=1, expected_duration="30m"), 0.0, job_type="odd")
    assert dict(zip(names, problem.runtime_s(timed, every), strict=True))["K80"] == 1800
    # A task of no known type keeps the catalog's A100-equivalent speeds (the V100 beats the K80).
    plain = PendingTask("p", GPURequest.build(gpus=1), 0.0)
    catalog = dict(zip(names, problem.runtime_s(plain, every), strict=True))
    assert catalog["V100-SXM2-16GB"] < catalog["P100-PCIE-16GB"] < catalog["K80"]
    assert np.array_equal(problem.speed(plain), relative_speeds(policy, problem.index, None))


def test_the_optimisers_best_candidate_follows_the_table() -> None:
    problem = _problem(Policy.named("gpusched", throughput=TABLE))
    blocked = np.zeros(problem.index.n_devices, dtype=bool)
    typed = PendingTask("t", GPURequest.build(gpus=1), 0.0, job_type="odd")
    plain = PendingTask("p", GPURequest.build(gpus=1), 0.0)
    best_typed = problem.candidates(typed, blocked)[0]
    best_plain = problem.candidates(plain, blocked)[0]
    assert problem.index.model_names[problem.index.dev_model[best_typed.devices[0]]] == "K80"
    assert problem.index.model_names[problem.index.dev_model[best_plain.devices[0]]] == "V100-SXM2-16GB"


def test_the_executors_replan_gives_the_fast_gpu_to_the_job_that_gains_most() -> None:
    # The executor's cycle (the same optimiser and table as the simulator): one V100, one P100.
    # "a" (first in the queue) is barely faster on the V100, "b" ten times: greedy seats "a" on the
    # V100; only an objective that reads the table sees that swapping them saves ~9 h.
    table = parse_throughputs({"a": {"V100": 1.1, "P100": 1.0, "K80": 0.01},
                               "b": {"V100": 10.0, "P100": 1.0, "K80": 0.01}})
    policy = Policy.named("gpusched", throughput=table)
    fleet = gavel_fleet(per_type=1, gpus_per_server=1)
    pending = (PendingWork("a", GPURequest.build(gpus=1, job_type="a"), 1.0),
               PendingWork("b", GPURequest.build(gpus=1, job_type="b"), 2.0))

    def model_of(decision: CycleReply, key: str) -> str:
        launch = next(x for x in decision.launches if x.key == key)
        return fleet.device(launch.shares[0].uuid).model

    greedy = decide(CycleRequest(pending, fleet, policy, (), 10.0, QuotaState.unlimited()))
    assert (model_of(greedy, "a"), model_of(greedy, "b")) == ("V100-SXM2-16GB", "P100-PCIE-16GB")
    replanned = decide(CycleRequest(pending, fleet, policy, (), 10.0, QuotaState.unlimited(),
                                    replan_budget_ms=60, seed=1))
    assert (model_of(replanned, "a"), model_of(replanned, "b")) == ("P100-PCIE-16GB", "V100-SXM2-16GB")
