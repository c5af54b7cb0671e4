"""Multi-node gangs as vocabulary: a member's membership and its rendezvous variables.

A request bigger than one node runs as one member task per node
(:func:`gpusched.airflow.gang.gang_task`); each member's ``executor_config`` carries its membership
under :data:`GANG_KEY`, read by :func:`gang_member`. The scheduler places a complete gang
(:mod:`gpusched.scheduler.gangs`) and gives every member :func:`rendezvous_env`, whose
``MASTER_ADDR`` is the address rank 0's GPU host registered; :func:`is_loopback` tells an
address that reaches only its own machine (refused or warned about on a fleet of several).
Light on purpose: DAG files import it while they are parsed.
"""

from __future__ import annotations

import ipaddress
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from gpusched.errors import GPURequestError

__all__ = [
    "GANG_KEY", "GANG_SCOPES", "LOCAL_ADDRESS", "RENDEZVOUS_VARS", "GangMember", "gang_member",
    "is_loopback", "is_unspecified", "rendezvous_env",
]

GANG_KEY = "gpusched_gang"
"""Key of the gang spec in a member task's ``executor_config``."""

RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_WORLD_SIZE",
                   "GPUSCHED_GANG")
"""Every variable :func:`rendezvous_env` sets."""

GANG_SCOPES = ("same_rack", "any")
_PORT_BASE, _PORT_SPAN = 29500, 500


@dataclass(frozen=True, slots=True)
class GangMember:
    """One member of a multi-node gang: ``gang`` is unique per DAG run (and map index)."""

    gang: str
    size: int
    rank: int
    scope: str = "same_rack"


def gang_member(
    executor_config: object, *, dag_id: str, run_id: str, map_index: int = -1
) -> GangMember | None:
    """The gang membership in a task's ``executor_config``, or None for an ordinary task.

    Raises:
        GPURequestError: the ``gpusched_gang`` entry is malformed.
    """
    if not isinstance(executor_config, Mapping) or GANG_KEY not in executor_config:
        return None
    spec = executor_config[GANG_KEY]
    try:
        name, size, rank = str(spec["name"]), int(spec["size"]), int(spec["rank"])
        scope = str(spec.get("scope", "same_rack"))
    except (KeyError, TypeError, ValueError):
        raise GPURequestError(GANG_KEY, spec, "a mapping with name, size and rank (use gang_task)") from None
    if size < 2 or not 0 <= rank < size or scope not in GANG_SCOPES:
        raise GPURequestError(GANG_KEY, spec, f"size >= 2, 0 <= rank < size, scope in {GANG_SCOPES}")
    return GangMember(f"{dag_id}/{run_id}/{map_index}/{name}", size, rank, scope)


def rendezvous_env(member: GangMember, gpus_per_node: int, master_addr: str) -> dict[str, str]:
    """The torchrun / DeepSpeed variables of ``member`` (``MASTER_PORT`` derived from the gang id)."""
    port = _PORT_BASE + zlib.crc32(member.gang.encode()) % _PORT_SPAN
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(member.size * gpus_per_node),
        "NODE_RANK": str(member.rank),
        "NNODES": str(member.size),
        "LOCAL_WORLD_SIZE": str(gpus_per_node),
        "GPUSCHED_GANG": member.gang,
    }


LOCAL_ADDRESS = "127.0.0.1"
"""Rendezvous address of a node with no registered GPU host (the local executor: one machine)."""


def is_loopback(address: str) -> bool:
    """Whether ``address`` reaches only the machine that uses it: an IPv4 address in 127.0.0.0/8,
    ``::1`` (also IPv4-mapped, ``::ffff:127.x.y.z``), ``localhost`` or a name under ``.localhost``.

    A name is not resolved: any other name counts as routable."""
    text = address.strip().strip("[]").lower().rstrip(".")
    if text == "localhost" or text.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_unspecified(address: str) -> bool:
    """Whether ``address`` is a bind-everything address (``0.0.0.0``, ``::``): one to listen on,
    never one to connect to."""
    try:
        return ipaddress.ip_address(address.strip().strip("[]")).is_unspecified
    except ValueError:
        return False
