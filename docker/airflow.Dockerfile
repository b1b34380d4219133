# Airflow with the airflow-skypilot provider installed from this repository.
# Build context: the repository root (see docker-compose.yml); airflow.Dockerfile.dockerignore
# keeps the context to what is copied below.
ARG AIRFLOW_VERSION=3.3.2
# The official image; docker/offline/build.sh builds a stand-in where no registry is reachable.
ARG AIRFLOW_BASE_IMAGE=apache/airflow:${AIRFLOW_VERSION}
FROM ${AIRFLOW_BASE_IMAGE}
ARG AIRFLOW_VERSION

USER airflow

# The provider and its dependencies come from the repository's pyproject.toml; Airflow's
# `celery` extra (the Celery provider, celery and the redis client: the compose file's
# CeleryExecutor) is part of the official image already, and asked for here so that any base
# has it. Pinning apache-airflow to the image's own version and installing against the constraints file the
# official image was built with (${HOME}/constraints.txt) keeps Airflow and the providers it
# ships (ssh, cncf-kubernetes, amazon, aiobotocore...) at versions tested together; if
# pyproject.toml ever needs something those constraints forbid, the build fails here, loudly.
COPY --chown=airflow:0 pyproject.toml README.md /opt/airflow-skypilot/src/
COPY --chown=airflow:0 airflow_skypilot /opt/airflow-skypilot/src/airflow_skypilot
RUN pip install --no-cache-dir \
        "apache-airflow[celery]==${AIRFLOW_VERSION}" \
        /opt/airflow-skypilot/src \
        --constraint "${HOME}/constraints.txt"

# The init job's scripts (docker/airflow/init.sh) and a build-time check that the provider is
# registered with Airflow and its modules import.
COPY --chown=airflow:0 docker/airflow/ /opt/airflow-skypilot/docker/
RUN AIRFLOW_HOME=/tmp/airflow-build-check python /opt/airflow-skypilot/docker/check_install.py \
    && rm -rf /tmp/airflow-build-check
