"""The fault chain: classify failed GPU tasks, choose and apply remedies, record them in the ledger."""
