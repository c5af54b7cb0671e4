"""Run-time estimates learnt from history (pure): how long will a task without ``expected_duration`` run?

In the spirit of Helios' QSSF (Hu et al., SC '21): a task's duration is predicted from the
finished runs of similar tasks, most specific group first — the same DAG task (or trace job name)
with the same tenant, GPU count and model constraint; then the tenant's runs of that GPU count;
then the tenant's runs; then the whole fleet's. The executor (:mod:`gpusched.scheduler.durations`)
feeds it from the ledger's finished allocations, the simulator (:mod:`gpusched.sim.durations`)
from the jobs that have finished so far in the replay; both rewrite the waiting requests through
:func:`with_prediction` before placement, so the policy's shortest-expected-GPU-time-first order,
its reservations and backfill use the estimate. :mod:`gpusched.durations.service` turns the same
groups' run-time distributions into each job's Gittins index given the GPU-time it has had
(preemption and queue order by expected remaining service, ``preemption = service``).
"""

from gpusched.durations.predictor import (
    BASES,
    DurationModel,
    DurationPredictor,
    FinishedRun,
    Prediction,
    PredictionErrors,
    group_keys,
    model_label,
    prediction_errors,
    replay_errors,
    with_prediction,
)
from gpusched.durations.service import ServiceHistory, ServiceIndex, ServiceModel

__all__ = [
    "BASES",
    "DurationModel",
    "DurationPredictor",
    "FinishedRun",
    "Prediction",
    "PredictionErrors",
    "ServiceHistory",
    "ServiceIndex",
    "ServiceModel",
    "group_keys",
    "model_label",
    "prediction_errors",
    "replay_errors",
    "with_prediction",
]
