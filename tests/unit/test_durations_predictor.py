"""The duration predictor (gpusched.durations): groups, fallbacks, robustness, immutability, errors."""

from __future__ import annotations

import math

import pytest

from gpusched.durations import (
    DurationModel,
    DurationPredictor,
    FinishedRun,
    Prediction,
    prediction_errors,
    with_prediction,
)
from gpusched.errors import ConfigurationError
from gpusched.request import GPURequest


def _req(**kwargs: object) -> GPURequest:
    return GPURequest.build(**kwargs)


def _runs(task: str, request: GPURequest, *durations: float) -> list[FinishedRun]:
    return [FinishedRun.of(request, task, d) for d in durations]


def test_most_specific_trusted_group_answers_then_coarser_ones() -> None:
    two_vision = _req(gpus=2, tenant="vision")
    runs = (
        _runs("etl/train", two_vision, 3600, 3700, 3500)  # the task itself: ~1 h
        + _runs("etl/other", two_vision, 60, 60, 60, 60)  # same tenant and size, other task
        + _runs("etl/x", _req(gpus=1, tenant="vision"), 600, 600, 600)
        + _runs("nlp/y", _req(gpus=8, tenant="nlp"), 9000, 9000, 9000)
    )
    p = DurationPredictor.learn(runs)
    task = p.predict(two_vision, "etl/train")
    assert task is not None and (task.seconds, task.basis, task.runs) == (3600, "task", 3)
    assert task.describe() == "expected 1.0 h, predicted from 3 past runs of etl/train"
    # An unknown task of the same tenant and size: the tenant's 2-GPU runs (7 of them).
    same_size = p.predict(two_vision, "etl/new")
    assert same_size is not None and same_size.basis == "tenant+gpus" and same_size.runs == 7
    assert same_size.seconds == 60 and "2-GPU runs of tenant vision" in same_size.describe()
    # A size the tenant never ran: all of the tenant's runs; an unknown tenant: the fleet.
    four = p.predict(_req(gpus=4, tenant="vision"), "etl/new")
    assert four is not None and four.basis == "tenant" and four.runs == 10
    fleet = p.predict(_req(gpus=4, tenant="audio"), "")
    assert fleet is not None and fleet.basis == "fleet" and fleet.runs == 13
    assert fleet.describe().endswith("past runs on this fleet")


def test_a_group_below_min_runs_is_not_trusted() -> None:
    req = _req(gpus=1, tenant="a")
    p = DurationPredictor.learn(_runs("d/t", req, 100, 100), DurationModel(min_runs=3, recent=10))
    assert p.predict(req, "d/t") is None  # two runs anywhere: nothing to trust yet
    p = p.with_runs(_runs("d/u", req, 5000))
    got = p.predict(req, "d/t")
    assert got is not None and got.basis == "tenant+gpus" and got.seconds == 100  # median of 100,100,5000


def test_model_constraint_and_fraction_are_part_of_the_task_group() -> None:
    a100 = _req(gpus=1, models=["A100-SXM-80GB"], tenant="t")
    t4 = _req(gpus=1, models=["T4"], tenant="t")
    half = _req(gpus=0.5, memory="10GiB", tenant="t")
    p = DurationPredictor.learn(_runs("d/t", a100, 100, 100, 100) + _runs("d/t", t4, 900, 900, 900))
    assert p.predict(a100, "d/t").seconds == 100  # type: ignore[union-attr]
    assert p.predict(t4, "d/t").seconds == 900  # type: ignore[union-attr]
    # Half a GPU is its own size group: falls back to the tenant.
    got = p.predict(half, "d/t")
    assert got is not None and got.basis == "tenant" and "0.5" not in got.group


def test_median_of_the_recent_window_resists_outliers_and_follows_change() -> None:
    req = _req(gpus=1, tenant="a")
    model = DurationModel(min_runs=3, recent=5)
    p = DurationPredictor.learn(_runs("d/t", req, 100, 110, 90, 10 * 86400), model)  # one runaway run
    assert p.predict(req, "d/t").seconds == 105  # type: ignore[union-attr]
    p = p.with_runs(_runs("d/t", req, 1000, 1000, 1000, 1000, 1000))  # the task got slower
    assert p.predict(req, "d/t").seconds == 1000  # type: ignore[union-attr]
    assert p.learned == 9


def test_with_runs_returns_a_new_predictor_and_ignores_bad_durations() -> None:
    req = _req(gpus=1, tenant="a")
    empty = DurationPredictor()
    learnt = empty.with_runs(_runs("d/t", req, 10, 20, 30, math.nan, -5, math.inf))
    assert empty.predict(req, "d/t") is None and empty.learned == 0
    assert learnt.learned == 3 and learnt.predict(req, "d/t").seconds == 20  # type: ignore[union-attr]
    assert learnt.with_runs([]) is learnt


def test_with_prediction_keeps_the_authors_estimate() -> None:
    req = _req(gpus=1, tenant="a")
    p = DurationPredictor.learn(_runs("d/t", req, 7200.4, 7200.4, 7200.4))
    given = _req(gpus=1, tenant="a", expected_duration="10m")
    assert with_prediction(given, "d/t", p) == (given, None)
    assert with_prediction(req, "d/t", None) == (req, None)
    assert with_prediction(req, "d/t", DurationPredictor()) == (req, None)
    rewritten, prediction = with_prediction(req, "d/t", p)
    assert rewritten.expected_duration_s == 7201 and prediction is not None
    assert rewritten.count == req.count and rewritten.tenant == req.tenant
    assert prediction.describe() == "expected 2.0 h, predicted from 3 past runs of d/t"


def test_prediction_errors_report_median_ape_and_per_basis_counts() -> None:
    pairs = [
        (Prediction(100, "task", 3, "runs of d/t"), 100.0),  # 0 %
        (Prediction(150, "task", 3, "runs of d/t"), 100.0),  # 50 %
        (Prediction(400, "fleet", 9, "runs on this fleet"), 100.0),  # 300 %, outside 2x
    ]
    errors = prediction_errors(pairs)
    assert errors.predicted == 3 and errors.median_ape_pct == 50.0
    assert errors.within_2x_pct == pytest.approx(66.7)
    assert errors.by_basis == {"task": {"count": 2, "median_ape_pct": 25.0},
                               "fleet": {"count": 1, "median_ape_pct": 300.0}}
    empty = prediction_errors([])
    assert empty.predicted == 0 and math.isnan(empty.median_ape_pct)


def test_model_constants_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="min_runs"):
        DurationModel(min_runs=0)
    with pytest.raises(ConfigurationError, match="recent"):
        DurationModel(min_runs=5, recent=3)


def test_replay_errors_predict_each_run_from_the_runs_before_it() -> None:
    from gpusched.durations import replay_errors

    req = _req(gpus=1, tenant="a")
    missed, errors = replay_errors(_runs("d/t", req, 100, 100, 100, 100, 400))
    assert missed == 3  # too little history for the first three
    assert errors.predicted == 2 and errors.by_basis == {"task": {"count": 2, "median_ape_pct": 37.5}}
