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
        "operators": [
            {
                "integration-name": "SkyPilot",
                "python-modules": ["airflow_skypilot.operators.skypilot"],
            }
        ],
        "sensors": [
            {
                "integration-name": "SkyPilot",
                "python-modules": ["airflow_skypilot.sensors.skypilot"],
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
        "triggers": [
            {
                "integration-name": "SkyPilot",
                "python-modules": ["airflow_skypilot.triggers.skypilot"],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_skypilot.hooks.slurm.SlurmHook",
                "hook-name": "Slurm (SSH login node)",
                "connection-type": "slurm",
            }
        ],
        "extra-links": ["airflow_skypilot.links.skypilot.SkyPilotJobLink"],
        # @task.skypilot
        "task-decorators": [
            {"class-name": "airflow_skypilot.decorators.skypilot.skypilot_task",
             "name": "skypilot"},
        ],
        # No "plugins": the UI plugin loads through its `airflow.plugins` entry point, which
        # Airflow reads in every mode. Provider-declared plugins load only with eager provider
        # discovery ([core] lazy_discover_providers = False), and there a plugin declared both
        # ways is registered twice: "Plugin 'skypilot' already registered, skipping" becomes a
        # plugin import error in `airflow plugins` and the UI.
        "config": {
            "skypilot": {
                "description": "Defaults of the SkyPilot operator, sensor and UI pages.",
                "options": {
                    "connections": {
                        "description": "Comma-separated Airflow connection ids the operator "
                                       "probes when a task gives none (and the capacity page "
                                       "shows when the URL names none).",
                        "type": "string",
                        "example": "slurm_alpha,slurm_beta,k8s_default,aws_default",
                        "default": "",
                        "version_added": "0.1.0",
                    },
                    "deferrable": {
                        "description": "Whether the SkyPilot operator and sensor defer (wait in "
                                       "the triggerer, holding no worker slot) when a task "
                                       "does not say. ``[operators] default_deferrable = "
                                       "True`` keeps them deferrable whatever this says.",
                        "type": "boolean",
                        "example": "False",
                        "default": "True",
                        "version_added": "0.1.0",
                    },
                    "probe_timeout": {
                        "description": "Seconds each connection gets to answer a capacity "
                                       "probe before it is skipped (the capacity page waits "
                                       "20 seconds at most).",
                        "type": "float",
                        "example": "60",
                        "default": "60",
                        "version_added": "0.1.0",
                    },
                    "unreachable_timeout": {
                        "description": "Seconds a job's backend may stay silent (its login node, "
                                       "API or region cannot be asked, or cannot say) before "
                                       "the job counts as lost and is placed again. Shorter "
                                       "silences are waited out: a job is never taken for "
                                       "gone because one poll failed.",
                        "type": "float",
                        "example": "600",
                        "default": "300",
                        "version_added": "0.2.0",
                    },
                    "block_cooldown": {
                        "description": "Seconds a place that failed (a node failure, a refused "
                                       "submission) stays out of the placement of that task.",
                        "type": "float",
                        "example": "1800",
                        "default": "600",
                        "version_added": "0.2.0",
                    },
                    "placement_ledger": {
                        "description": "File where placements decided moments ago are noted, "
                                       "so tasks placing at the same moment (a sweep) do not "
                                       "all pick the same free place; shared by the workers "
                                       "that mount it. Empty turns it off.",
                        "type": "string",
                        "example": "/shared/airflow/skypilot/placements.json",
                        "default": "$AIRFLOW_HOME/skypilot/placements.json",
                        "version_added": "0.2.0",
                    },
                    "deployment_id": {
                        "description": "A name for this Airflow deployment, part of every job's "
                                       "identity. Set it (differently) in each deployment when "
                                       "two share a cluster account or cloud account, so that "
                                       "neither adopts nor stops the other's jobs.",
                        "type": "string",
                        "example": "ml-prod",
                        "default": "",
                        "version_added": "0.2.0",
                    },
                },
            }
        },
    }
