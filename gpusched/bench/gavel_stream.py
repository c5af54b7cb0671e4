"""Gavel's continuous-single job stream for any seed: data the benchmark was not tuned on.

Gavel's simulator (OSDI'20, paper-era commit 1f6f02e) draws its continuous-single streams from
two seeded generators: the job generator (seed + 2: a scale-factor draw that single-GPU runs
discard, the duration — with probability 0.2 ``60·10^U(3,4)`` s, else ``60·10^U(1.5,3)`` s on a
V100 —, then a job type uniformly from its job table) and the inter-arrival generator (seed + 3:
exponential gaps of mean ``3600 / rate`` s, the first job at 0). This module follows that
procedure; seed 0 gives exactly the shared ``gavel_continuous_single_rate*_seed0`` files (tested),
so other seeds are the same family of workloads on which nothing here was calibrated.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from gpusched.errors import TraceError
from gpusched.sim.traces import GAVEL_MODELS, TraceJob, load_gavel_throughputs

__all__ = ["GAVEL_JOB_TYPES", "gavel_stream"]

GAVEL_JOB_TYPES = (
    *(f"ResNet-18 (batch size {b})" for b in (16, 32, 64, 128, 256)),
    *(f"ResNet-50 (batch size {b})" for b in (16, 32, 64, 128)),
    *(f"Transformer (batch size {b})" for b in (16, 32, 64, 128, 256)),
    "A3C",
    *(f"LM (batch size {b})" for b in (5, 10, 20, 40, 80)),
    *(f"Recommendation (batch size {b})" for b in (512, 1024, 2048, 4096, 8192)),
    "CycleGAN",
)
"""Gavel's job table in its paper-era order (the order the uniform draw indexes)."""


def gavel_stream(rate: float, seed: int, count: int, throughputs: Path) -> list[TraceJob]:
    """The first ``count`` single-GPU jobs of Gavel's stream at ``rate`` jobs/h for ``seed``.

    Run times per GPU type come from the throughput table (steps on a V100 / steps per second
    there). Raises TraceError when the table lacks a job type on one of the three GPU types.
    """
    table = load_gavel_throughputs(throughputs)
    jobs_rng = random.Random(seed + 2)
    gaps_rng = random.Random(seed + 3)
    mean_gap = 3600.0 / rate
    arrival = 0.0
    out = []
    for number in range(count):
        jobs_rng.uniform(0, 1)  # Gavel draws a scale factor first, then keeps 1 for single-GPU runs
        exponent = jobs_rng.uniform(3, 4) if jobs_rng.random() >= 0.8 else jobs_rng.uniform(1.5, 3)
        v100_s = 60 * 10**exponent
        job_type = jobs_rng.choice(GAVEL_JOB_TYPES)
        key = str((job_type, 1))
        try:
            steps = v100_s * table["v100"][key]
            durations = {model: steps / table[short][key] for short, model in GAVEL_MODELS.items()}
        except (KeyError, ZeroDivisionError):
            raise TraceError(throughputs, f"has no throughput of {job_type!r} on every GPU type",
                             "use Gavel's simulation_throughputs.json") from None
        out.append(TraceJob(key=str(number), arrival_s=arrival, num_gpus=1,
                            duration_s=min(durations.values()), durations=durations, job_type=job_type))
        arrival += -math.log(1.0 - gaps_rng.random()) * mean_gap
    return out
