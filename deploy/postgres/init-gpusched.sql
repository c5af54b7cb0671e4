-- Runs once, when the PostgreSQL volume is first initialised (docker-entrypoint-initdb.d):
-- a separate database for the gpusched ledger (allocations, leases, inventory, telemetry),
-- so it can be backed up and retained independently of Airflow's metadata database.
CREATE DATABASE gpusched OWNER airflow;
