"""Topology: which device sets satisfy a request's interconnect, and how local they are.

Locality tiers (lower is better): 0 = one high-speed island (NVLink/NVSwitch, xGMI, HCCS) or
one PCIe switch, 1 = one NUMA node, 2 = one node, 3 = one rack (several nodes), 4 = several racks.
Node-level counts are computed with numpy over all devices at once; the exact devices are then
chosen inside the winning node only (:func:`pick_in_node`), best-fit by group so that whole
islands stay free for the requests that need them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from gpusched.placement.index import FleetIndex
from gpusched.request import Interconnect

__all__ = ["NodeCounts", "node_counts", "pick_in_node", "pick_nodes"]

TIER_NAMES = ("one island/PCIe switch", "one NUMA node", "one node", "one rack", "several racks")


class NodeCounts:
    """Per node: fitting devices and the largest fitting group per topology level."""

    __slots__ = ("count", "island", "numa", "switch")

    def __init__(self, count: np.ndarray, island: np.ndarray, numa: np.ndarray, switch: np.ndarray) -> None:
        self.count = count
        self.island = island
        self.numa = numa
        self.switch = switch

    def tier(self, k: int) -> np.ndarray:
        """Locality tier of the best ``k``-device set in each node (2 where only the node holds them)."""
        if k <= 1:
            return np.zeros(len(self.count), dtype=np.int64)
        tight = (self.island >= k) | (self.switch >= k)
        return np.where(tight, 0, np.where(self.numa >= k, 1, 2))

    def feasible(self, k: int, interconnect: Interconnect) -> np.ndarray:
        """Nodes that can hold ``k`` devices under ``interconnect`` on their own."""
        if k > 1 and interconnect is Interconnect.ISLAND:
            return self.island >= k
        if k > 1 and interconnect is Interconnect.SAME_NUMA:
            return self.numa >= k
        return self.count >= k


def _segments(index: FleetIndex, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(device order, segment starts, segment owner node) for per-group sums with ``reduceat``.

    ``kind`` is "node" or a topology level; cached on the index.
    """
    key = ("segments", kind)
    hit = index.masks.get(key)
    if hit is not None:
        return hit
    if kind == "node":
        order = np.arange(index.n_devices)
        groups = index.dev_node
    else:
        groups = {"island": index.dev_island, "numa": index.dev_numa, "switch": index.dev_switch}[kind]
        valid = np.flatnonzero(groups >= 0)
        order = valid[np.argsort(groups[valid], kind="stable")]
        groups = groups[order]
    if len(order):
        starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
        ids = groups[starts]
    else:
        starts = ids = np.zeros(0, dtype=np.int64)
    if kind == "node":
        owner = ids
    else:
        group_node = {"island": index.island_node, "numa": index.numa_node, "switch": index.switch_node}[kind]
        owner = group_node[ids]
    hit = (
        order,
        starts,
        owner,
        np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]]) if len(owner) else starts,
    )
    index.masks[key] = hit
    return hit


def _per_node_count(index: FleetIndex, fits: np.ndarray) -> np.ndarray:
    out = np.zeros(len(index.nodes), dtype=np.int64)
    _, starts, owner, _ = _segments(index, "node")
    if len(starts):
        out[owner] = np.add.reduceat(fits, starts, dtype=np.int64)
    return out


def _group_max(index: FleetIndex, fits: np.ndarray, kind: str) -> np.ndarray:
    # Sum fitting devices per group (reduceat over devices ordered by group), then take the
    # largest group per node (reduceat over groups, which are numbered node by node).
    out = np.zeros(len(index.nodes), dtype=np.int64)
    order, starts, owner, owner_starts = _segments(index, kind)
    if len(starts) == 0:
        return out
    per_group = np.add.reduceat(fits[order], starts, dtype=np.int64)
    out[owner[owner_starts]] = np.maximum.reduceat(per_group, owner_starts)
    return out


def node_counts(index: FleetIndex, fits: np.ndarray, k: int) -> NodeCounts:
    """Count fitting devices per node (and per island/NUMA/switch group when ``k > 1``)."""
    count = _per_node_count(index, fits)
    if k <= 1:
        return NodeCounts(count, count, count, count)
    return NodeCounts(
        count,
        _group_max(index, fits, "island"),
        _group_max(index, fits, "numa"),
        _group_max(index, fits, "switch"),
    )


