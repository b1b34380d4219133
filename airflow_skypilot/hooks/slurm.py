"""The ``slurm`` connection type: an SSH connection to a cluster's login node, plus extras.

It is the ssh provider's SSHHook (same fields, same host key checking); what it adds is the
connection form in the UI and the Slurm extras (see :class:`SlurmSettings`).
"""

from __future__ import annotations

from typing import Any

from airflow.providers.ssh.hooks.ssh import SSHHook

from airflow_skypilot.backends.slurm.settings import SlurmSettings


class SlurmHook(SSHHook):
    """SSH to a Slurm login node. Extras: ``cluster``, ``partitions``, ``account``, ``qos``,
    ``constraint``, ``reservation``, ``sbatch_options``, ``time_limit``, ``remote_work_dir``,
    ``price_per_gpu_hour``, ``price_per_node_hour``, and the ssh provider's own (``key_file``,
    ``private_key``, ``host_key``, ``no_host_key_check``...)."""

    conn_name_attr = "slurm_conn_id"
    default_conn_name = "slurm_default"
    conn_type = "slurm"
    hook_name = "Slurm (SSH login node)"

    def __init__(self, slurm_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(ssh_conn_id=slurm_conn_id, **kwargs)
        self.slurm_conn_id = slurm_conn_id

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema"],
            "relabeling": {"host": "Login node", "login": "Username"},
            "placeholders": {
                "extra": '{"cluster": "alpha", "partitions": "gpu,debug", "account": "ml", '
                         '"time_limit": "1-00:00:00", "price_per_gpu_hour": 0, '
                         '"host_key": "ssh-ed25519 AAAA..."}',
            },
        }

    def settings(self) -> SlurmSettings:
        conn = self.get_connection(self.slurm_conn_id)
        return SlurmSettings.from_extra(self.slurm_conn_id, conn.extra_dejson or {})
