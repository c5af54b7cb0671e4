"""The per-host agent: sample device telemetry, run the fault chain's alert rules on it
(:mod:`gpusched.faults.alerts`), export Prometheus metrics."""
