#!/usr/bin/env bash
# The stand-in image's entrypoint: `airflow ARGS` for an Airflow command, else ARGS as they are.
set -euo pipefail
case "${1:-}" in
    "" | -*) exec airflow "$@" ;;
    bash | sh | python | python3 | airflow | airflow-skypilot | pip | /*) exec "$@" ;;
    *) exec airflow "$@" ;;
esac
