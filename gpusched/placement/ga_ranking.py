"""Set-up helpers of the batch optimiser (:mod:`gpusched.placement.ga_objective`).

:func:`smallest_k` picks the K lowest of a vector; :class:`FractionRanking` does the same for a
fraction over the devices it fits, grouped by (model, free share), without touching every device
per task; :class:`Lookup` hands out Python values of a fleet-wide array for the few devices the
decoder touches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpusched.model import MILLI
from gpusched.placement.index import FleetIndex

__all__ = ["FractionRanking", "Lookup", "smallest_k"]


class FractionRanking:
    """The devices a fraction fits, grouped by (model, free share): a device's objective for a
    fraction depends on those two only, so a task's top-K is found among the groups' first
    devices instead of over every fitting device: the K of lowest value, ties by position.
    (:func:`smallest_k` over all devices gives the same values; among devices tied at the K-th
    value it may list other, equally good ones.)"""

    def __init__(
        self,
        elig: object,
        blocked: np.ndarray,
        devs: np.ndarray,
        index: FleetIndex,
        free_milli: np.ndarray,
        milli: int,
        beta: float,
    ) -> None:
        self.elig, self.blocked, self.devs = elig, blocked, devs  # elig, blocked: kept for their ids
        free = free_milli[devs]
        models = index.dev_model[devs]
        low = int(free.min()) if len(devs) else 0
        span = MILLI - low + 1
        self.group_of = models * span + (free - low)
        groups = np.flatnonzero(np.bincount(self.group_of, minlength=len(index.model_names) * span))
        self.groups = groups
        self.models = groups // span
        g_free = groups % span + low
        left = g_free - milli
        frag = np.where(g_free == MILLI, left, np.where(left > 0, -milli, -g_free))
        self.frag_term = beta * frag / MILLI

    def top(self, model_terms: np.ndarray, k: int) -> np.ndarray:
        """The ``k`` devices of lowest ``model_terms[model] + fragmentation term``, ties by
        position, in that order."""
        values = model_terms[self.models] + self.frag_term
        order = np.argsort(values, kind="stable")
        out: list[np.ndarray] = []
        taken = 0
        i = 0
        while i < len(order) and taken < k:
            j = i + 1
            while j < len(order) and values[order[j]] == values[order[i]]:
                j += 1
            tied = self.groups[order[i:j]]
            mask = self.group_of == tied[0] if len(tied) == 1 else np.isin(self.group_of, tied)
            members = self.devs[mask][: k - taken]  # ascending positions
            out.append(members)
            taken += len(members)
            i = j
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def smallest_k(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` smallest values, in ascending order (ties by position; which of
    several values tied at the ``k``-th place are kept is up to ``argpartition``)."""
    if len(values) > k:
        part = np.argpartition(values, k - 1)[:k]
        return part[np.lexsort((part, values[part]))]
    return np.argsort(values, kind="stable")


class Lookup(dict[int, Any]):
    """``lookup[i]`` = ``array[i]`` as a Python scalar, converted on first access and kept."""

    def __init__(self, array: np.ndarray) -> None:
        super().__init__()
        self._array = array

    def __missing__(self, key: int) -> Any:
        value = self._array[key].item()
        self[key] = value
        return value
