"""The pre-scaling event simulation: predictive beats reactive for burst waits on a small scenario."""

from __future__ import annotations

import pytest

from gpusched.sim.prescale import PrescaleConfig, compare, generate_jobs, simulate_prescale

SMALL = PrescaleConfig(warmup_days=4, measure_days=2, model="seasonal_naive", refit_every_s=24 * 3600)


def test_jobs_are_seeded_and_have_daily_bursts() -> None:
    jobs = generate_jobs(SMALL)
    assert jobs == generate_jobs(SMALL)
    bursts = [j for j in jobs if j.burst]
    assert bursts and all(1 <= j.gpus <= 2 for j in bursts)
    hours = {int((j.arrival % 86400) // 3600) for j in bursts}
    assert hours <= {9, 10}  # the 09:00–10:30 window


def test_predictive_prescaling_cuts_burst_waits() -> None:
    result = compare(SMALL)
    reactive, predictive = result["reactive"], result["predictive"]
    assert reactive["burst_jobs"] == predictive["burst_jobs"] > 0
    # Reactive scale-out waits out the 15-minute provisioning delay at the start of each burst.
    assert reactive["burst_wait_p95_s"] > 90
    assert predictive["burst_wait_p95_s"] < reactive["burst_wait_p95_s"]
    assert predictive["activations"] > 0 and result["provisioning_delay_s"] == 900


def test_unknown_strategy() -> None:
    with pytest.raises(ValueError, match="reactive"):
        simulate_prescale(SMALL, "psychic")
