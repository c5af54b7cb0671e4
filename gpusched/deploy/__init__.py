"""Local deployments on one machine: the multi-host Airflow cluster harness (tests, benchmarks, demos)."""
