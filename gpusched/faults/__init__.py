"""The fault chain: alert rules over device samples, classify failed GPU tasks, choose and apply
remedies, record them in the ledger."""
