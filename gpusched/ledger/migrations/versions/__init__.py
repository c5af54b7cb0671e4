"""Ledger schema revisions, oldest first (a package so that they ship with gpusched)."""

__all__: list[str] = []