def _best_group(cands: list[int], k: int, key: Callable[[int], object]) -> list[int] | None:
    groups: dict[object, list[int]] = defaultdict(list)
    for d in cands:
        g = key(d)
        if g is not None and g != -1:
            groups[g].append(d)
    fitting = [g for g in groups.values() if len(g) >= k]
    if not fitting:
        return None
    return min(fitting, key=len)


def pick_in_node(
    index: FleetIndex, cands: Sequence[int], k: int, interconnect: Interconnect, *, local: bool = True
) -> list[int]:
    """Choose ``k`` of the node's fitting devices ``cands`` (device positions, in index order).

    With ``local`` the set is as tight as the topology allows (best-fit island, then PCIe switch,
    then NUMA node; otherwise the largest groups first); without it, the first ``k``.
    """
    cands = list(cands)
    if k >= len(cands):
        return cands[:k]
    island = index.dev_island
    numa = index.dev_numa
    switch = index.dev_switch
    if interconnect is Interconnect.SAME_NUMA:
        group = _best_group(cands, k, lambda d: int(numa[d]))
        cands = group if group is not None else cands
    elif interconnect is Interconnect.ISLAND and k > 1:
        group = _best_group(cands, k, lambda d: int(island[d]))
        cands = group if group is not None else cands
    if not local:
        return cands[:k]
    if k == 1:
        return cands[:1]
    for key in (lambda d: int(island[d]), lambda d: int(switch[d]), lambda d: int(numa[d])):
        group = _best_group(cands, k, key)
        if group is not None:
            for inner in (lambda d: int(switch[d]), lambda d: int(numa[d])):
                tighter = _best_group(group, k, inner)
                if tighter is not None:
                    return tighter[:k]
            return group[:k]
    # Spread: take whole groups, largest first, so as few islands/NUMA nodes as possible are cut.
    by_group: dict[tuple[int, int], list[int]] = defaultdict(list)
    for d in cands:
        by_group[(int(numa[d]), int(island[d]))].append(d)
    chosen: list[int] = []
    for group_devs in sorted(by_group.values(), key=len, reverse=True):
        chosen.extend(group_devs[: k - len(chosen)])
        if len(chosen) == k:
            break
    return chosen


def pick_nodes(
    index: FleetIndex,
    count: np.ndarray,
    k: int,
    interconnect: Interconnect,
    *,
    order: str = "best",
    rng: np.random.Generator | None = None,
) -> tuple[list[tuple[int, int]], int] | None:
    """A multi-node gang: ``[(node, devices taken)]`` and its tier (3 one rack, 4 several racks).

    Prefers one rack (the one with the least spare capacity that fits when ``order`` is "best",
    the first for "first", a random one for "random"); within it the nodes with the most fitting
    devices first, so the gang spans as few nodes as possible. ``interconnect`` ``any`` falls back
    to several racks. None when the fleet cannot hold the gang now.
    """
    nodes = np.flatnonzero(count > 0)
    if len(nodes) == 0 or int(count[nodes].sum()) < k:
        return None
    racks = index.node_rack[nodes]
    per_rack = np.bincount(racks, weights=count[nodes], minlength=len(index.racks))
    fitting = np.flatnonzero(per_rack >= k)
    if len(fitting):
        if order == "first":
            rack = int(fitting[0])
        elif order == "random" and rng is not None:
            rack = int(rng.choice(fitting))
        else:
            rack = int(fitting[np.argmin(per_rack[fitting])])
        members = nodes[racks == rack]
        tier = 3
    elif interconnect is Interconnect.ANY:
        members = nodes
        tier = 4
    else:
        return None
    if order == "random" and rng is not None:
        members = rng.permutation(members)
    elif order != "first":
        members = members[np.argsort(-count[members], kind="stable")]
    chosen: list[tuple[int, int]] = []
    left = k
    for n in members.tolist():
        take = min(int(count[n]), left)
        chosen.append((n, take))
        left -= take
        if left == 0:
            return chosen, tier
    return None
