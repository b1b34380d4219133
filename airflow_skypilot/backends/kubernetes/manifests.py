"""The objects a job is made of, as plain dicts (pure: no I/O).

Every manifest here is what goes over the wire, so tests can check it against the Kubernetes
OpenAPI schema. How a job reaches its pods:

* a ``ConfigMap`` ``<job>-files``, mounted read-only at ``/etc/airflow-skypilot``: the entry
  script ``main.sh``, the node wrapper ``node.sh`` (shared with Slurm, see
  :mod:`~airflow_skypilot.backends.common.jobscript`), ``env.sh`` (the task's envs, quoted for
  bash) and the task's ``setup.sh``/``run.sh`` verbatim. Nothing the user wrote goes through a
  Job field, where Kubernetes would expand ``$(VAR)``.
* a ``Secret`` ``<job>-bundle`` (a task with a workdir or file mounts), mounted read-only at
  ``/etc/airflow-skypilot-bundle``: the local workdir and file mounts as base64 ``tar.gz``
  text (see :mod:`.bundle`). File mounts carry credentials (``~/.aws/credentials``...): a
  ConfigMap is readable with the built-in ``view`` role, a Secret is not; it is deleted with
  the task's Secret at cleanup (:func:`~.submit.cleanup`), not left until the Job's TTL.
* a ``Secret`` ``<job>-secrets`` with the task's secrets, loaded by ``envFrom``: the values are
  never in the Job spec, the ConfigMap or an annotation.
* for ``num_nodes > 1``, a headless ``Service`` named after the job; the pods of the Indexed
  Job set ``subdomain`` to it, so each rank has the stable name
  ``<job>-<rank>.<service>.<namespace>.svc.<cluster domain>``.

The container command is a fixed one-liner that runs ``main.sh`` (:mod:`.entry`: how a stop
reaches the task's programs); ``${SANDBOX_MOUNT_ROOT:-}`` is empty on a real cluster (the test
kubelet roots the pod's filesystem there).
:func:`job_for` and :func:`dependents_for` build them from a task, an offer and the settings.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.backends.base import Offer
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.common.fit import shape as shape_of
from airflow_skypilot.backends.kubernetes.bundle import Bundle
from airflow_skypilot.backends.kubernetes.cluster import GPU_TOLERATION
from airflow_skypilot.backends.kubernetes.entry import (
    BUNDLE_MOUNT,
    FILES_DIR_EXPR,
    FILES_MOUNT,
    WORKDIR_MOUNT,
    main_script,
)
from airflow_skypilot.backends.kubernetes.names import (
    ANN_PENDING_TIMEOUT,
    ANN_PREFIX,
    CONTAINER,
    GPU_RESOURCE,
    LABEL_JOB,
    bundle_name,
    configmap_name,
    key_error,
    label_value_error,
    labels_for,
    secret_name,
    service_name,
)
from airflow_skypilot.backends.kubernetes.settings import KubernetesSettings
from airflow_skypilot.exceptions import SubmissionError
from airflow_skypilot.spec.task import ResourceRequest, Task

#: SkyPilot's pod template mounts a memory-backed /dev/shm (a container's default is 64 MB,
#: too small for PyTorch's DataLoader workers and NCCL); a pod_config ``dshm`` replaces it
SHM_VOLUME = "dshm"
#: the API server's limit of a ConfigMap's or a Secret's data (1 MiB), less room for metadata
OBJECT_LIMIT = 1024 * 1024 - 16 * 1024
#: the container's command: no ``$(``, so Kubernetes' own variable expansion never applies
BOOTSTRAP = 'exec /bin/bash "${SANDBOX_MOUNT_ROOT:-}' + FILES_MOUNT + '/main.sh"'


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    """Dependents of the Job go with it (garbage collection, foreground deletion)."""
    return {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
            "uid": job["metadata"]["uid"], "blockOwnerDeletion": True}


# --- scripts --------------------------------------------------------------------------------


def files_data(task: Task, *, job_name: str, namespace: str, node_env: Mapping[str, str],
               cluster_domain: str, files: Bundle) -> dict[str, str]:
    """Everything the ConfigMap holds (the scripts; ``files`` go in the bundle Secret, see
    :func:`bundle_manifest`). ``node_env`` must not contain secrets."""
    node = jobscript.node_script(job_dir=FILES_DIR_EXPR, workdir='"$AIRFLOW_SKYPILOT_WORKDIR"',
                                 rank_var="JOB_COMPLETION_INDEX", has_setup=bool(task.setup),
                                 has_run=bool(task.run))
    data = {
        "main.sh": main_script(job_name=job_name, namespace=namespace,
                               num_nodes=task.num_nodes, cluster_domain=cluster_domain,
                               targets=files.targets),
        "node.sh": node,
        "env.sh": jobscript.exports(node_env),
        "setup.sh": jobscript.user_script(task.setup) or "",
        "run.sh": jobscript.user_script(task.run) or "",
    }
    return data


def has_files(task: Task) -> bool:
    """Does the task's job have a bundle Secret (a workdir or file mounts)?"""
    return bool(task.workdir or task.file_mounts)


