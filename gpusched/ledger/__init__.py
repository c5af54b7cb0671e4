"""The allocation ledger: the single source of truth for who holds which devices.

``Ledger(url)`` stores inventory, health, cordons, allocations with leases, the pending queue,
telemetry samples and events in SQLite (embedded default, WAL) or PostgreSQL
(``GPUSCHED_DB_URL``); schema migrations run through Alembic (:meth:`Ledger.migrate`).
Allocating is one transaction that re-checks free capacity, so no device is ever over-committed.
"""

from gpusched.ledger.store import Ledger
from gpusched.records import Allocation, AllocationStatus, HolderProcess, LedgerEvent, QueueEntry

__all__ = ["Allocation", "AllocationStatus", "HolderProcess", "Ledger", "LedgerEvent", "QueueEntry"]
