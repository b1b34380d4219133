"""The objects the Kubernetes backend creates, as plain dicts (pure: no I/O but reading files).

Every manifest here is what goes over the wire, so tests can check it against the Kubernetes
OpenAPI schema. How a job reaches its pods:

* a ``ConfigMap`` ``<job>-files``, mounted read-only at ``/etc/airflow-skypilot``: the entry
  script ``main.sh``, the node wrapper ``node.sh`` (shared with Slurm, see
  :mod:`~airflow_skypilot.backends.jobscript`), ``env.sh`` (the task's envs, quoted for bash),
  the task's ``setup.sh``/``run.sh`` verbatim, and the local workdir and file mounts as
  base64 ``tar.gz`` text (a ConfigMap holds at most 1 MiB; :data:`DEFAULT_BUNDLE_LIMIT`).
  Nothing the user wrote goes through a Job field, where Kubernetes would expand ``$(VAR)``.
* a ``Secret`` ``<job>-secrets`` with the task's secrets, loaded by ``envFrom``: the values are
  never in the Job spec, the ConfigMap or an annotation.
* for ``num_nodes > 1``, a headless ``Service`` named after the job; the pods of the Indexed
  Job set ``subdomain`` to it, so each rank has the stable name
  ``<job>-<rank>.<service>.<namespace>.svc.<cluster domain>``.

The container command is a fixed one-liner that runs ``main.sh``; ``${SANDBOX_MOUNT_ROOT:-}``
is empty on a real cluster (the test kubelet roots the pod's filesystem there).
"""

from __future__ import annotations

import base64
import copy
import io
import os
import shlex
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.common.workdir import ignore_patterns, is_ignored
from airflow_skypilot.spec.task import Task

#: labels and annotations (``skypilot.airflow/`` is ours)
LABEL_JOB = "skypilot.airflow/job-name"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGED_BY = "airflow-skypilot"
ANN_PREFIX = "skypilot.airflow/"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"

CONTAINER = "main"
GPU_RESOURCE = "nvidia.com/gpu"
FILES_MOUNT = "/etc/airflow-skypilot"
WORKDIR_MOUNT = "/sky_workdir"
FILES_DIR_EXPR = '"${SANDBOX_MOUNT_ROOT:-}' + FILES_MOUNT + '"'
#: the container's command: no ``$(``, so Kubernetes' own variable expansion never applies
BOOTSTRAP = 'exec /bin/bash "${SANDBOX_MOUNT_ROOT:-}' + FILES_MOUNT + '/main.sh"'

#: the ConfigMap's payload limit (the API server refuses objects over 1 MiB in all)
DEFAULT_BUNDLE_LIMIT = 900 * 1024
#: stop reading a workdir once this many raw bytes were seen (it cannot compress that well)
_RAW_FACTOR = 64


class BundleTooLarge(ValueError):
    """The workdir and file mounts do not fit in one ConfigMap."""


# --- names ----------------------------------------------------------------------------------


def service_name(job_name: str) -> str:
    """A Service name is a DNS-1035 label (starts with a letter): the job name when it is one."""
    if job_name[:1].isalpha():
        return job_name
    return ("s-" + job_name)[:63].rstrip("-")


def configmap_name(job_name: str) -> str:
    return f"{job_name}-files"


def secret_name(job_name: str) -> str:
    return f"{job_name}-secrets"


def pod_hostname(job_name: str, rank: int) -> str:
    return f"{job_name}-{rank}"


def node_addresses(job_name: str, namespace: str, num_nodes: int,
                   cluster_domain: str = "cluster.local") -> list[str]:
    """``SKYPILOT_NODE_IPS`` of a multi-node job: stable pod DNS names, in rank order."""
    svc = service_name(job_name)
    return [f"{pod_hostname(job_name, i)}.{svc}.{namespace}.svc.{cluster_domain}"
            for i in range(num_nodes)]


def labels_for(job_name: str) -> dict[str, str]:
    return {LABEL_MANAGED: MANAGED_BY, LABEL_JOB: job_name}


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    """Dependents of the Job go with it (garbage collection, foreground deletion)."""
    return {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
            "uid": job["metadata"]["uid"], "blockOwnerDeletion": True}


# --- workdir and file mounts ----------------------------------------------------------------


