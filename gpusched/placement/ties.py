"""How a scored decision picks among its candidates: the FGD scheduler's integer node score and
the ways its ties are broken (earliest candidate, least capacity left, or a look-ahead).

Candidates always come in inventory order (nodes, then devices), so "the first" is the earliest
node, as the FGD simulator's scheduler gives equal scores to the lowest node name.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["integer_score", "levels_best", "near_top", "tie_break", "top_level"]

_MARGIN = 1e-6  # score units: far above the rounding of integer_score's sigmoid near a level's edge


def integer_score(score: np.ndarray, levels: int) -> np.ndarray:
    """FGD's integer node score of each lower-is-better ``score``: ``int(levels × sigmoid(−score))``
    (higher is better)."""
    # Scores are fragment differences of float sums: a change below 1e-9 is rounding noise of
    # the summation order (batch vs single-node), not a change, and must not break a tie of
    # the integer score (FGD sums in one fixed order, so its "no change" is an exact 0).
    return np.floor(levels / (1.0 + np.exp(np.clip(np.round(score, 9), -50.0, 50.0))))


def near_top(score: np.ndarray, levels: int, below: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, their integer scores)`` of every candidate whose integer score is within
    ``below`` levels of the highest (positions in order), possibly with some lower ones: the
    integer score falls as the score rises, so only the scores up to the lowest wanted level's
    upper edge (plus a margin) are converted."""
    if not len(score):
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    top = float(integer_score(np.array([score.min()]), levels)[0])
    lowest = top - below
    if lowest <= 0:  # the bottom level holds every score above some point: all candidates
        return np.arange(len(score)), integer_score(score, levels)
    # Level ≥ lowest ⟺ levels / (1 + e^x) ≥ lowest ⟺ x ≤ ln(levels / lowest − 1); the top level
    # itself needs 1 + e^x to round to 1 (x below −36.7).
    edge = math.log(levels / lowest - 1.0) if lowest < levels else -30.0
    positions = np.flatnonzero(score <= edge + _MARGIN)
    return positions, integer_score(score[positions], levels)


def top_level(score: np.ndarray, levels: int) -> np.ndarray:
    """Positions (in order) of the candidates with the highest integer score."""
    positions, q = near_top(score, levels)
    return positions[q == q.max()]


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
