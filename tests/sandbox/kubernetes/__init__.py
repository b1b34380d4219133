"""Kubernetes test sandbox: kmock's API emulator on loopback plus a control plane and kubelet.

Start it with ``python -m tests.sandbox.kubernetes up`` or :class:`KubernetesSandbox` ``.up()``;
talk to it with the real ``kubernetes`` / ``kubernetes_asyncio`` clients (or the cncf-kubernetes
hooks) through ``<state>/kubeconfig`` or the ``k8s_sandbox`` Airflow connection.
"""

from tests.sandbox.kubernetes.sandbox import (
    CONN_ID,
    NOPODS_CONN_ID,
    KubernetesSandbox,
    sandbox_port,
)

__all__ = ["CONN_ID", "NOPODS_CONN_ID", "KubernetesSandbox", "sandbox_port"]
