"""Quotas: the training/burst/dev capacity partitions and per-tenant GPU-hour budgets (pure policy)."""
