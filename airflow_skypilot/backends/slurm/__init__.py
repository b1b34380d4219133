"""Slurm clusters over SSH (the ssh provider's ``SSHHook`` / ``SSHHookAsync``).

The facade is :class:`SlurmBackend` (``backend``); the modules it delegates to each own one
concern and import neither it nor each other in a cycle:

``settings``  the connection's extras and the sbatch arguments they give
``shell``     the ``@@section`` framing of remote scripts, remote path words
``remote``    the SSH runner (paramiko / asyncssh) and SFTP uploads
``cluster``   the probe script and its parser (nodes, partitions, start estimates)
``offers``    offers and ``show-gpus`` rows from a probe (the shared node-pool fit rule)
``submit``    the job's files and upload plan, sbatch once per name, adoption, cancel
``status``    the status script, its parser and the state mapping
``logs``      log reads by byte offset, many jobs per command
"""

from airflow_skypilot.backends.slurm.backend import SlurmBackend
from airflow_skypilot.backends.slurm.cluster import parse_cluster, parse_gres
from airflow_skypilot.backends.slurm.settings import SlurmSettings
from airflow_skypilot.backends.slurm.status import parse_status

__all__ = ["SlurmBackend", "SlurmSettings", "parse_cluster", "parse_gres", "parse_status"]
