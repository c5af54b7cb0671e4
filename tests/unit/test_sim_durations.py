"""Predicted durations in the simulator: learnt online from finished jobs only, and they change the order."""

from __future__ import annotations

from gpusched.durations import DurationModel, FinishedRun
from gpusched.placement import Policy
from gpusched.request import GPURequest
from gpusched.sim.engine import SimJob, SimResult, simulate
from gpusched.sim.fleets import uniform_fleet

_ONE = GPURequest(count=1, tenant="a")


def _jobs() -> list[SimJob]:
    """One GPU. Three runs each of a short (10 s) and a long (1,000 s) task, one after the other;
    then a blocker, and while it runs the long task arrives before the short one."""
    jobs, t = [], 0.0
    for i in range(3):
        for name, run in (("short", 10.0), ("long", 1000.0)):
            jobs.append(SimJob(f"{name}{i}", _ONE, t, run, job_type=name))
            t += run + 5
    jobs.append(SimJob("blocker", _ONE, t, 100.0, job_type="blocker"))
    jobs.append(SimJob("long-late", _ONE, t + 1, 1000.0, job_type="long"))
    jobs.append(SimJob("short-late", _ONE, t + 2, 10.0, job_type="short"))
    return jobs


def _starts(result: SimResult) -> dict[str, float]:
    return {r.key: r.start_s for r in result.records}


def test_predictions_learnt_from_finished_jobs_put_the_short_task_first() -> None:
    fleet = uniform_fleet(1, 1, "P100")
    fifo = simulate(_jobs(), fleet, Policy.named("gpusched"))
    learnt = simulate(_jobs(), fleet, Policy.named("gpusched"), predict_durations=DurationModel())
    # No estimates: the queue is FIFO, so the long task goes first.
    assert _starts(fifo)["long-late"] < _starts(fifo)["short-late"]
    assert fifo.durations is None
    # Predicted from the three finished runs of each task: the short task goes first.
    assert _starts(learnt)["short-late"] < _starts(learnt)["long-late"]
    report = learnt.durations
    assert report is not None and report["learned_runs"] == 9  # every job, once it had finished
    # No oracle: the first jobs had no finished history to learn from.
    assert report["jobs_without_estimate"] >= 3
    errors = report["errors"]
    assert errors["by_basis"]["task"] == {"count": 2, "median_ape_pct": 0.0}
    assert report["jobs_predicted"] == errors["predicted"] >= 2


def test_warm_up_history_predicts_from_the_first_job() -> None:
    fleet = uniform_fleet(1, 1, "P100")
    history = [FinishedRun.of(_ONE, name, run) for name, run in (("short", 10.0), ("long", 1000.0))
               for _ in range(3)]
    jobs = [SimJob("blocker", _ONE, 0.0, 100.0, job_type="blocker"),
            SimJob("long", _ONE, 1.0, 1000.0, job_type="long"),
            SimJob("short", _ONE, 2.0, 10.0, job_type="short")]
    result = simulate(jobs, fleet, Policy.named("gpusched"), predict_durations=DurationModel(),
                      duration_history=history)
    assert _starts(result)["short"] < _starts(result)["long"]
    assert result.durations is not None and result.durations["warm_up_runs"] == 6
    # The blocker's task is unknown: it was predicted from tenant a's six runs (median 505 s).
    assert result.durations["errors"]["by_basis"]["tenant+gpus"]["count"] == 1


def test_an_authors_estimate_is_kept() -> None:
    fleet = uniform_fleet(1, 1, "P100")
    given = GPURequest(count=1, tenant="a", expected_duration_s=50)
    jobs = [SimJob("a", given, 0.0, 50.0, job_type="x"), SimJob("b", given, 100.0, 50.0, job_type="x")]
    history = [FinishedRun.of(_ONE, "x", 9999.0)] * 3
    result = simulate(jobs, fleet, Policy.named("gpusched"), predict_durations=DurationModel(),
                      duration_history=history)
    assert result.durations is not None
    assert result.durations["jobs_with_given_estimate"] == 2 and result.durations["jobs_predicted"] == 0


def test_kept_rewrites_equal_fresh_predictions_as_runs_are_learnt() -> None:
    """OnlineDurations reuses a job's rewritten work while the predictor groups its prediction read
    are unchanged (and keeps the object when a new prediction gives the same duration): after
    every refresh its answers equal the executors' rewrite made afresh, and some are reused."""
    import random

    from gpusched.scheduler.cycle import PendingWork
    from gpusched.scheduler.durations import predict_pending
    from gpusched.sim.durations import OnlineDurations

    rng = random.Random(3)
    tenants, gpus = ["a", "b", "c"], [1, 2, 4]
    online = OnlineDurations(DurationModel(min_runs=3, recent=5), refresh_s=0.0)
    work = tuple(PendingWork(f"w{n}", GPURequest(count=rng.choice(gpus), tenant=rng.choice(tenants)), 0.0)
                 for n in range(30))
    kept = 0
    before = online.pending(work)
    for t in range(1, 80):
        request = GPURequest(count=rng.choice(gpus), tenant=rng.choice(tenants))
        online.finished(SimJob(f"done{t}", request, 0.0, 1.0), rng.choice([60.0, 600.0, 6000.0]))
        online.refresh(float(t))
        now = online.pending(work)
        fresh, _ = predict_pending(work, online.predictor, online.name)
        assert [w.request for w in now] == [w.request for w in fresh]
        kept += sum(a is b and a is not w for a, b, w in zip(now, before, work, strict=True))
        before = now
    assert kept > 0
