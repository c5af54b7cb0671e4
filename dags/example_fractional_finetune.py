"""Fractional GPUs: two BERT-like fine-tunes sharing one device, half a GPU each.

Each ``finetune_*`` task asks for ``gpus=0.5`` with 16 GiB of device memory. The GPU executor
packs both onto one NVIDIA device (MPS thread percentage 50, a pinned memory limit and
``GPUSCHED_MEMORY_LIMIT_BYTES`` in each task's environment) and the two run side by side.
Training is simulated numerically; ``GPUSCHED_EXAMPLE_STEPS`` (default 80) and
``GPUSCHED_EXAMPLE_STEP_SECONDS`` (default 0.1) size it.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu

SHARE = gpu(gpus=0.5, memory="16GiB", vendor="nvidia", tenant="nlp", expected_duration="20m")


@dag(
    dag_id="example_fractional_finetune",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["gpusched", "example"],
    doc_md=__doc__,
)
def example_fractional_finetune() -> None:
    def finetune(name: str, seed: int) -> dict[str, object]:
        import time

        import numpy as np

        allocation = json.loads(os.environ.get("GPUSCHED_ALLOCATION") or "{}")
        print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")
        print(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')} "
              f"GPUSCHED_MEMORY_LIMIT_BYTES={os.environ.get('GPUSCHED_MEMORY_LIMIT_BYTES')}")
        print(f"GPUSCHED_ALLOCATION node={allocation.get('node')} uuids={allocation.get('uuids')} "
              f"milli={allocation.get('milli')}")
        steps = int(os.environ.get("GPUSCHED_EXAMPLE_STEPS", "80"))
        pause = float(os.environ.get("GPUSCHED_EXAMPLE_STEP_SECONDS", "0.1"))
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(1024, 32))  # "sentence embeddings"
        y = (x @ rng.normal(size=32) > 0).astype(float)  # binary sentiment labels
        w = np.zeros(32)
        loss = float("nan")
        for step in range(1, steps + 1):
            p = 1.0 / (1.0 + np.exp(-(x @ w)))
            loss = float(-np.mean(y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12)))
            w -= 0.8 * x.T @ (p - y) / len(y)
            print(f"[{name}] step {step}/{steps} loss={loss:.4f}")
            time.sleep(pause)
        return {"task": name, "final_loss": loss, "uuids": allocation.get("uuids")}

    @task(**SHARE)
    def finetune_sentiment() -> dict[str, object]:
        return finetune("sentiment", 1)

    @task(**SHARE)
    def finetune_ner() -> dict[str, object]:
        return finetune("ner", 2)

    @task
    def compare(a: dict[str, object], b: dict[str, object]) -> None:
        shared = a["uuids"] == b["uuids"]
        print(f"{a['task']} loss {a['final_loss']:.4f}, {b['task']} loss {b['final_loss']:.4f}; "
              f"same device: {shared} ({a['uuids']})")

    compare(finetune_sentiment(), finetune_ner())


example_fractional_finetune()