# --- the task's labels and annotations ---------------------------------------------------------


@dataclass
class UserMetadata:
    """What the task puts on the job's objects, as SkyPilot does: ``resources.labels`` of the
    chosen candidate on the pods (its kubernetes-ray template: "Custom tags for the pods"),
    and here on the Job too; ``config.kubernetes.custom_metadata`` labels and annotations on
    every object of the job (SkyPilot: "all Kubernetes resources" it creates). Ours
    (:func:`~.names.labels_for`, ``skypilot.airflow/`` annotations) always win."""

    resource_labels: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # custom_metadata.labels
    annotations: dict[str, str] = field(default_factory=dict)  # custom_metadata.annotations


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _entries(where: str, raw: Any, *, labels: bool) -> tuple[dict[str, str], list[str]]:
    if raw is None:
        return {}, []
    if not isinstance(raw, Mapping):
        return {}, [f"{where}: must be a mapping of names to strings; got {raw!r}"]
    out: dict[str, str] = {}
    errors: list[str] = []
    for key, value in raw.items():
        text = _text(value)
        if not isinstance(key, str) or text is None:
            errors.append(f"{where}: {key!r} must map a name to a string; got {value!r}")
            continue
        why = key_error(key) or (label_value_error(key, text) if labels else "")
        if why:
            errors.append(f"{where}: {why}")
        out[key] = text
    return out, errors


def user_metadata(task: Task, req: ResourceRequest) -> tuple[UserMetadata, str]:
    """The task's labels and annotations for candidate ``req``, and why they cannot be
    applied ("" when they can): keys and label values must be valid Kubernetes ones."""
    errors: list[str] = []
    resource_labels, bad = _entries("resources.labels", dict(req.labels or {}), labels=True)
    errors += bad
    kube = task.config.get("kubernetes") if isinstance(task.config, Mapping) else None
    custom = (kube or {}).get("custom_metadata") if isinstance(kube, Mapping) else None
    where = "config.kubernetes.custom_metadata"
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    if isinstance(custom, Mapping):
        if extra := sorted(str(k) for k in custom if k not in ("labels", "annotations")):
            errors.append(f"{where}: only labels and annotations are applied; got "
                          f"{', '.join(extra)}")
        labels, bad = _entries(f"{where}.labels", custom.get("labels"), labels=True)
        errors += bad
        annotations, bad = _entries(f"{where}.annotations", custom.get("annotations"),
                                    labels=False)
        errors += bad
    elif custom is not None:
        errors.append(f"{where}: must be a mapping with labels and/or annotations")
    return UserMetadata(resource_labels, labels, annotations), "; ".join(errors)


def metadata_refusal(task: Task, req: ResourceRequest) -> str:
    """Why the task's labels/annotations cannot go on the job's objects ("" when they can)."""
    return user_metadata(task, req)[1]


