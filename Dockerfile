# Airflow 3.3.2 with gpusched installed: the image every service of docker-compose.yaml runs.
#
#   docker compose build          (or: docker build -t gpusched-airflow:3.3.2 .)
#
# gpusched is installed in editable mode from /opt/gpusched so that its shipped data (include/:
# accelerator catalog, fleets, expectation suites) and the ledger's Alembic scripts stay beside
# the package. constraints.txt pins every dependency to the versions the test suite ran with.
FROM apache/airflow:3.3.2

USER root
RUN mkdir -p /opt/gpusched && chown airflow:root /opt/gpusched
USER airflow

COPY --chown=airflow:root pyproject.toml README.md constraints.txt /opt/gpusched/
COPY --chown=airflow:root gpusched /opt/gpusched/gpusched
COPY --chown=airflow:root include /opt/gpusched/include
RUN pip install --no-cache-dir -c /opt/gpusched/constraints.txt -e /opt/gpusched

# The plugin (fleet API + "GPU fleet" page + listeners) and the example DAGs ship in the image;
# docker-compose.yaml also mounts ./plugins and ./dags over them for development.
COPY --chown=airflow:root plugins /opt/airflow/plugins
COPY --chown=airflow:root dags /opt/airflow/dags
