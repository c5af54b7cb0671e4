"""Keep the scheduler loop alive while the allocation ledger is down or locked.

:class:`LedgerGuard` runs ledger operations for the GPU core: a
:class:`~gpusched.errors.LedgerUnavailableError` pauses GPU work for ``wait_s`` seconds (the most
one ledger operation waits for a lock); any other error is logged, never raised into Airflow's
scheduler loop. Reconciliation catches up once the ledger answers again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpusched.errors import GpuschedError, LedgerUnavailableError

__all__ = ["LedgerGuard"]


class LedgerGuard:
    """Pause-on-outage wrapper around ledger operations (one per GPU core)."""

    def __init__(self, wait_s: float, log: Callable[[], Any]) -> None:
        self.wait_s = wait_s
        self._log = log  # resolved per use: the executor's logger
        self.down_until = 0.0  # monotonic time before which the ledger is left alone

    def usable(self) -> bool:
        """False while paused after an outage."""
        return time.monotonic() >= self.down_until

    def pause(self, exc: Exception) -> None:
        """Leave the ledger alone for ``wait_s`` seconds after ``exc``."""
        self.down_until = time.monotonic() + self.wait_s
        self._log().error("gpusched: ledger unavailable, GPU work paused for %.0f s: %s", self.wait_s, exc)

    def run(self, action: Callable[..., Any]) -> Any:
        """``action()``'s result, or None when paused or when it failed (logged, not raised)."""
        if not self.usable():
            return None  # paused after a lock timeout or outage; reconcile catches up later
        try:
            return action()
        except LedgerUnavailableError as exc:
            self.pause(exc)
        except GpuschedError:
            self._log().exception("gpusched: ledger operation failed")
        except Exception:  # a database hiccup must not stop the scheduler
            self._log().exception("gpusched: unexpected error in a ledger operation")
        return None
