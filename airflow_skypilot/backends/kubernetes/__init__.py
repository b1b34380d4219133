"""The Kubernetes backend: one namespace of one cluster per Airflow ``kubernetes`` connection.

Split as SkyPilot splits ``clouds/`` from ``provision/``: what a cluster can offer
(:mod:`.cluster`, :mod:`.offers`), and launching and watching jobs (:mod:`.manifests`,
:mod:`.bundle`, :mod:`.submit`, :mod:`.status`, :mod:`.logs`), over the provider's hooks
(:mod:`.client`) with the connection's :mod:`.settings`. :class:`KubernetesBackend`
(:mod:`.backend`) is the thin facade the registry loads.
"""

from airflow_skypilot.backends.kubernetes.backend import KubernetesBackend
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.backends.kubernetes.status import job_status

__all__ = ["KubernetesBackend", "KubernetesSettings", "job_status"]
