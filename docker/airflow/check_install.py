"""Build-time check of the Airflow image: the provider is installed, registered and importable.

Run by docker/airflow.Dockerfile with a throw-away AIRFLOW_HOME, so no airflow.cfg or secret
ends up in the image.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import entry_points, version

MODULES = (
    "airflow_skypilot.operators",
    "airflow_skypilot.sensors",
    "airflow_skypilot.triggers",
    "airflow_skypilot.hooks.slurm",
    "airflow_skypilot.backends.slurm",
    "airflow_skypilot.cli",
)


def main() -> int:
    providers = [
        ep for ep in entry_points(group="apache_airflow_provider")
        if ep.value.startswith("airflow_skypilot")
    ]
    if not providers:
        print("airflow-skypilot is not registered as an Airflow provider", file=sys.stderr)
        return 1
    info = providers[0].load()()
    if info.get("package-name") != "airflow-skypilot":
        print(f"unexpected provider info: {info!r}", file=sys.stderr)
        return 1
    for module in MODULES:
        importlib.import_module(module)
    print(f"airflow-skypilot {version('airflow-skypilot')} on apache-airflow "
          f"{version('apache-airflow')}: provider registered, modules import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
