"""What a Slurm connection says beyond SSH: its extras, and the sbatch arguments they give.

A Slurm cluster is an Airflow connection (type ``slurm``, or a plain ``ssh``) to its login node.
Its extras name the cluster (as in ``infra: slurm/<cluster>/<partition>``), restrict partitions,
and add accounting and scheduling options to every ``sbatch`` (the real one and the
``--test-only`` probe alike, so the estimate is for the job that will be submitted).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.spec.task import Task

#: the backend's name in handles, offers and infra strings
BACKEND = "slurm"


@dataclass
class SlurmSettings:
    """What a Slurm connection's extras may say (all optional)."""

    cluster: str
    partitions: list[str] | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    reservation: str | None = None
    sbatch_options: list[str] = field(default_factory=list)
    time_limit: str | None = None
    remote_work_dir: str = "~/.airflow-skypilot"
    price_per_gpu_hour: float = 0.0
    price_per_node_hour: float = 0.0
    command_timeout: float = 60.0

    @classmethod
    def from_extra(cls, conn_id: str, extra: Mapping[str, Any]) -> SlurmSettings:
        def strings(value: Any) -> list[str] | None:
            if value in (None, "", []):
                return None
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            return [str(v) for v in value]

        options = extra.get("sbatch_options") or []
        if isinstance(options, str):
            options = shlex.split(options)
        return cls(
            cluster=str(extra.get("cluster") or conn_id),
            partitions=strings(extra.get("partitions")),
            account=extra.get("account") or None,
            qos=extra.get("qos") or None,
            constraint=extra.get("constraint") or None,
            reservation=extra.get("reservation") or None,
            sbatch_options=[str(o) for o in options],
            time_limit=str(extra["time_limit"]) if extra.get("time_limit") else None,
            remote_work_dir=str(extra.get("remote_work_dir") or "~/.airflow-skypilot"),
            price_per_gpu_hour=float(extra.get("price_per_gpu_hour") or 0.0),
            price_per_node_hour=float(extra.get("price_per_node_hour") or 0.0),
            command_timeout=float(extra.get("command_timeout") or 60.0),
        )

    @classmethod
    def from_connection(cls, conn_id: str) -> SlurmSettings:
        """Read the Airflow connection (a blocking SDK call) and its extras."""
        from airflow_skypilot.compat import get_connection

        return cls.from_extra(conn_id, get_connection(conn_id).extra_dejson or {})

    def common_sbatch_args(self) -> list[str]:
        """The connection's options for every sbatch: account, qos, ... then its own list."""
        out = []
        for flag, value in (("--account", self.account), ("--qos", self.qos),
                            ("--constraint", self.constraint),
                            ("--reservation", self.reservation), ("--time", self.time_limit)):
            if value:
                out.append(f"{flag}={value}")
        return out + list(self.sbatch_options)

    def infra(self, partition: str | None = None) -> str:
        """``slurm/<cluster>``, or ``slurm/<cluster>/<partition>`` when a partition is given."""
        base = f"{BACKEND}/{self.cluster}"
        return base if partition is None else f"{base}/{partition}"


def task_sbatch_options(task: Task) -> list[str]:
    """``config.slurm.sbatch_options`` (SkyPilot's per-task override) as directives."""
    opts = (task.config.get("slurm") or {}).get("sbatch_options")
    if isinstance(opts, dict):
        return [f"--{k}={v}" if v is not True else f"--{k}" for k, v in opts.items()]
    if isinstance(opts, list):
        return [str(o) for o in opts]
    return []
