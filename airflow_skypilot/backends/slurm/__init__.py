"""Slurm clusters over SSH (the ssh provider's ``SSHHook`` / ``SSHHookAsync``)."""

from airflow_skypilot.backends.slurm.backend import (
    SlurmBackend,
    SlurmSettings,
    parse_cluster,
    parse_gres,
    parse_status,
)

__all__ = ["SlurmBackend", "SlurmSettings", "parse_cluster", "parse_gres", "parse_status"]
