"""Provider metadata: what ``airflow providers list`` shows and what the UI registers."""

from __future__ import annotations

from typing import Any

from airflow_skypilot import __version__


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-skypilot",
        "name": "SkyPilot",
        "description": "Run SkyPilot task YAMLs on Slurm, Kubernetes and AWS GPUs, placed by "
                       "live capacity, with failover on infrastructure failure.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "SkyPilot",
                "external-doc-url": "https://docs.skypilot.co/",
                "tags": ["compute"],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_skypilot.hooks.slurm.SlurmHook",
                "connection-type": "slurm",
            }
        ],
        "hooks": [
            {
                "integration-name": "SkyPilot",
                "python-modules": [
                    "airflow_skypilot.hooks.capacity",
                    "airflow_skypilot.hooks.slurm",
                ],
            }
        ],
        "extra-links": ["airflow_skypilot.links.skypilot.SkyPilotJobLink"],
        "config": {
            "skypilot": {
                "description": "Defaults of the SkyPilot operator and sensor.",
                "options": {
                    "connections": {
                        "description": "Comma-separated Airflow connection ids the operator "
                                       "probes when a task gives none.",
                        "type": "string",
                        "example": "slurm_alpha,slurm_beta,k8s_default,aws_default",
                        "default": "",
                        "version_added": "0.1.0",
                    },
                    "probe_timeout": {
                        "description": "Seconds each connection gets to answer a capacity "
                                       "probe before it is skipped.",
                        "type": "float",
                        "example": "60",
                        "default": "60",
                        "version_added": "0.1.0",
                    },
                },
            }
        },
    }