@dataclass
class Bundle:
    """ConfigMap keys (base64 tar.gz text) and where main.sh unpacks each."""

    data: dict[str, str] = field(default_factory=dict)
    targets: list[tuple[str, str]] = field(default_factory=list)  # (key, shell word of dir)

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.data.values())


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Files unpack as the pod's user, whatever uid the Airflow worker has."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _tar_b64(entries: list[tuple[str, str]], raw_limit: int) -> str:
    """(local path, name in the archive) pairs -> base64 of a tar.gz; bounded reading."""
    raw = 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for path, arcname in entries:
            if os.path.isfile(path) and not os.path.islink(path):
                raw += os.path.getsize(path)
                if raw > raw_limit:
                    raise BundleTooLarge(f"more than {raw_limit // 1024} KiB of files")
            tar.add(path, arcname=arcname, recursive=False, filter=_root_owned)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _tree(local: str) -> list[tuple[str, str]]:
    """Every file and directory under ``local`` (minus .git and .skyignore), archive-relative."""
    patterns = ignore_patterns(local)
    out: list[tuple[str, str]] = []
    for root, dirs, files in os.walk(local):
        rel_root = os.path.relpath(root, local)
        dirs[:] = sorted(d for d in dirs
                         if not is_ignored(os.path.normpath(os.path.join(rel_root, d)), patterns))
        for name in sorted(dirs):
            rel = os.path.normpath(os.path.join(rel_root, name))
            out.append((os.path.join(root, name), rel))
        for name in sorted(files):
            rel = os.path.normpath(os.path.join(rel_root, name))
            if not is_ignored(rel, patterns):
                out.append((os.path.join(root, name), rel))
    return out


def _dest_dir_word(dst: str) -> str:
    """A bash word for a file mount's destination directory inside the pod."""
    if dst in ("~", "~/"):
        return '"$HOME"'
    if dst.startswith("~/"):
        return '"$HOME"/' + shlex.quote(dst[2:])
    if dst.startswith("/"):
        return '"$ROOT"' + shlex.quote(dst)
    return '"$HOME"/' + shlex.quote(dst)


def local_source(task: Task, src: str) -> str:
    path = os.path.expanduser(src)
    if not os.path.isabs(path) and task.base_dir:
        path = os.path.join(task.base_dir, path)
    return os.path.normpath(path)


def bundle(task: Task, limit: int = DEFAULT_BUNDLE_LIMIT) -> Bundle:
    """The local workdir and file mounts as ConfigMap entries; raises BundleTooLarge."""
    out = Bundle()
    raw_limit = limit * _RAW_FACTOR
    workdir = task.resolved_workdir()
    if workdir:
        if not os.path.isdir(workdir):
            raise BundleTooLarge(f"workdir {workdir} is not a directory")
        out.data["workdir.tgz.b64"] = _tar_b64(_tree(workdir), raw_limit)
        out.targets.append(("workdir.tgz.b64", '"$AIRFLOW_SKYPILOT_WORKDIR"'))
    for i, (dst, src) in enumerate(sorted(task.file_mounts.items())):
        path = local_source(task, src)
        key = f"mount-{i}.tgz.b64"
        if os.path.isdir(path):
            out.data[key] = _tar_b64(_tree(path), raw_limit)
            out.targets.append((key, _dest_dir_word(dst.rstrip("/") or "/")))
        elif os.path.isfile(path):
            out.data[key] = _tar_b64([(path, os.path.basename(dst.rstrip("/")))], raw_limit)
            parent = os.path.dirname(dst.rstrip("/")) or ("~" if not dst.startswith("/")
                                                           else "/")
            out.targets.append((key, _dest_dir_word(parent)))
        else:
            raise BundleTooLarge(f"file_mounts {dst}: {src} does not exist")
        if out.size > limit:
            break
    if out.size > limit:
        raise BundleTooLarge(
            f"workdir and file_mounts are {out.size // 1024} KiB once packed; a ConfigMap "
            f"takes at most {limit // 1024} KiB")
    return out


# --- scripts --------------------------------------------------------------------------------


