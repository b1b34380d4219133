#!/usr/bin/env bash
# Build every image docker-compose.yml needs without an image registry (Docker Hub unreachable):
#   debian:bookworm-slim                 debootstrap (minbase) from Debian's mirror, imported
#   airflow-skypilot/postgres:offline    Debian's PostgreSQL 15 (postgres.Dockerfile)
#   airflow-skypilot/redis:offline       Debian's Redis 7.0 (redis.Dockerfile)
#   airflow-skypilot/airflow-base:offline  Airflow from a wheelhouse (airflow-base.Dockerfile)
#   airflow-skypilot/slurm:local, airflow-skypilot/airflow:local  the compose images, on those
# Builds use the host's network (`--network host`), so a daemon without a default bridge works.
# Then: POSTGRES_IMAGE=airflow-skypilot/postgres:offline REDIS_IMAGE=airflow-skypilot/redis:offline \
#         docker-compose -f docker/docker-compose.yml up --no-build
# The Python packages come from a wheelhouse built here, on the host, by the host's pip
# (`$PYTHON -m pip wheel`, with the host's pip configuration: its indexes, find-links, proxy and
# certificates), at the repository's .ci/constraints.txt; the images install from it with
# `--no-index` only, so what resolves on the host is what goes in. $PYTHON must be the image's
# Python (3.11, Debian bookworm's) for the compiled wheels to fit.
# Needs root (debootstrap), debootstrap, docker and Python 3.11 with pip. Run from anywhere.
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
    tar -C "$work/rootfs" -c . | docker import -c 'CMD ["bash"]' - debian:bookworm-slim >/dev/null
    rm -rf "$work/rootfs"
    echo "build: debian:bookworm-slim imported in $SECONDS s"
fi
# one small build context per stand-in image
mkdir -p "$work/postgres" "$work/redis" "$work/base"
cp "$here"/postgres.Dockerfile "$here"/postgres-entrypoint.sh "$work/postgres/"
cp "$here"/redis.Dockerfile "$work/redis/"
cp "$here"/airflow-base.Dockerfile "$here"/airflow-entrypoint.sh "$work/base/"
# .ci/constraints.txt, with the pins constraints-bookworm.txt overrides for the image's Python
overrides="$here/constraints-bookworm.txt"
grep -v -i -E "^($(sed -n 's/^\([A-Za-z0-9_.-]*\)[=<>!~].*/\1/p' "$overrides" | paste -sd'|'))[=<>!~ ]" \
    "$repo/.ci/constraints.txt" >"$work/base/constraints.txt"
grep -v -E '^(#|$)' "$overrides" >>"$work/base/constraints.txt"
# the wheelhouse: Airflow, the providers, this repository's dependencies and the build backend
python="${PYTHON:-python3}"
pyver="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$pyver" != 3.11 ]; then
    echo "build: $python is Python $pyver; the images have Debian bookworm's 3.11 (set PYTHON)" >&2
    exit 1
fi
echo "build: wheelhouse ($python -m pip wheel, constraints .ci/constraints.txt)"
start="$SECONDS"
mkdir -p "$work/base/wheels"
"$python" -m pip wheel -q --disable-pip-version-check -w "$work/base/wheels" \
    --constraint "$work/base/constraints.txt" \
    "apache-airflow[postgres,celery]==${AIRFLOW_VERSION:-3.3.2}" "$repo" "setuptools>=77" pip \
    >"$work/wheel.log" 2>&1 || { tail -30 "$work/wheel.log"; exit 1; }
# What the image's Python needs beyond what the host's resolved: a dependency whose marker holds
# on 3.11.2 only (redis needs async-timeout on `python_full_version < "3.11.3"`; the host's pip
# skipped it), added until nothing is missing.
for _ in 1 2 3; do
    found="$("$python" - "$work/base/wheels" "${IMAGE_PYTHON:-3.11.2}" <<'PY'
import sys
import zipfile
from pathlib import Path
from pip._vendor.packaging.markers import default_environment
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
wheels, image_python = Path(sys.argv[1]), sys.argv[2]
env = {**default_environment(), "python_full_version": image_python,
       "python_version": ".".join(image_python.split(".")[:2]), "extra": ""}
have = {canonicalize_name(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
missing = set()
for wheel in wheels.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is not None and req.marker.evaluate(env) \
                        and canonicalize_name(req.name) not in have:
                    req.marker = None
                    missing.add(str(req))
print("\n".join(sorted(missing)))
PY
)"
    [ -n "$found" ] || break
    mapfile -t missing <<<"$found"
    echo "build: wheelhouse: for Python ${IMAGE_PYTHON:-3.11.2} also: ${missing[*]}"
    "$python" -m pip wheel -q --disable-pip-version-check -w "$work/base/wheels" \
        --constraint "$work/base/constraints.txt" "${missing[@]}" >>"$work/wheel.log" 2>&1 \
        || { tail -30 "$work/wheel.log"; exit 1; }
done
rm -f "$work"/base/wheels/airflow_skypilot-*.whl   # installed from the sources by airflow.Dockerfile
echo "build: wheelhouse of $(find "$work/base/wheels" -name '*.whl' | wc -l) wheels" \
    "($(du -sh "$work/base/wheels" | cut -f1)) in $((SECONDS - start)) s"
# every wheel must install on the image's Python (bookworm's 3.11.2), or the image build fails
"$python" - "$work/base/wheels" "${IMAGE_PYTHON:-3.11.2}" <<'PY'
import sys, zipfile
from pathlib import Path
from pip._vendor.packaging.specifiers import SpecifierSet
wheels, image_python = Path(sys.argv[1]), sys.argv[2]
bad = []
for wheel in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Python:"):
                spec = line.split(":", 1)[1].strip()
                if spec and image_python not in SpecifierSet(spec):
                    bad.append(f"{wheel.name} (Requires-Python {spec})")
                break
if bad:
    sys.exit(f"build: not installable on Python {image_python} (add an override to "
             "constraints-bookworm.txt): " + ", ".join(bad))
PY
# the host's extra CA certificates (a proxy that inspects TLS on the way to PyPI), if any
mkdir -p "$work/base/ca"
find "${EXTRA_CA_DIR:-/usr/local/share/ca-certificates}" -name '*.crt' -exec cp {} "$work/base/ca/" \; \
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
build() {  # TAG DOCKER-BUILD-ARGS...: one image, with its build time
    local tag="$1" start="$SECONDS"
    shift
    echo "build: $tag"
    # (the classic builder's stderr, its deprecation notice, only when the build fails; --force-rm:
    # no container left behind by a failed step)
    docker build -q --force-rm --network host -t "$tag" "$@" >/dev/null 2>"$work/build.err" \
        || { cat "$work/build.err" >&2; return 1; }
    echo "build: $tag built in $((SECONDS - start)) s"
}
build airflow-skypilot/postgres:offline \
    -f "$work/postgres/postgres.Dockerfile" "$work/postgres"
build airflow-skypilot/redis:offline \
    -f "$work/redis/redis.Dockerfile" "$work/redis"
build airflow-skypilot/airflow-base:offline \
    --build-arg AIRFLOW_VERSION="${AIRFLOW_VERSION:-3.3.2}" \
    -f "$work/base/airflow-base.Dockerfile" "$work/base"
build airflow-skypilot/slurm:local \
    -f "$repo/docker/slurm.Dockerfile" "$repo/docker"
build airflow-skypilot/airflow:local \
    --build-arg AIRFLOW_BASE_IMAGE=airflow-skypilot/airflow-base:offline \
    -f "$ctx/docker/airflow.Dockerfile" "$ctx"
echo "build: done in $SECONDS s"
