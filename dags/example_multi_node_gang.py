"""Multi-node gang: a 16-GPU data-parallel job as two 8-GPU members, one per node of one rack.

``gang_task`` adds one member task per node (``pretrain__node0``, ``pretrain__node1``). The
executor places both members in the same cycle (the two H100 nodes of rack-a in the default
simulated fleet) or neither, starts them together and gives each the rendezvous variables torchrun
reads. One of those nodes is on standby: the gang waits (its queue reason says so) until
``gpusched agent`` switches it on, after ``--scale-after`` seconds of waiting (300 by default).
Under the Celery executor each member goes to the queue of its own GPU host. If one member fails
or its host is lost, the other is stopped and the gang is retried as a whole.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.sdk import dag

from gpusched.airflow.gang import gang_task

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_WORLD_SIZE")


@dag(
    dag_id="example_multi_node_gang",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    tags=["gpusched", "example"],
    doc_md=__doc__,
)
def example_multi_node_gang() -> None:
    @gang_task(nodes=2, gpus_per_node=8, models=["H100-SXM-80GB"], interconnect="same_rack",
               tenant="vision", expected_duration="10m", retries=2, retry_delay=timedelta(seconds=30))
    def pretrain() -> dict[str, str]:
        seen = {name: os.environ.get(name, "<unset>") for name in RENDEZVOUS}
        seen["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        # On real hardware, start the per-node launcher here, e.g.
        #   torchrun --nnodes $NNODES --node-rank $NODE_RANK --nproc-per-node $LOCAL_WORLD_SIZE
        #            --master-addr $MASTER_ADDR --master-port $MASTER_PORT train.py
        print(" ".join(f"{k}={v}" for k, v in seen.items()))
        return seen

    pretrain()


example_multi_node_gang()