def main_script(*, job_name: str, namespace: str, num_nodes: int, cluster_domain: str,
                targets: list[tuple[str, str]]) -> str:
    """The pod's entry point: node addresses, unpack files, then setup and run via node.sh."""
    addrs = node_addresses(job_name, namespace, num_nodes, cluster_domain)
    lines = [
        "#!/bin/bash",
        f"# airflow-skypilot: entry point of every pod of job {job_name} (generated). The",
        "# task's own scripts are setup.sh and run.sh beside this file; env.sh has its envs.",
        'ROOT="${SANDBOX_MOUNT_ROOT:-}"',
        f"JOB_DIR={FILES_DIR_EXPR}",
        f'export AIRFLOW_SKYPILOT_WORKDIR="$ROOT"{WORKDIR_MOUNT}',
    ]
    if num_nodes > 1:
        lines.append("export SKYPILOT_NODE_IPS=" + shlex.quote("\n".join(addrs)))
    else:
        lines.append('export SKYPILOT_NODE_IPS="${AIRFLOW_SKYPILOT_POD_IP:-127.0.0.1}"')
    lines += [
        "unpack() {  # ConfigMap key, target directory",
        '  mkdir -p "$2" && base64 -d "$JOB_DIR/$1" | tar -xzf - -C "$2"',
        "}",
    ]
    for key, target in targets:
        lines.append(f"unpack {shlex.quote(key)} {target} || "
                     f"{{ echo 'airflow-skypilot: could not unpack {key}' >&2; exit 1; }}")
    lines += [
        f'echo "airflow-skypilot: job {job_name}, rank ${{JOB_COMPLETION_INDEX:-0}} of '
        f'{num_nodes}, pod $HOSTNAME"',
        'bash "$JOB_DIR/node.sh" setup',
        "rc=$?",
        "if [ $rc -ne 0 ]; then",
        '  echo "airflow-skypilot: setup failed with exit code $rc; run skipped" >&2',
        "  exit $rc",
        "fi",
        'exec bash "$JOB_DIR/node.sh" run',
    ]
    return "\n".join(lines) + "\n"


def files_data(task: Task, *, job_name: str, namespace: str, node_env: Mapping[str, str],
               cluster_domain: str, files: Bundle) -> dict[str, str]:
    """Everything the ConfigMap holds. ``node_env`` must not contain secrets."""
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
    data.update(files.data)
    return data


# --- manifests ------------------------------------------------------------------------------


def _meta(name: str, namespace: str, job_name: str,
          owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels_for(job_name)}
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def configmap_manifest(job_name: str, namespace: str, data: Mapping[str, str],
                       owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(configmap_name(job_name), namespace, job_name, owner),
            "immutable": True, "data": dict(data)}


def secret_manifest(job_name: str, namespace: str, secrets: Mapping[str, str],
                    owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    data = {k: base64.b64encode(str(v).encode()).decode("ascii") for k, v in secrets.items()}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "immutable": True,
            "metadata": _meta(secret_name(job_name), namespace, job_name, owner), "data": data}


def service_manifest(job_name: str, namespace: str,
                     owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Headless: no cluster IP, one DNS record per pod, published before pods are ready."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(service_name(job_name), namespace, job_name, owner),
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
    pod_config: dict[str, Any] = field(default_factory=dict)  # config.kubernetes.pod_config


def cpu_quantity(cpus: float) -> str:
    return str(int(cpus)) if float(cpus).is_integer() else f"{int(round(cpus * 1000))}m"


def memory_quantity(gb: float) -> str:
    return f"{int(gb)}Gi" if float(gb).is_integer() else f"{int(round(gb * 1024))}Mi"


def job_manifest(job_name: str, namespace: str, num_nodes: int, shape: PodShape, *,
                 annotations: Mapping[str, str], has_secrets: bool,
                 ttl_seconds_after_finished: int | None, suspend: bool = True) -> dict[str, Any]:
    """The ``batch/v1`` Job. Created suspended: it starts once its ConfigMap and Secret exist.

    ``backoffLimit: 0`` (recovery is ours); the pod failure policy fails the Job at once and
    records why (disruption vs exit code) in the Job's condition, which outlives the pods.
    """
    labels = labels_for(job_name)
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
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "skypilot-files",
         "configMap": {"name": configmap_name(job_name), "defaultMode": 0o444}},
        {"name": "skypilot-workdir", "emptyDir": {}},
    ]
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
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
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
        spec["template"]["metadata"]["labels"].update(labels)  # ours win: they find the pods
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job_name, "namespace": namespace, "labels": labels,
                         "annotations": dict(annotations)},
            "spec": spec}


def merge_pod_config(template: dict[str, Any], pod_config: Mapping[str, Any]) -> None:
    """SkyPilot's ``config.kubernetes.pod_config`` over our pod template: dicts merge,
    ``containers`` merge by position, other lists are appended to; the fields that wire the
    job (command, restart policy, subdomain, our labels) stay ours."""
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
                else:
                    dst[key].extend(copy.deepcopy(value))
            else:
                dst[key] = copy.deepcopy(value)

    merge(template, pod_config, "")


#: fields a pod_config may not replace (they would break the job's wiring)
_OURS = {"spec.restartPolicy", "spec.subdomain", "spec.containers[0].name",
         "spec.containers[0].command", "spec.containers[0].args"}


__all__ = [
    "BOOTSTRAP", "Bundle", "BundleTooLarge", "PodShape", "bundle", "configmap_manifest",
    "files_data", "job_manifest", "main_script", "node_addresses", "secret_manifest",
    "service_manifest",
]
