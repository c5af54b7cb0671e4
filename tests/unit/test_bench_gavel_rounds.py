"""The calibration replay of Gavel's base-mode FIFO (gpusched.bench.gavel_rounds): its mechanics."""

from __future__ import annotations

import random

import pytest

from gpusched.bench.gavel_rounds import RoundJob, gavel_fifo_replay
from gpusched.errors import ConfigurationError

TYPES = ("k80", "p100", "v100")
ONE_EACH = dict.fromkeys(TYPES, 1)


def job(key: str, arrival: float, rounds: int, v100_speed: float = 1.0) -> RoundJob:
    """A job of ``rounds`` full 360 s rounds at 1 step/s on every type (``v100_speed`` on a V100)."""
    return RoundJob(key, arrival, 360.0 * rounds, {"k80": 1.0, "p100": 1.0, "v100": v100_speed})


def test_first_job_goes_to_the_last_listed_type_and_runs_from_the_first_round() -> None:
    out = gavel_fifo_replay([job("0", 0.0, 1)], ONE_EACH, stop_after={"0"})
    assert out.bound_type == {"0": "v100"}
    assert out.finished == {"0": 360.0}


def test_a_drawn_entry_other_than_the_exhausted_type_oversubscribes_it() -> None:
    # The first draw picks which listed type is removed when V100 runs out: not V100 → every later
    # job of that update is bound to V100 too, and they take turns on its one GPU.
    seed = next(s for s in range(100) if random.Random(s).randrange(3) != 2)
    jobs = [job(str(i), 0.0, 2) for i in range(5)]
    out = gavel_fifo_replay(jobs, ONE_EACH, stop_after={j.key for j in jobs}, seed=seed)
    assert set(out.bound_type.values()) == {"v100"}
    assert out.oversubscribed_updates >= 1
    # Least time on the type first: jobs 0..4 each get one round, then job 0 its second.
    assert out.finished["0"] == 6 * 360.0
    assert max(out.finished.values()) == 10 * 360.0
    assert out.idle_worker_rounds > 0  # K80 and P100 idle while bound jobs wait


def test_when_the_exhausted_type_is_drawn_the_next_job_takes_the_next_type() -> None:
    seed = next(s for s in range(100) if random.Random(s).randrange(3) == 2)
    jobs = [job("0", 0.0, 1), job("1", 0.0, 1)]
    out = gavel_fifo_replay(jobs, ONE_EACH, stop_after={"0", "1"}, seed=seed)
    assert out.bound_type == {"0": "v100", "1": "p100"}
    assert out.finished == {"0": 360.0, "1": 360.0}


def test_arrivals_wait_for_the_next_allocation_update_even_with_free_gpus() -> None:
    # Updates at 0 and 360 (the first after time 0 is always allowed), then only every 1,920 s:
    # job 2 arrives at 500 and starts at the first round boundary >= 360 + 1920, i.e. 2520.
    jobs = [job("0", 0.0, 10), job("1", 100.0, 1), job("2", 500.0, 1)]
    out = gavel_fifo_replay(jobs, ONE_EACH, stop_after={"2"})
    assert out.finished["2"] == 2520.0 + 360.0


def test_a_completed_jobs_type_passes_to_the_head_of_the_queue() -> None:
    one_v100 = {"k80": 1, "p100": 1, "v100": 1}
    def draws(s: int) -> tuple[int, int]:
        rng = random.Random(s)
        return rng.randrange(3), rng.randrange(2)

    seed = next(s for s in range(100) if draws(s) == (2, 1))
    # 0 → V100, 1 → P100, 2 → K80 at time 0; 3 waits; when 0 finishes (faster on V100) job 3
    # inherits V100 at the next update.
    jobs = [job("0", 0.0, 1, v100_speed=2.0), job("1", 0.0, 3), job("2", 0.0, 3), job("3", 0.0, 1)]
    out = gavel_fifo_replay(jobs, one_v100, stop_after={"3"}, seed=seed)
    assert out.bound_type["3"] == "v100"


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match="not in the trace"):
        gavel_fifo_replay([job("0", 0.0, 1)], ONE_EACH, stop_after={"9"})
    with pytest.raises(ConfigurationError, match="positive speed"):
        gavel_fifo_replay([RoundJob("0", 0.0, 10.0, {"v100": 1.0})], ONE_EACH, stop_after={"0"})


def test_without_oversubscription_each_type_takes_only_its_workers() -> None:
    seed = next(s for s in range(100) if random.Random(s).randrange(3) != 2)
    jobs = [job(str(i), 0.0, 1) for i in range(4)]
    out = gavel_fifo_replay(jobs, ONE_EACH, stop_after={j.key for j in jobs}, seed=seed, oversubscribe=False)
    assert [out.bound_type[str(i)] for i in range(3)] == ["v100", "p100", "k80"]
    assert out.oversubscribed_updates == 0
    assert out.finished["3"] == 720.0  # waited one round for a freed worker