def _apply(meta: dict[str, Any], labels: Mapping[str, str],
           annotations: Mapping[str, str]) -> None:
    """The task's labels and annotations under what ``meta`` already has (ours win)."""
    if labels:
        meta["labels"] = {**labels, **(meta.get("labels") or {})}
    if annotations:
        meta["annotations"] = {**annotations, **(meta.get("annotations") or {})}


# --- manifests ------------------------------------------------------------------------------


def _meta(name: str, namespace: str, job_name: str, owner: Mapping[str, Any] | None = None,
          user: UserMetadata | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels_for(job_name)}
    if user is not None:
        _apply(meta, user.labels, user.annotations)
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def configmap_manifest(job_name: str, namespace: str, data: Mapping[str, str],
                       owner: Mapping[str, Any] | None = None,
                       user: UserMetadata | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(configmap_name(job_name), namespace, job_name, owner, user),
            "immutable": True, "data": dict(data)}


def secret_manifest(job_name: str, namespace: str, secrets: Mapping[str, str],
                    owner: Mapping[str, Any] | None = None,
                    user: UserMetadata | None = None) -> dict[str, Any]:
    data = {k: base64.b64encode(str(v).encode()).decode("ascii") for k, v in secrets.items()}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": _meta(secret_name(job_name), namespace, job_name, owner, user),
            "data": data}


def bundle_manifest(job_name: str, namespace: str, files: Bundle,
                    owner: Mapping[str, Any] | None = None,
                    user: UserMetadata | None = None) -> dict[str, Any]:
    """The workdir and file mounts (base64 tar.gz text per key) as a Secret."""
    manifest = secret_manifest(job_name, namespace, files.data, owner, user)
    manifest["metadata"]["name"] = bundle_name(job_name)
    return manifest


def data_size(obj: Mapping[str, Any]) -> int:
    """The bytes of a ConfigMap's or Secret's data as the API server counts them (a Secret's
    decoded), against its 1 MiB limit."""
    if obj.get("kind") == "Secret":
        return sum(len(base64.b64decode(v)) for v in (obj.get("data") or {}).values())
    return sum(len(str(v).encode()) for v in (obj.get("data") or {}).values())


def too_large(objects: list[Mapping[str, Any]], limit: int = OBJECT_LIMIT) -> str:
    """Why one of a job's ConfigMap/Secrets would be refused for its size ("" when none)."""
    for obj in objects:
        if obj.get("kind") in ("ConfigMap", "Secret") and (size := data_size(obj)) > limit:
            keys = sorted((obj.get("data") or {}), key=lambda k: -len(obj["data"][k]))[:3]
            return (f"the job's {obj['kind']} {obj['metadata']['name']} would hold "
                    f"{size // 1024} KiB (largest: {', '.join(keys)}); the API server takes "
                    f"at most {limit // 1024} KiB (scripts, envs, workdir and file_mounts "
                    "travel in it)")
    return ""


