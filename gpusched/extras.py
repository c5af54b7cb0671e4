"""Optional dependencies: the ``lab`` extra.

``pip install 'gpusched[lab]'`` adds what only the lab uses — the benchmark harnesses
(:mod:`gpusched.bench`), the simulator's progress bars (:mod:`gpusched.sim`) and every PNG plot:
matplotlib and tqdm. The executors, the agent, the plugin and the bundled DAGs need none of it.
Code that needs one of them imports it here, inside the function that uses it; without the extra
the caller gets one :class:`~gpusched.errors.MissingExtraError` line naming the fix, which the
command line prints as its one error line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gpusched.errors import MissingExtraError

__all__ = ["LAB_FIX", "LAB_PACKAGES", "lab_module", "pyplot"]

LAB_PACKAGES = ("matplotlib", "tqdm")
"""What the ``lab`` extra adds to the provider's dependencies (pyproject.toml lists the bounds)."""

LAB_FIX = "pip install 'gpusched[lab]'"


def lab_module(name: str) -> ModuleType:
    """Import ``name`` (a module of a lab package), or raise :class:`MissingExtraError` naming the fix."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        if exc.name not in (top, name):  # something the package itself needs: not ours to word
            raise
        raise MissingExtraError(
            f"{top} is not installed; it comes with gpusched's lab extra: {LAB_FIX}"
        ) from None


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    lab_module("matplotlib").use("Agg")
    return lab_module("matplotlib.pyplot")
