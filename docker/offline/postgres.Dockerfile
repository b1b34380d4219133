# A stand-in for the official postgres image (build.sh): Debian's PostgreSQL 15, initialised
# on first start from POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB into PGDATA, password
# logins over TCP; pg_isready for the healthcheck.
FROM debian:bookworm-slim
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        postgresql-15 \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint"]
