"""Multi-GPU training on one NVLink island: a ResNet-50-like data-parallel job on 4 GPUs.

The GPU executor gives ``train_resnet50`` four NVIDIA devices of one node that share one
NVLink/NVSwitch island; the task reads ``CUDA_VISIBLE_DEVICES`` and ``GPUSCHED_ALLOCATION`` to
show what it got. Training is simulated numerically (data-parallel SGD with an all-reduce of
the gradients), so the DAG runs anywhere. ``GPUSCHED_EXAMPLE_STEPS`` sets the number of steps
(default 120) and ``GPUSCHED_EXAMPLE_STEP_SECONDS`` the pause per step (default 0.1).

Preemption: the task saves its weights every 20 steps and reports each checkpoint
(:mod:`gpusched.airflow.checkpoint`); when the executor preempts it for a more urgent task
(``[gpusched] preemption``), it saves one more, waits to be stopped and, requeued, resumes from
the last checkpoint instead of step 1.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu

REPLICAS = 4


@dag(
    dag_id="example_multi_gpu_nvlink_training",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["gpusched", "example"],
    doc_md=__doc__,
)
def example_multi_gpu_nvlink_training() -> None:
    @task
    def prepare_dataset() -> dict[str, int]:
        """CPU task: describes the (synthetic) ImageNet-like dataset."""
        return {"samples": 4096, "features": 64, "classes": 10, "seed": 50}

    @task(**gpu(gpus=REPLICAS, vendor="nvidia", interconnect="island", memory="40GiB",
                expected_duration="30m", tenant="vision", priority="high"))
    def train_resnet50(dataset: dict[str, int]) -> dict[str, object]:
        import tempfile
        import time

        import numpy as np

        from gpusched.airflow import checkpoint

        allocation = json.loads(os.environ.get("GPUSCHED_ALLOCATION") or "{}")
        print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")
        print(f"GPUSCHED_ALLOCATION node={allocation.get('node')} devices={allocation.get('devices')} "
              f"models={allocation.get('models')} uuids={allocation.get('uuids')}")
        steps = int(os.environ.get("GPUSCHED_EXAMPLE_STEPS", "120"))
        pause = float(os.environ.get("GPUSCHED_EXAMPLE_STEP_SECONDS", "0.1"))
        rng = np.random.default_rng(dataset["seed"])
        n, d, k = dataset["samples"], dataset["features"], dataset["classes"]
        x = rng.normal(size=(n, d))
        labels = (x @ rng.normal(size=(d, k))).argmax(axis=1)
        weights = np.zeros((d, k))
        saved = os.path.join(tempfile.gettempdir(), "gpusched-checkpoints",
                             f"{(allocation.get('key') or 'local').replace('/', '_')}.npy")
        first = 1
        earlier = checkpoint.resume()  # a preempted earlier try's last checkpoint
        if earlier is not None and earlier.path and os.path.exists(earlier.path):
            weights, first = np.load(earlier.path), int(earlier.step) + 1
            print(f"resuming from step {earlier.step} ({earlier.path})")
        shards = np.array_split(np.arange(n), REPLICAS)  # one shard per GPU replica
        loss = float("nan")
        for step in range(first, steps + 1):
            grads, losses = [], []
            for shard in shards:
                logits = x[shard] @ weights
                logits -= logits.max(axis=1, keepdims=True)
                probs = np.exp(logits)
                probs /= probs.sum(axis=1, keepdims=True)
                losses.append(-np.log(probs[np.arange(len(shard)), labels[shard]] + 1e-12).mean())
                probs[np.arange(len(shard)), labels[shard]] -= 1.0
                grads.append(x[shard].T @ probs / len(shard))
            weights -= 0.5 * np.mean(grads, axis=0)  # all-reduce over the NVLink island
            loss = float(np.mean(losses))
            print(f"step {step}/{steps} loss={loss:.4f} replicas={REPLICAS}")
            if step % 20 == 0 or checkpoint.preempted():
                os.makedirs(os.path.dirname(saved), exist_ok=True)
                np.save(saved, weights)
                checkpoint.report(step=step, path=saved)
                if checkpoint.preempted():
                    print(f"preempted: checkpoint of step {step} saved; waiting to be stopped")
                    checkpoint.wait_for_stop()
            time.sleep(pause)
        return {"final_loss": loss, "steps": steps, "devices": allocation.get("devices"),
                "node": allocation.get("node")}

    @task
    def report(result: dict[str, object]) -> None:
        """CPU task: prints the training summary."""
        print(f"trained on node {result['node']} devices {result['devices']}: "
              f"final loss {result['final_loss']:.4f} after {result['steps']} steps")

    report(train_resnet50(prepare_dataset()))


example_multi_gpu_nvlink_training()
