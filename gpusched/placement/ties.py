"""How a scored decision picks among its candidates: the FGD scheduler's integer node score and
the ways its ties are broken (earliest candidate, least capacity left, or a look-ahead).

Candidates always come in inventory order (nodes, then devices), so "the first" is the earliest
node, as the FGD simulator's scheduler gives equal scores to the lowest node name.
"""

from __future__ import annotations

import numpy as np

__all__ = ["integer_score", "levels_best", "tie_break", "top_level"]


def integer_score(score: np.ndarray, levels: int) -> np.ndarray:
    """FGD's integer node score of each lower-is-better ``score``: ``int(levels × sigmoid(−score))``
    (higher is better)."""
    # Scores are fragment differences of float sums: a change below 1e-9 is rounding noise of
    # the summation order (batch vs single-node), not a change, and must not break a tie of
    # the integer score (FGD sums in one fixed order, so its "no change" is an exact 0).
    return np.floor(levels / (1.0 + np.exp(np.clip(np.round(score, 9), -50.0, 50.0))))


def top_level(score: np.ndarray, levels: int) -> np.ndarray:
    """Positions (in order) of the candidates with the highest integer score."""
    q = integer_score(score, levels)
    return np.flatnonzero(q == q.max())


def levels_best(score: np.ndarray, levels: int, left: np.ndarray | None = None) -> int:
    """The first candidate of the highest integer score, or with ``left``, the one of the highest
    with the least ``left`` (then the first)."""
    top = top_level(score, levels)
    if left is None:
        return int(top[0])
    return int(top[np.argmin(left[top])])


def tie_break(score: np.ndarray, left: np.ndarray) -> int:
    """Position of the lowest score; among scores equal to 1e-9, the one with the least ``left``."""
    tied = np.flatnonzero(score <= score.min() + 1e-9)
    return int(tied[np.argmin(left[tied])])
