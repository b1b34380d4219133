"""airflow-skypilot: one SkyPilot task YAML, placed on Slurm, Kubernetes or AWS by live capacity."""

__version__ = "0.1.0"
