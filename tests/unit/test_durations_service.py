"""The Gittins index of attained service (gpusched.durations.service): definition, groups, fallback."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpusched.durations import FinishedRun, ServiceHistory, ServiceModel
from gpusched.durations.predictor import GroupKey
from gpusched.durations.service import (
    aged_index,
    gittins_index,
    gpu_seconds,
    las_index,
    outranks,
    queue_rank,
)
from gpusched.errors import ConfigurationError
from gpusched.request import GPURequest

ONE = GPURequest.build(gpus=1, tenant="vc")


def _runs(durations: list[float], gpus: int = 1, tenant: str = "vc", task: str = "") -> list[FinishedRun]:
    return [FinishedRun(task, tenant, gpus * 1000, "any", d) for d in durations]


def _brute(samples: list[float], attained: float) -> float | None:
    """The definition: max over quanta Δ of P(S − a ≤ Δ | S > a) / E[min(S − a, Δ) | S > a]."""
    tail = [s - attained for s in samples if s > attained]
    if not tail:
        return None
    best = 0.0
    for delta in np.linspace(1e-6, max(tail), 20001).tolist() + tail:
        done = sum(1 for r in tail if r <= delta) / len(tail)
        spent = sum(min(r, delta) for r in tail) / len(tail)
        best = max(best, done / spent)
    return best


def _index(samples: list[float], attained: float) -> float | None:
    ordered = np.sort(np.asarray(samples, dtype=float))
    return gittins_index(ordered, np.concatenate(([0.0], np.cumsum(ordered))), attained)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_index_is_the_gittins_definition(seed: int) -> None:
    rng = random.Random(seed)
    samples = [round(rng.lognormvariate(6, 2), 1) for _ in range(25)]
    for attained in (0.0, float(np.median(samples)), max(samples) * 0.9):
        assert _index(samples, attained) == pytest.approx(_brute(samples, attained), rel=1e-3)
    assert _index(samples, max(samples)) is None


def test_a_job_past_most_of_its_groups_run_times_gets_a_lower_index() -> None:
    # 90 % of the group's runs take a minute, 10 % ten hours.
    history = ServiceHistory.learn(_runs([60.0] * 27 + [36_000.0] * 3))
    fresh = history.index(ONE, "", 0.0)
    outlived = history.index(ONE, "", 600.0)  # longer than 90 % of its group's runs
    assert fresh.basis == "tenant+gpus" and fresh.runs == 30
    assert outlived.value < fresh.value / 100
    assert fresh.value == pytest.approx(27 / (27 * 60 + 3 * 60))
    assert outlived.value == pytest.approx(1 / (36_000 - 600))
    assert "30 past 1-GPU runs of tenant vc" in fresh.describe()


def test_service_is_gpu_time_and_groups_follow_the_predictor() -> None:
    # Two-GPU runs of 100 s are 200 GPU-s of service; the task group beats the tenant's.
    history = ServiceHistory.learn(_runs([100.0] * 20, gpus=2) + _runs([5000.0] * 20, gpus=2, task="d/t"))
    two = GPURequest.build(gpus=2, tenant="vc")
    assert gpu_seconds(two, 100.0) == 200.0
    by_task = history.index(two, "d/t", 0.0)
    assert by_task.basis == "task" and by_task.value == pytest.approx(1 / 10_000)
    # A job beyond every run of its task falls back to a coarser group with longer runs: none
    # here beyond 10,000 GPU-s, so to least attained service.
    assert history.index(two, "d/t", 10_001.0).basis == "las"
    items = [(two, "d/t", 0.0), (two, "", 50.0), (two, "d/t", 20_000.0), (ONE, "x", 0.0)]
    assert history.index_values(items) == [pytest.approx(history.index(r, t, a).value) for r, t, a in items]


def test_too_little_history_falls_back_to_discretised_las() -> None:
    history = ServiceHistory.learn(_runs([60.0] * 19))  # one short of min_runs
    bounds = ServiceModel().las_bounds_s
    assert history.index(ONE, "", 0.0).basis == "las"
    assert [las_index(a, bounds) for a in (0.0, 3599.0, 3600.0, 40_000.0, 1e9)] == [
        1 / 3600, 1 / 3600, 1 / 36_000, 1 / 360_000, 1 / 360_000]
    # Jobs in one queue have equal indices: neither may preempt the other.
    assert not outranks(las_index(10.0, bounds), las_index(3000.0, bounds), 2.0)
    assert outranks(las_index(10.0, bounds), las_index(4000.0, bounds), 2.0)


def test_history_is_immutable_and_windowed() -> None:
    model = ServiceModel(window=20, min_runs=20)
    old = ServiceHistory.learn(_runs([60.0] * 20), model)
    new = old.with_runs(_runs([6000.0] * 20))
    assert old.index(ONE, "", 0.0).value == pytest.approx(1 / 60)
    assert new.index(ONE, "", 0.0).value == pytest.approx(1 / 6000)  # the old runs left the window
    assert new.learned == 40 and old.learned == 20


def test_margin_aging_and_rank() -> None:
    assert not outranks(2.0, 1.0, 2.0) and outranks(2.01, 1.0, 2.0)
    assert aged_index(1.0, 86_400.0, 86_400.0) == pytest.approx(2.0)
    assert queue_rank(0.25) == pytest.approx(2.0) and queue_rank(1.0) < queue_rank(0.5)


@pytest.mark.parametrize("bad", [{"min_runs": 0}, {"window": 5, "min_runs": 10}, {"margin": 0.5},
                                 {"las_bounds_s": (10.0, 5.0)}, {"min_tail": 0}])
def test_bad_constants_say_what_to_do(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError, match=r"service model: .* e\.g\. the defaults"):
        ServiceModel(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(4))
def test_cached_index_values_equal_fresh_ones_as_the_history_grows(seed: int) -> None:
    """IndexCache reuses a value only while its groups are unchanged: over a growing history, the
    cached answers equal the uncached ones and :meth:`ServiceHistory.index` exactly."""
    from gpusched.durations.service import IndexCache

    rng = random.Random(seed)
    tenants = ["a", "b", "c"]
    history = ServiceHistory.learn(
        _runs([rng.lognormvariate(7, 2) for _ in range(30)], tenant="a"), ServiceModel(min_runs=5))
    cache = IndexCache()
    jobs = [(GPURequest.build(gpus=rng.choice([1, 2, 4]), tenant=rng.choice(tenants)), rng.choice(["", "t1"]),
             rng.choice([0.0, 0.0, 500.0, 5000.0, 50_000.0])) for _ in range(40)]
    reused = 0
    chains = [_chain(r, t) for r, t, _ in jobs]
    names = [f"j{n}" for n in range(len(jobs))]
    for _ in range(60):
        reused += sum(cache.get(history, names[n], chains[n], a) is not None
                      for n, (_, _, a) in enumerate(jobs))
        cached = history.index_values(jobs, chains, (cache, names))
        fresh = history.index_values(jobs)
        assert cached == fresh
        # Asked again in the same history: known without comparing groups, the same values.
        assert [cache.known(history, names[n], a) for n, (_, _, a) in enumerate(jobs)] == cached
        assert cached == [history.index(r, t, a).value for r, t, a in jobs]
        gpus = rng.choice([1, 2, 4])
        history = history.with_runs([FinishedRun("t1" if rng.random() < 0.3 else "", rng.choice(tenants),
                                                 gpus * 1000, "any", rng.lognormvariate(7, 2))])
        assert all(cache.known(history, name, a) is None for name, (_, _, a) in zip(names, jobs, strict=True))
    assert reused > 0  # values outlived runs added to other groups


def _chain(request: GPURequest, task: str) -> tuple[GroupKey, ...]:
    from gpusched.durations import group_keys

    return group_keys(FinishedRun.of(request, task, 0.0))
