#!/usr/bin/env bash
# Build every image docker-compose.yml needs without an image registry (Docker Hub unreachable):
#   debian:bookworm-slim                 debootstrap (minbase) from Debian's mirror, imported
#   airflow-skypilot/postgres:offline    Debian's PostgreSQL 15 (postgres.Dockerfile)
#   airflow-skypilot/airflow-base:offline  Airflow from PyPI (airflow-base.Dockerfile)
#   airflow-skypilot/slurm:local, airflow-skypilot/airflow:local  the compose images, on those
# Builds use the host's network (`--network host`), so a daemon without a default bridge works.
# Then: POSTGRES_IMAGE=airflow-skypilot/postgres:offline docker-compose -f docker/docker-compose.yml up --no-build
# Needs root (debootstrap), debootstrap, and docker. Run from anywhere.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if ! docker image inspect debian:bookworm-slim >/dev/null 2>&1; then
    echo "build: debootstrap bookworm (minbase) from $mirror"
    debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" \
        || { tail -30 "$work/debootstrap.log"; exit 1; }
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
    tar -C "$work/rootfs" -c . | docker import -c 'CMD ["bash"]' - debian:bookworm-slim
fi
cp "$here"/postgres.Dockerfile "$here"/postgres-entrypoint.sh "$here"/airflow-base.Dockerfile \
    "$here"/airflow-entrypoint.sh "$work"/
cp "$repo/.ci/constraints.txt" "$work/constraints.txt"
# the host's extra CA certificates (a proxy that inspects TLS on the way to PyPI), if any
mkdir -p "$work/ca"
find "${EXTRA_CA_DIR:-/usr/local/share/ca-certificates}" -name '*.crt' -exec cp {} "$work/ca/" \; \
    2>/dev/null || true
# The classic builder (no buildx needed). It reads no per-Dockerfile .dockerignore, so the
# Airflow image's context is assembled here from what airflow.Dockerfile COPYs (never .venv,
# .sandbox state, keys or caches).
export DOCKER_BUILDKIT=0
ctx="$work/airflow-context"
mkdir -p "$ctx/docker"
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/airflow_skypilot" "$ctx/"
cp -r "$repo/docker/airflow" "$ctx/docker/"
cp "$repo/docker/airflow.Dockerfile" "$ctx/docker/"
find "$ctx" \( -name __pycache__ -o -name '*.pyc' \) -prune -exec rm -rf {} +
docker build -q --network host -t airflow-skypilot/postgres:offline \
    -f "$work/postgres.Dockerfile" "$work"
docker build -q --network host -t airflow-skypilot/airflow-base:offline \
    -f "$work/airflow-base.Dockerfile" "$work"
docker build -q --network host -t airflow-skypilot/slurm:local \
    -f "$repo/docker/slurm.Dockerfile" "$repo/docker"
docker build -q --network host -t airflow-skypilot/airflow:local \
    --build-arg AIRFLOW_BASE_IMAGE=airflow-skypilot/airflow-base:offline \
    -f "$ctx/docker/airflow.Dockerfile" "$ctx"
echo "build: done"
