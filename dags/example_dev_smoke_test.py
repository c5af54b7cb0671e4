"""Dev partition smoke test: one small GPU from the ``dev`` partition checks that devices work.

The task asks for one whole device of the ``dev`` partition on a node labelled ``pool=dev``
(T4-class cards in the default simulated fleet) and runs a tiny numerical check. It shows how a
team can keep quick tests off the training nodes.
"""

from __future__ import annotations

import json
import os
from datetime import datetime

from airflow.sdk import dag, task

from gpusched.airflow.authoring import gpu


@dag(
    dag_id="example_dev_smoke_test",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["gpusched", "example"],
    doc_md=__doc__,
)
def example_dev_smoke_test() -> None:
    @task(**gpu(gpus=1, memory="8GiB", partition="dev", labels={"pool": "dev"}, tenant="dev",
                priority="low", expected_duration="2m"))
    def smoke_test() -> dict[str, object]:
        import numpy as np

        allocation = json.loads(os.environ.get("GPUSCHED_ALLOCATION") or "{}")
        print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")
        print(f"GPUSCHED_ALLOCATION node={allocation.get('node')} devices={allocation.get('devices')} "
              f"models={allocation.get('models')}")
        a = np.arange(64, dtype=float).reshape(8, 8)
        check = float(np.trace(a @ np.eye(8)))
        assert check == float(np.trace(a)), "matrix check failed"
        print(f"smoke test passed: trace={check}")
        return {"ok": True, "models": allocation.get("models")}

    smoke_test()


example_dev_smoke_test()
