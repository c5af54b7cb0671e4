"""Capacity: demand history and its checks, forecasts, pre-scaling plans and scalers, MIG re-partitions."""
