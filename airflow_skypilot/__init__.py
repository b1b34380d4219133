"""airflow-skypilot: one SkyPilot task YAML, placed on Slurm, Kubernetes or AWS by live capacity."""

__version__ = "0.2.0"
