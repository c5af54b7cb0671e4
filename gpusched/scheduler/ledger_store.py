"""The SQL ledger as the scheduler's store (:class:`~gpusched.scheduler.store.Store`): what the
executors open. Apart from :mod:`gpusched.scheduler.store` so the simulator never loads SQL."""

from __future__ import annotations

from gpusched.ledger import Ledger
from gpusched.model import FleetSnapshot
from gpusched.quota.usage import spans_of, tenant_usage

__all__ = ["LedgerStore"]


class LedgerStore(Ledger):
    """:class:`gpusched.ledger.Ledger` with :meth:`tenant_use`, counted over its allocation history."""

    def tenant_use(self, snapshot: FleetSnapshot, since: float, now: float) -> dict[str, int]:
        """Normalised units each tenant used in ``[since, now]``
        (:func:`~gpusched.quota.usage.tenant_usage`)."""
        return tenant_usage(spans_of(self.history(since, now)), snapshot, since, now)
