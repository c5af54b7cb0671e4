# Airflow 3.3.2 with gpusched installed: the image every service of docker-compose.yaml runs.
#
#   docker compose build          (or: docker build -t gpusched-airflow:3.3.2 .)
#
# Stage 1 builds gpusched's wheel from the source tree; stage 2 installs only that wheel on top of
# the official Airflow image, as any provider is installed. The wheel carries the shipped data
# (accelerator catalog, fleets, expectation suites) and the ledger's migrations, and registers the
# provider ([gpusched] config, executor) and the plugin (fleet API, "GPU fleet" page, listeners)
# through entry points: no plugins folder and no source tree in the image. constraints.txt pins
# every dependency to the versions the test suite ran with.
FROM apache/airflow:3.3.2 AS wheel
COPY --chown=airflow:root pyproject.toml README.md /tmp/gpusched/
COPY --chown=airflow:root gpusched /tmp/gpusched/gpusched
RUN pip wheel --no-cache-dir --no-deps -w /tmp/dist /tmp/gpusched

FROM apache/airflow:3.3.2
COPY --from=wheel /tmp/dist /tmp/dist
COPY constraints.txt /tmp/dist/constraints.txt
RUN pip install --no-cache-dir -c /tmp/dist/constraints.txt /tmp/dist/gpusched-*.whl

# The example DAGs ship in the image; docker-compose.yaml also mounts ./dags over them.
COPY --chown=airflow:root dags /opt/airflow/dags
