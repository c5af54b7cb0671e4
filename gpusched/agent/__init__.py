"""The per-host agent: sample device telemetry, evaluate the alert rules, export Prometheus metrics."""
