"""What a Kubernetes connection says: the provider's own extras and ours.

A cluster is an Airflow ``kubernetes`` connection (kubeconfig path or content, context,
in-cluster, namespace: the provider's own extras, read by its hooks) with the extras of
:class:`KubernetesSettings`. One connection is one place: ``<context>/<namespace>``, infra
``kubernetes/<context>``. A connection without a namespace takes the one the cncf-kubernetes
pod operator and SkyPilot take (:func:`default_namespace`): the pod's own (in-cluster), else
the kubeconfig context's, else ``default``. The other modules of the backend take these
settings as an argument: only the facade reads our extras (and the provider's hooks theirs,
in :mod:`.client`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.backends.kubernetes.bundle import DEFAULT_BUNDLE_LIMIT
from airflow_skypilot.exceptions import ConfigurationError
from airflow_skypilot.spec import podsecurity
from airflow_skypilot.spec.source import dotted

#: where a pod reads its own namespace (the service account's mounted files)
INCLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def _kubeconfig_namespace(get: Callable[[str], Any]) -> str | None:
    """The namespace of the kubeconfig context the provider's hook loads ("" if it names
    none; None when there is no kubeconfig)."""
    import yaml

    content = get("kube_config")
    try:
        if content is not None:
            data = content if isinstance(content, Mapping) else yaml.safe_load(str(content))
        else:
            path = get("kube_config_path") or \
                (os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep)[0]
            text = _read(os.path.expanduser(str(path)))
            data = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return ""
    if not isinstance(data, Mapping):
        return None
    name = get("cluster_context") or data.get("current-context")
    for ctx in data.get("contexts") or []:
        if isinstance(ctx, Mapping) and ctx.get("name") == name:
            return str((ctx.get("context") or {}).get("namespace") or "")
    return ""


def default_namespace(get: Callable[[str], Any]) -> str:
    """A connection's namespace when it names none, as the cncf-kubernetes pod operator and
    SkyPilot choose it, in the order the provider's hook loads its configuration: the pod's
    own when it loads the in-cluster one (the ``in_cluster`` extra; or no kubeconfig extra
    while running in a pod: the hook tries in-cluster first), else the kubeconfig context's,
    else ``default``. (The provider's ``KubernetesHook.get_namespace`` reads only the extra.)
    Connections that named none used ``default`` before 2026-12-01: set ``namespace`` to keep
    it (a retry across the upgrade lists the new namespace only)."""
    if str(get("in_cluster") or "").lower() == "true":
        return _read(INCLUSTER_NAMESPACE) or "default"
    if get("kube_config") is None and get("kube_config_path") is None and \
            os.environ.get("KUBERNETES_SERVICE_HOST") and (own := _read(INCLUSTER_NAMESPACE)):
        return own
    return _kubeconfig_namespace(get) or "default"


@dataclass
class KubernetesSettings:
    """What a Kubernetes connection's extras may say, beyond the provider's own.

    ``image`` is the container image of tasks without ``image_id: docker:...`` (default
    ``python:3.11-slim``: small, and has bash, base64 and tar, which the pod's entry script
    needs; GPU tasks name a CUDA image). ``node_selector`` and ``tolerations`` (dict / list,
    or JSON text) apply to every job; ``image_error_grace`` is how long an image pull or
    container config error may last before the job fails; ``node_not_ready_grace`` how long
    a job's node may be NotReady before the job counts as lost to the infrastructure;
    ``pending_timeout`` (default: none, wait) how long a pod may stay unschedulable before
    the job is placed elsewhere (the capacity seen at placement is gone); a task's
    ``config.kubernetes.provision_timeout`` (SkyPilot's wait for the pods to be scheduled
    before failing over; negative: wait) replaces it for that job.
    ``allow_privileged_pod_config`` (default false) lets tasks' ``config.kubernetes.pod_config``
    use what :mod:`airflow_skypilot.spec.podsecurity` refuses (host namespaces, hostPath,
    privileged containers, another service account...): only for clusters whose admins trust
    every DAG (and every DAG run's ``conf``) that may use the connection.
    """

    context: str
    namespace: str = "default"
    image: str = "python:3.11-slim"
    service_account: str | None = None
    price_per_gpu_hour: float = 0.0
    price_per_node_hour: float = 0.0
    priority_class: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    image_error_grace: float = 60.0
    node_not_ready_grace: float = 120.0
    pending_timeout: float | None = None
    ttl_seconds_after_finished: int | None = 86400
    cluster_domain: str = "cluster.local"
    bundle_limit: int = DEFAULT_BUNDLE_LIMIT
    request_timeout: float = 30.0
    allow_privileged_pod_config: bool = False

    @classmethod
    def from_extra(cls, conn_id: str, extra: Mapping[str, Any]) -> KubernetesSettings:
        def get(name: str) -> Any:
            value = extra.get(name)
            if value in (None, ""):
                value = extra.get(f"extra__kubernetes__{name}")
            return None if value in (None, "") else value

        def structured(name: str, kind: type) -> Any:
            value = get(name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise ConfigurationError(f"connection {conn_id!r}: extra {name!r} is not "
                                             "valid JSON") from None
            if value is None:
                return kind()
            if not isinstance(value, kind):
                raise ConfigurationError(f"connection {conn_id!r}: extra {name!r} must be a "
                                         f"{kind.__name__}")
            return value

        def num(name: str, default: float) -> float:
            value = get(name)
            try:
                return default if value is None else float(value)
            except (TypeError, ValueError):
                raise ConfigurationError(f"connection {conn_id!r}: extra {name!r} must be a "
                                         f"number; got {value!r}") from None

        allow = get(podsecurity.ALLOW_EXTRA)
        if allow is not None and str(allow).lower() not in ("true", "false"):
            raise ConfigurationError(f"connection {conn_id!r}: extra "
                                     f"{podsecurity.ALLOW_EXTRA!r} must be true or false")

        ttl = get("ttl_seconds_after_finished")
        return cls(
            context=str(get("cluster_context") or conn_id),
            namespace=str(get("namespace") or default_namespace(get)),
            image=str(get("image") or "python:3.11-slim"),
            service_account=get("service_account"),
            price_per_gpu_hour=num("price_per_gpu_hour", 0.0),
            price_per_node_hour=num("price_per_node_hour", 0.0),
            priority_class=get("priority_class"),
            node_selector={str(k): str(v) for k, v in structured("node_selector", dict).items()},
            tolerations=list(structured("tolerations", list)),
            image_error_grace=num("image_error_grace", 60.0),
            node_not_ready_grace=num("node_not_ready_grace", 120.0),
            pending_timeout=float(get("pending_timeout")) if get("pending_timeout") is not None
            else None,
            ttl_seconds_after_finished=None if str(ttl).lower() in ("none", "-1", "off")
            else int(ttl) if ttl is not None else 86400,
            cluster_domain=str(get("cluster_domain") or "cluster.local"),
            bundle_limit=int(num("bundle_limit", DEFAULT_BUNDLE_LIMIT)),
            request_timeout=num("request_timeout", 30.0),
            allow_privileged_pod_config=str(allow).lower() == "true",
        )

    def pod_config_refusal(self, task: Any) -> str:
        """Why this connection refuses the task's ``config.kubernetes.pod_config`` ("" when
        it does not): the fields :func:`~airflow_skypilot.spec.podsecurity.refused` lists,
        unless the connection allows them."""
        raw = ((task.config.get("kubernetes") or {}).get("pod_config") or {})
        if self.allow_privileged_pod_config or not isinstance(raw, Mapping):
            return ""
        found = podsecurity.refused(raw)
        if not found:
            return ""
        parts = [f"config.kubernetes.pod_config.{dotted(path)}: {why}" for path, why in found]
        return ("; ".join(parts) + f" (refused unless the connection sets "
                                   f"'{podsecurity.ALLOW_EXTRA}': true)")

    @property
    def location(self) -> str:
        return f"{self.context}/{self.namespace}"

    @property
    def infra(self) -> str:
        return f"kubernetes/{self.context}"
