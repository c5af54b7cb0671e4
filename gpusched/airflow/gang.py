"""Multi-node gangs: one member task per node, placed and started together, with rendezvous variables.

A request bigger than one node (16 GPUs over two 8-GPU hosts) runs as one member task per node.
DAG authors write it once::

    from gpusched.airflow.gang import gang_task

    @gang_task(nodes=2, gpus_per_node=8, models=["H100-SXM-80GB"], interconnect="same_rack", retries=2)
    def train():
        subprocess.run(["torchrun", "--nnodes", os.environ["NNODES"], "--node-rank",
                        os.environ["NODE_RANK"], "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"],
                        "--master-addr", os.environ["MASTER_ADDR"], "--master-port",
                        os.environ["MASTER_PORT"], "train.py"], check=True)

    train()   # -> member tasks train__node0, train__node1

The executor places every member in the same cycle (one node each, distinct nodes, one rack for
``same_rack``) or none of them, dispatches them together (each on its host's queue under the
Celery executor) and gives each the variables torchrun / DeepSpeed read: ``MASTER_ADDR`` (the
address of rank 0's host), ``MASTER_PORT``, ``WORLD_SIZE`` (all GPUs), ``NODE_RANK``, ``NNODES``,
``LOCAL_WORLD_SIZE`` (GPUs per node) and ``GPUSCHED_GANG``. When one member fails or its host is
lost, the executor stops the others; each member's retry waits for the whole gang again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpusched.airflow.authoring import gpu, split_task_kwargs
from gpusched.errors import GPURequestError
from gpusched.gang import GANG_KEY, GANG_SCOPES

__all__ = ["gang_task"]

def gang_task(
    python_callable: Callable[..., Any] | None = None,
    *,
    nodes: int,
    gpus_per_node: int,
    interconnect: str = "same_rack",
    **kwargs: Any,
) -> Any:
    """``@task`` for a multi-node gang: calling the decorated function adds one member task per node.

    Args:
        nodes: members (one per node), at least 2.
        gpus_per_node: whole GPUs each member gets on its node.
        interconnect: ``same_rack`` (every member in one rack) or ``any``.
        **kwargs: other request fields (``models``, ``vendor``, ``memory`` …), the options of
            :func:`~gpusched.airflow.authoring.gpu` (``pool_sync``, ``pool``, ``pool_slots``:
            the same pool rule, per member) and ``@task`` arguments (``retries``,
            ``executor_config`` — merged with each member's request …); ``task_id`` names the
            gang (default: the function name).

    Raises:
        GPURequestError: at parse time, for a bad size, scope or request field.
    """

    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 2:
        raise GPURequestError("nodes", nodes, "an integer >= 2 (one member task per node)")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise GPURequestError("gpus_per_node", gpus_per_node, "an integer >= 1 (whole GPUs per node)")
    if interconnect not in GANG_SCOPES:
        raise GPURequestError("interconnect", interconnect,
                              f"one of {', '.join(GANG_SCOPES)} for a multi-node gang")
    gpu_kwargs, task_kwargs, user_config = split_task_kwargs(kwargs)
    gang_name = task_kwargs.pop("task_id", None)
    for forbidden in ("gpus", "count", "milli", "gang"):
        if forbidden in gpu_kwargs:
            raise GPURequestError(forbidden, gpu_kwargs[forbidden],
                                  "not given: use nodes and gpus_per_node")
    per_node = gpu(gpus=gpus_per_node, interconnect="same_node", **gpu_kwargs)
    pool = {k: v for k, v in per_node.items() if k != "executor_config"}  # the pool rule's answer

    def decorate(fn: Callable[..., Any]) -> Callable[..., list[Any]]:
        from airflow.sdk import task

        name = str(fn.__name__ if gang_name is None else gang_name)

        def add_members(*args: Any, **call_kwargs: Any) -> list[Any]:
            members = []
            for rank in range(nodes):
                config = {**user_config, **per_node["executor_config"]}
                config[GANG_KEY] = {"name": name, "size": nodes, "rank": rank, "scope": interconnect}
                member = task(task_id=f"{name}__node{rank}", executor_config=config, **pool,
                              **task_kwargs)(fn)
                members.append(member(*args, **call_kwargs))
            return members

        return add_members

    return decorate if python_callable is None else decorate(python_callable)