def service_manifest(job_name: str, namespace: str, owner: Mapping[str, Any] | None = None,
                     user: UserMetadata | None = None) -> dict[str, Any]:
    """Headless: no cluster IP, one DNS record per pod, published before pods are ready."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(service_name(job_name), namespace, job_name, owner, user),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_JOB: job_name}}}


@dataclass
class PodShape:
    """What one pod of the job asks for and where it may go."""

    image: str
    gpus: int = 0
    cpus: float | None = None
    memory_gb: float | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    service_account: str | None = None
    priority_class: str | None = None
    pvcs: dict[str, str] = field(default_factory=dict)  # mount path -> claim name
    has_files: bool = False  # a bundle Secret (workdir, file mounts) to mount
    pod_config: dict[str, Any] = field(default_factory=dict)  # config.kubernetes.pod_config


def cpu_quantity(cpus: float) -> str:
    return str(int(cpus)) if float(cpus).is_integer() else f"{int(round(cpus * 1000))}m"


def memory_quantity(gb: float) -> str:
    return f"{int(gb)}Gi" if float(gb).is_integer() else f"{int(round(gb * 1024))}Mi"


def job_manifest(job_name: str, namespace: str, num_nodes: int, shape: PodShape, *,
                 annotations: Mapping[str, str], has_secrets: bool,
                 ttl_seconds_after_finished: int | None, suspend: bool = True,
                 user: UserMetadata | None = None) -> dict[str, Any]:
    """The ``batch/v1`` Job. Created suspended: it starts once its ConfigMap and Secret exist.

    ``backoffLimit: 0`` (recovery is ours); the pod failure policy fails the Job at once and
    records why (disruption vs exit code) in the Job's condition, which outlives the pods.
    The pods carry ``resources.labels``, then a pod_config's metadata, then ``custom_metadata``
    (SkyPilot's order), then ours; the Job the same but a pod_config's.
    """
    labels = labels_for(job_name)
    user = user or UserMetadata()
    resources: dict[str, Any] = {}
    requests: dict[str, str] = {}
    if shape.cpus:
        requests["cpu"] = cpu_quantity(shape.cpus)
    if shape.memory_gb:
        requests["memory"] = memory_quantity(shape.memory_gb)
    if requests:
        resources["requests"] = requests
    if shape.gpus:
        resources["limits"] = {GPU_RESOURCE: str(int(shape.gpus))}
    mounts: list[dict[str, Any]] = [
        {"name": "skypilot-files", "mountPath": FILES_MOUNT, "readOnly": True},
        {"name": "skypilot-workdir", "mountPath": WORKDIR_MOUNT},
        {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "skypilot-files",
         "configMap": {"name": configmap_name(job_name), "defaultMode": 0o444}},
        {"name": "skypilot-workdir", "emptyDir": {}},
        {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}},
    ]
    if shape.has_files:
        mounts.append({"name": "skypilot-bundle", "mountPath": BUNDLE_MOUNT, "readOnly": True})
        volumes.append({"name": "skypilot-bundle",
                        "secret": {"secretName": bundle_name(job_name), "defaultMode": 0o444}})
    for i, (path, claim) in enumerate(sorted(shape.pvcs.items())):
        mounts.append({"name": f"volume-{i}", "mountPath": path})
        volumes.append({"name": f"volume-{i}", "persistentVolumeClaim": {"claimName": claim}})
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": shape.image,
        "command": ["/bin/bash", "-c", BOOTSTRAP],
        "env": [{"name": "AIRFLOW_SKYPILOT_POD_IP",
                 "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "volumeMounts": mounts,
    }
    if has_secrets:
        container["envFrom"] = [{"secretRef": {"name": secret_name(job_name)}}]
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": volumes,
    }
    if shape.node_selector:
        pod_spec["nodeSelector"] = dict(shape.node_selector)
    if shape.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in shape.tolerations]
    if shape.service_account:
        pod_spec["serviceAccountName"] = shape.service_account
    if shape.priority_class:
        pod_spec["priorityClassName"] = shape.priority_class
    spec: dict[str, Any] = {
        "backoffLimit": 0,
        "suspend": suspend,
        "completions": num_nodes,
        "parallelism": num_nodes,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob",
             "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob",
             "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}},
        ]},
        "template": {"metadata": {"labels": {**user.resource_labels, **labels}},
                     "spec": pod_spec},
    }
    if num_nodes > 1:
        spec["completionMode"] = "Indexed"
        pod_spec["subdomain"] = service_name(job_name)
        # one rank per machine, as a SkyPilot "node" is
        pod_spec["affinity"] = {"podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": {"matchLabels": {LABEL_JOB: job_name}},
                "topologyKey": "kubernetes.io/hostname"}]}}
    if ttl_seconds_after_finished is not None:
        spec["ttlSecondsAfterFinished"] = int(ttl_seconds_after_finished)
    if shape.pod_config:
        merge_pod_config(spec["template"], shape.pod_config)
        if shape.node_selector:  # a pod_config may narrow the nodes, not swap the connection's
            spec["template"]["spec"]["nodeSelector"].update(shape.node_selector)
    pod_meta = spec["template"]["metadata"]
    pod_meta["labels"] = {**(pod_meta.get("labels") or {}), **user.labels, **labels}  # ours win
    if user.annotations:
        pod_meta["annotations"] = {**(pod_meta.get("annotations") or {}), **user.annotations}
    meta = {"name": job_name, "namespace": namespace, "labels": dict(labels),
            "annotations": dict(annotations)}
    _apply(meta, {**user.resource_labels, **user.labels}, user.annotations)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


def merge_pod_config(template: dict[str, Any], pod_config: Mapping[str, Any]) -> None:
    """SkyPilot's ``config.kubernetes.pod_config`` over our pod template: dicts merge,
    ``containers`` merge by position, ``volumes`` and ``volumeMounts`` by name (a mount also
    by path: a user's ``dshm`` with a ``sizeLimit`` replaces ours), other lists are appended
    to; the fields that wire the job (command, restart policy, subdomain, our labels, our
    ``skypilot-*`` volumes) stay ours."""
    def merge(dst: dict[str, Any], src: Mapping[str, Any], path: str) -> None:
        for key, value in src.items():
            here = f"{path}.{key}" if path else key
            if here in _OURS:
                continue
            if key not in dst:
                dst[key] = copy.deepcopy(value)
            elif isinstance(dst[key], dict) and isinstance(value, Mapping):
                merge(dst[key], value, here)
            elif isinstance(dst[key], list) and isinstance(value, list):
                if here == "spec.containers":
                    for i, item in enumerate(value):
                        if i < len(dst[key]) and isinstance(item, Mapping):
                            merge(dst[key][i], item, f"{here}[{i}]")
                        else:
                            dst[key].append(copy.deepcopy(item))
                elif key in ("volumes", "volumeMounts"):
                    _merge_by_name(dst[key], value, key)
                else:
                    dst[key].extend(copy.deepcopy(value))
            else:
                dst[key] = copy.deepcopy(value)

    merge(template, pod_config, "")


def _merge_by_name(ours: list[Any], theirs: list[Any], key: str) -> None:
    """A pod_config volume (mount) replaces ours of the same name (a mount: or path), but
    never one of the job's own ``skypilot-*``; the others are appended."""
    for item in theirs:
        if not isinstance(item, Mapping):
            ours.append(copy.deepcopy(item))
            continue

        def same(mine: Any, item: Mapping[str, Any] = item) -> bool:
            return isinstance(mine, Mapping) and (
                mine.get("name") == item.get("name") or
                (key == "volumeMounts" and mine.get("mountPath") == item.get("mountPath")))

        if any(same(mine) and str(mine.get("name", "")).startswith("skypilot-")
               for mine in ours):
            continue
        ours[:] = [mine for mine in ours if not same(mine)]
        ours.append(copy.deepcopy(item))


#: fields a pod_config may not replace (they would break the job's wiring)
_OURS = {"spec.restartPolicy", "spec.subdomain", "spec.containers[0].name",
         "spec.containers[0].command", "spec.containers[0].args"}


# --- from a task and an offer ---------------------------------------------------------------


def job_for(settings: KubernetesSettings, task: Task, offer: Offer, job_name: str,
            env: Mapping[str, str]) -> dict[str, Any]:
    """The Job for ``task`` at ``offer`` (created suspended; its dependents come next)."""
    s = settings
    if refusal := s.pod_config_refusal(task):  # the offer did not fit: never here but by hand
        raise SubmissionError(refusal, retry_elsewhere=True)
    req = offer.request
    user, refusal = user_metadata(task, req)
    if refusal:  # likewise (the facade's unsupported() refuses it at placement)
        raise SubmissionError(refusal, retry_elsewhere=True)
    gpus, cpus, mem = shape_of(req)
    node_selector = dict(s.node_selector)
    node_selector.update(offer.details.get("node_selector") or {})
    tolerations = list(s.tolerations) + list(offer.details.get("tolerations") or [])
    if gpus and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append(dict(GPU_TOLERATION))
    pod_config = ((task.config.get("kubernetes") or {}).get("pod_config") or {})
    shape = PodShape(
        image=req.container_image or s.image, gpus=gpus, cpus=cpus or None,
        memory_gb=mem or None, node_selector=node_selector, tolerations=tolerations,
        service_account=s.service_account, priority_class=s.priority_class,
        pvcs={str(k): str(v) for k, v in task.volumes.items()}, has_files=has_files(task),
        pod_config=dict(pod_config) if isinstance(pod_config, Mapping) else {})
    annotations = {
        ANN_PREFIX + "managed": "true",
        ANN_PREFIX + "location": s.location,
        ANN_PREFIX + "infra": s.infra,
        ANN_PREFIX + "accelerator": offer.accelerator or req.accelerator or "",
        ANN_PREFIX + "gpus-per-node": str(gpus),
        ANN_PREFIX + "price-per-hour": f"{offer.price_per_hour:g}",
        ANN_PREFIX + "spot": "true" if req.use_spot else "false",
        ANN_PREFIX + "secret": "true" if task.secrets else "false",
        ANN_PREFIX + "task-id": str(env.get("SKYPILOT_TASK_ID", job_name)),
    }
    if (timeout := provision_timeout(task)) is not None:
        annotations[ANN_PENDING_TIMEOUT] = str(timeout)
    return job_manifest(job_name, s.namespace, task.num_nodes, shape,
                        annotations=annotations, has_secrets=bool(task.secrets),
                        ttl_seconds_after_finished=s.ttl_seconds_after_finished, user=user)


def provision_timeout(task: Task) -> int | None:
    """``config.kubernetes.provision_timeout``: SkyPilot waits that long for the pods to be
    scheduled, then fails over (negative: waits indefinitely). Here it is the job's
    ``pending_timeout`` (status reads it from the Job, over the connection's)."""
    kube = task.config.get("kubernetes") if isinstance(task.config, Mapping) else None
    value = kube.get("provision_timeout") if isinstance(kube, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def dependents_for(settings: KubernetesSettings, task: Task, offer: Offer, job_name: str,
                   env: Mapping[str, str], files: Bundle,
                   owner: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The ConfigMap, Secrets (the task's, its files) and (several nodes) Service of the Job
    ``owner``."""
    s = settings
    req = offer.request
    user, _ = user_metadata(task, req)  # refused before the Job was built (job_for)
    info = {"cluster_name": s.context, "cloud": "Kubernetes", "region": s.context,
            "zone": s.namespace}
    node_env = jobscript.skypilot_env(
        task, task_id=env.get("SKYPILOT_TASK_ID", job_name),
        num_gpus_per_node=jobscript.gpus_per_node(req.accelerator_count
                                                  if req.accelerator else 0),
        cluster_info=info, extra=env)
    for key in task.secrets:  # secrets come from the Secret (envFrom) and win
        node_env.pop(key, None)
    data = files_data(task, job_name=job_name, namespace=s.namespace, node_env=node_env,
                      cluster_domain=s.cluster_domain, files=files)
    out = [configmap_manifest(job_name, s.namespace, data, owner, user)]
    if task.secrets:
        out.append(secret_manifest(job_name, s.namespace, task.secrets, owner, user))
    if has_files(task):
        out.append(bundle_manifest(job_name, s.namespace, files, owner, user))
    if task.num_nodes > 1:
        out.append(service_manifest(job_name, s.namespace, owner, user))
    return out


__all__ = [
    "BOOTSTRAP", "PodShape", "UserMetadata", "bundle_manifest", "configmap_manifest",
    "dependents_for",
    "files_data", "job_for", "job_manifest", "main_script", "merge_pod_config",
    "metadata_refusal", "provision_timeout", "user_metadata",
    "secret_manifest", "service_manifest", "too_large",
]
