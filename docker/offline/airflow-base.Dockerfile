# A stand-in for the official apache/airflow image, for machines that reach Debian's mirror
# and PyPI but no image registry (build.sh). What docker-compose.yml and airflow.Dockerfile
# rely on is the same: user `airflow` (uid 50000, gid 0), HOME /home/airflow with the
# constraints file the image was built with at ~/constraints.txt, AIRFLOW_HOME /opt/airflow,
# `pip install` as that user, curl, and an entrypoint that runs `airflow <command>` for a bare
# Airflow command (`scheduler`) and anything else (`bash ...`) as it is. Python packages come
# from the wheelhouse build.sh puts in the context (wheels/), never from an index. Like the
# official image it has the postgres and celery extras (the Celery provider, the redis client).
FROM debian:bookworm-slim

ARG AIRFLOW_VERSION=3.3.2
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        python3 python3-venv ca-certificates curl \
    && rm -rf /var/lib/apt/lists/*
# extra CA certificates (build.sh copies the host's: a TLS-inspecting proxy on the way to PyPI)
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
RUN useradd --uid 50000 --gid 0 --create-home --home-dir /home/airflow --shell /bin/bash airflow \
    && install -d -o airflow -g 0 -m 0775 /opt/airflow /opt/airflow/dags /opt/airflow/logs
ENV AIRFLOW_HOME=/opt/airflow \
    PATH=/home/airflow/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
USER airflow
COPY --chown=airflow:0 constraints.txt /home/airflow/constraints.txt
# Every pip install in this image and in the images built on it (airflow.Dockerfile) takes its
# packages from the wheelhouse build.sh made on the host, and nothing from an index: PyPI as
# seen from here may lack the constrained versions (a resolution that backtracks for minutes
# and then fails), and the host's pip configuration is what is known to resolve them.
COPY --chown=airflow:0 wheels/ /home/airflow/wheels/
ENV PIP_NO_INDEX=1 \
    PIP_FIND_LINKS=/home/airflow/wheels \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# a current pip: bookworm's (23.0) takes minutes per package resolving the providers' extras
RUN python3 -m venv /home/airflow/.local \
    && pip install --no-cache-dir -q --upgrade pip \
    && pip install --no-cache-dir -q "apache-airflow[postgres,celery]==${AIRFLOW_VERSION}" \
        --constraint /home/airflow/constraints.txt
COPY airflow-entrypoint.sh /entrypoint
WORKDIR /opt/airflow
ENTRYPOINT ["/entrypoint"]
CMD ["--help"]
