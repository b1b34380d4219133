"""The control plane a real cluster runs behind its API: admission, deletion, controllers.

kmock stores objects; a cluster also *acts* on them. This module gives the sandbox the
behaviour our backend relies on: defaulting and validation on create, graceful and cascading
deletion, the Job controller, the scheduler, garbage collection and node faults. The kubelet
(local processes) is in :mod:`tests.sandbox.kubernetes.kubelet`.
"""

import asyncio
import base64
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kmock

from tests.sandbox.kubernetes import selectors
from tests.sandbox.kubernetes.kubelet import Kubelet
from tests.sandbox.kubernetes.store import (
    CONFIGMAPS,
    EVENTS,
    JOBS,
    NAMESPACES,
    NODES,
    PODS,
    SECRETS,
    SERVICEACCOUNTS,
    SERVICES,
    Resource,
    Store,
)
from tests.sandbox.kubernetes.util import (
    clone,
    compact_indexes,
    label_errors,
    name_errors,
    now,
    parse_quantity,
    parse_time,
    rfc3339,
    secret_string_data,
)

log = logging.getLogger("k8s-sandbox")

BUILTIN_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
GPU = "nvidia.com/gpu"
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
TERMINAL = ("Succeeded", "Failed")
JOB_BACKOFF_BASE = 1.0  # seconds; a real cluster uses 10 s doubling to 6 min
JOB_BACKOFF_MAX = 10.0


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """A node created at start (and restored by reset)."""

    name: str
    cpu: str
    memory: str
    gpus: int
    ip: str
    labels: dict[str, str]


GPU_LABELS = {"skypilot.co/accelerator": "a100", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
INITIAL_NODES = (
    NodeSpec(
        "gpu-node-1", "16", "64Gi", 8, "127.0.1.1", {**GPU_LABELS, "nvidia.com/gpu.count": "8"}
    ),
    NodeSpec(
        "gpu-node-2", "16", "64Gi", 8, "127.0.1.2", {**GPU_LABELS, "nvidia.com/gpu.count": "8"}
    ),
    NodeSpec("cpu-node-1", "8", "32Gi", 0, "127.0.1.3", {}),
)


# ---- Kubernetes Status errors (rendered by kmock's KubernetesScaffold) ----
def api_error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    """A Kubernetes ``Status`` failure, as the client libraries parse it into ApiException."""
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or {})


def qualified(res: Resource) -> str:
    return f"{res.plural}.{res.group}" if res.group else str(res.plural)


def not_found(res: Resource, name: str) -> kmock.KubernetesError:
    return api_error(
        404,
        "NotFound",
        f'{qualified(res)} "{name}" not found',
        name=name,
        group=res.group,
        kind=res.plural,
    )


def invalid(
    kind: str, res: Resource, name: str, causes: list[tuple[str, str]]
) -> kmock.KubernetesError:
    """422 Invalid with one cause per (field, message), formatted like the API server."""
    what = f"{kind}.{res.group}" if res.group else kind
    parts = [f"{field}: {message}" for field, message in causes]
    joined = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return api_error(
        422,
        "Invalid",
        f'{what} "{name}" is invalid: {joined}',
        name=name,
        group=res.group,
        kind=kind,
        causes=[{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes],
    )


def condition(
    ctype: str, status: bool | str, reason: str = "", message: str = ""
) -> dict[str, Any]:
    value = status if isinstance(status, str) else ("True" if status else "False")
    cond: dict[str, Any] = {
        "type": ctype,
        "status": value,
        "lastProbeTime": None,
        "lastTransitionTime": rfc3339(),
    }
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


def set_condition(conditions: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    """Replace the condition of the same type, keeping its transition time if status is equal."""
    result = []
    found = False
    for cond in conditions:
        if cond.get("type") == new["type"]:
            found = True
            if cond.get("status") == new["status"]:
                new = {**new, "lastTransitionTime": cond.get("lastTransitionTime")}
            result.append(new)
        else:
            result.append(cond)
    if not found:
        result.append(new)
    return result


def get_condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond
    return None


def pod_requests(pod: dict[str, Any]) -> dict[str, Any]:
    """Effective requests: sum over containers, max with each init container (requests
    default to limits, as the API server defaults them)."""

    def one(container: dict[str, Any]) -> dict[str, Any]:
        res = container.get("resources") or {}
        merged = dict(res.get("limits") or {})
        merged.update(res.get("requests") or {})
        return {k: parse_quantity(v) for k, v in merged.items()}

    total: dict[str, Any] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for key, value in one(container).items():
            total[key] = total.get(key, 0) + value
    for container in (pod.get("spec") or {}).get("initContainers") or []:
        for key, value in one(container).items():
            total[key] = max(total.get(key, 0), value)
    return total


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for tol in tolerations or []:
        if tol.get("effect") and tol.get("effect") != taint.get("effect"):
            continue
        if tol.get("operator") == "Exists":
            if not tol.get("key") or tol.get("key") == taint.get("key"):
                return True
        elif tol.get("key") == taint.get("key") and (tol.get("value") or "") == (
            taint.get("value") or ""
        ):
            return True
    return False


def owner_uid(obj: dict[str, Any], kind: str | None = None) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and (kind is None or ref.get("kind") == kind):
            return ref.get("uid")
    return None


@dataclasses.dataclass
class JobTrack:
    """What the Job controller remembers about one Job (the real one uses finalizers)."""

    outcomes: dict[str, str] = dataclasses.field(default_factory=dict)
    active_seen: dict[str, int | None] = dataclasses.field(default_factory=dict)
    succeeded_indexes: set[int] = dataclasses.field(default_factory=set)
    index_failures: dict[int | None, int] = dataclasses.field(default_factory=dict)
    last_failure: dict[int | None, float] = dataclasses.field(default_factory=dict)
    fail: tuple[str, str] | None = None
    create_failed_at: float = -1e9


#: the Job controller's finalizer on its pods: a pod is not removed before it is counted
JOB_TRACKING = "batch.kubernetes.io/job-tracking"


class Cluster:
    """Admission, deletion, controllers and faults over one :class:`Store`."""

    def __init__(self, store: Store, state_dir: Path, api_port: int) -> None:
        self.store = store
        self.state_dir = state_dir
        self.api_port = api_port
        self.kubelet = Kubelet(self)
        self.wake = asyncio.Event()
        self.tracks: dict[str, JobTrack] = {}
        self.event_index: dict[tuple[str, str, str], str] = {}
        self.ip_counter = 0
        self.service_ip_counter = 0
        store.on_change.append(self.kick)

    def kick(self) -> None:
        """Wake the controllers (every store write does this)."""
        self.wake.set()

    # ------------------------------------------------------------------ bootstrap
    def bootstrap(self) -> None:
        """Create the built-in namespaces and the three nodes a fresh cluster starts with."""
        for ns in BUILTIN_NAMESPACES:
            if self.store.get(NAMESPACES, None, ns) is None:
                self.create(NAMESPACES, None, {"metadata": {"name": ns}})
        for spec in INITIAL_NODES:
            self.store.remove(NODES, None, spec.name)
            self.create(NODES, None, self.node_object(spec), internal=True)

    @staticmethod
    def node_object(spec: NodeSpec) -> dict[str, Any]:
        resources = {
            "cpu": spec.cpu,
            "memory": spec.memory,
            "pods": "110",
            "ephemeral-storage": "100Gi",
        }
        if spec.gpus:
            resources[GPU] = str(spec.gpus)
        stamp = rfc3339()

        def node_cond(ctype: str, status: str, reason: str, message: str) -> dict[str, Any]:
            return {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }

        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": spec.name,
                "labels": {
                    "kubernetes.io/hostname": spec.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "beta.kubernetes.io/os": "linux",
                    "beta.kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": "sandbox-a100-8"
                    if spec.gpus
                    else "sandbox-cpu-8",
                    **spec.labels,
                },
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {
                "podCIDR": f"127.0.{10 + int(spec.ip.rsplit('.', 1)[1])}.0/24",
                "providerID": f"sandbox://{spec.name}",
            },
            "status": {
                "capacity": dict(resources),
                "allocatable": dict(resources),
                "conditions": [
                    node_cond(
                        "MemoryPressure",
                        "False",
                        "KubeletHasSufficientMemory",
                        "kubelet has sufficient memory available",
                    ),
                    node_cond(
                        "DiskPressure",
                        "False",
                        "KubeletHasNoDiskPressure",
                        "kubelet has no disk pressure",
                    ),
                    node_cond(
                        "PIDPressure",
                        "False",
                        "KubeletHasSufficientPID",
                        "kubelet has sufficient PID available",
                    ),
                    node_cond("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
                ],
                "addresses": [
                    {"type": "InternalIP", "address": spec.ip},
                    {"type": "Hostname", "address": spec.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                "nodeInfo": {
                    "architecture": "amd64",
                    "bootID": str(uuid.uuid4()),
                    "containerRuntimeVersion": "sandbox://1.0",
                    "kernelVersion": "6.1.0",
                    "kubeProxyVersion": "v1.30.0",
                    "kubeletVersion": "v1.30.0",
                    "machineID": uuid.uuid4().hex,
                    "operatingSystem": "linux",
                    "osImage": "airflow-skypilot sandbox",
                    "systemUUID": str(uuid.uuid4()),
                },
            },
        }

    def allocate_pod_ip(self) -> str:
        index = self.ip_counter
        self.ip_counter += 1
        return f"127.0.{10 + index // 254}.{index % 254 + 1}"

    def node_ip(self, node_name: str) -> str:
        node = self.store.get(NODES, None, node_name) or {}
        for addr in (node.get("status") or {}).get("addresses") or []:
            if addr.get("type") == "InternalIP":
                return addr["address"]
        return "127.0.0.1"

    # ------------------------------------------------------------------ events
    def record_event(
        self,
        obj: dict[str, Any],
        etype: str,
        reason: str,
        message: str,
        component: str = "kubelet",
        host: str | None = None,
    ) -> None:
        """Emit (or bump the count of) a core/v1 Event about ``obj``, like the components do."""
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        if self.store.get(NAMESPACES, None, namespace) is None:
            return
        key = (meta.get("uid", ""), reason, message)
        stamp = rfc3339()
        existing_name = self.event_index.get(key)
        if existing_name:
            existing = self.store.get(EVENTS, namespace, existing_name)
            if existing is not None:
                existing["count"] = int(existing.get("count") or 1) + 1
                existing["lastTimestamp"] = stamp
                self.store.put(EVENTS, existing)
                return
        name = f"{meta.get('name', 'unknown')}.{uuid.uuid4().hex[:16]}"
        source: dict[str, str] = {"component": component}
        if host:
            source["host"] = host
        event = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": stamp,
            },
            "involvedObject": {
                "kind": obj.get("kind"),
                "namespace": meta.get("namespace"),
                "name": meta.get("name"),
                "uid": meta.get("uid"),
                "apiVersion": obj.get("apiVersion"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message,
            "type": etype,
            "source": source,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "reportingComponent": component,
            "reportingInstance": host or "",
        }
        self.store.put(EVENTS, event, "ADDED")
        self.event_index[key] = name
        if len(self.event_index) > 3000:  # real events expire after an hour; keep memory flat
            for old_key in list(self.event_index)[:1000]:
                old_name = self.event_index.pop(old_key)
                for ev in list(self.store.iter_raw(EVENTS)):
                    if ev["metadata"]["name"] == old_name:
                        self.store.remove(EVENTS, ev["metadata"]["namespace"], old_name)
                        break

    # ------------------------------------------------------------------ create
    def create(
        self,
        res: Resource,
        namespace: str | None,
        body: Any,
        dry_run: bool = False,
        internal: bool = False,
    ) -> dict[str, Any]:
        """POST: validate, default and store an object, as the API server's admission does."""
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise api_error(400, "BadRequest", "the body of the request was in an unknown format")
        kind = self.store.kind(res)
        obj = clone(body)
        meta = obj.setdefault("metadata", {})
        if self.store.namespaced(res):
            body_ns = meta.get("namespace")
            if body_ns and namespace and body_ns != namespace:
                raise api_error(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not "
                    "match the namespace sent on the request",
                )
            namespace = namespace or body_ns
            if not namespace:
                raise api_error(400, "BadRequest", "a namespace must be specified")
            meta["namespace"] = namespace
            ns_obj = self.store.get(NAMESPACES, None, namespace)
            if ns_obj is None:
                raise not_found(NAMESPACES, namespace)
            if (ns_obj.get("status") or {}).get("phase") == "Terminating":
                raise api_error(
                    403,
                    "Forbidden",
                    f'{res.plural} "{meta.get("name", "")}" is '
                    f"forbidden: unable to create new content in namespace {namespace} "
                    "because it is being terminated",
                    name=meta.get("name", ""),
                    kind=res.plural,
                )
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(
                    kind,
                    res,
                    "",
                    [("metadata.name", "Required value: name or generateName is required")],
                )
            for _ in range(20):
                suffix = "".join(random.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))
                meta["name"] = meta["generateName"] + suffix
                if self.store.get(res, namespace, meta["name"]) is None:
                    break
        name = meta["name"]
        problems = [
            ("metadata.name", f'Invalid value: "{name}": {m}') for m in name_errors(name, kind)
        ]
        problems += label_errors(meta.get("labels"), "metadata.labels")
        if problems:
            raise invalid(kind, res, name, problems)
        if self.store.get(res, namespace, name) is not None:
            raise api_error(
                409,
                "AlreadyExists",
                f'{qualified(res)} "{name}" already exists',
                name=name,
                group=res.group,
                kind=res.plural,
            )
        for key in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339()
        if "spec" in obj or res in (JOBS, PODS):
            meta["generation"] = 1
        obj["apiVersion"] = self.store.api_version(res)
        obj["kind"] = kind

        if res == PODS:
            self._admit_pod(obj)
        elif res == JOBS:
            self._admit_job(obj)
        elif res == SERVICES:
            self._admit_service(obj)
        elif res == SECRETS:
            self._admit_secret(obj)
        elif res == NAMESPACES:
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = name
        elif res == NODES and not internal:
            obj.setdefault("status", {})
        if dry_run:
            return obj
        stored = self.store.put(res, obj, "ADDED")
        if res == NAMESPACES:
            self.create(SERVICEACCOUNTS, name, {"metadata": {"name": "default"}})
        return stored

    def _admit_pod(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.setdefault("spec", {})
        name = meta["name"]
        problems: list[tuple[str, str]] = []
        containers = spec.get("containers") or []
        if not containers:
            problems.append(("spec.containers", "Required value"))
        seen: set[str] = set()
        for field, group in (
            ("spec.initContainers", spec.get("initContainers") or []),
            ("spec.containers", containers),
        ):
            for i, container in enumerate(group):
                cname = container.get("name") or ""
                if not cname:
                    problems.append((f"{field}[{i}].name", "Required value"))
                elif cname in seen:
                    problems.append((f"{field}[{i}].name", f'Duplicate value: "{cname}"'))
                seen.add(cname)
                if not container.get("image"):
                    problems.append((f"{field}[{i}].image", "Required value"))
                problems += self._resource_problems(container, f"{field}[{i}].resources")
        policy = spec.setdefault("restartPolicy", "Always")
        if policy not in ("Always", "OnFailure", "Never"):
            problems.append(
                (
                    "spec.restartPolicy",
                    f'Unsupported value: "{policy}": supported '
                    'values: "Always", "OnFailure", "Never"',
                )
            )
        for field in ("hostname", "subdomain"):
            value = spec.get(field)
            if value and name_errors(value, "Namespace"):
                problems.append(
                    (
                        f"spec.{field}",
                        f'Invalid value: "{value}": must be no more '
                        "than 63 characters and a lowercase RFC 1123 label",
                    )
                )
        if problems:
            raise invalid("Pod", PODS, name, problems)
        sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        if self.store.get(SERVICEACCOUNTS, meta["namespace"], sa) is None:
            raise api_error(
                403,
                "Forbidden",
                f'pods "{name}" is forbidden: error looking up service '
                f'account {meta["namespace"]}/{sa}: serviceaccount "{sa}" not found',
                name=name,
                kind="pods",
            )
        spec["serviceAccountName"] = spec["serviceAccount"] = sa
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("securityContext", {})
        spec.setdefault("enableServiceLinks", True)
        spec.setdefault("priority", 0)
        spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
        tolerations = spec.setdefault("tolerations", [])
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
            if not any(t.get("key") == key and t.get("effect") == "NoExecute" for t in tolerations):
                tolerations.append(
                    {
                        "key": key,
                        "operator": "Exists",
                        "effect": "NoExecute",
                        "tolerationSeconds": 300,
                    }
                )
        qos = {"guaranteed": True, "besteffort": True}
        for container in [*(spec.get("initContainers") or []), *containers]:
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("terminationMessagePolicy", "File")
            image = container["image"]
            tagged = ":" in image.rsplit("/", 1)[-1] or "@" in image
            container.setdefault(
                "imagePullPolicy",
                "IfNotPresent" if tagged and not image.endswith(":latest") else "Always",
            )
            resources = container.setdefault("resources", {})
            limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
            for key, value in limits.items():
                requests.setdefault(key, value)
            if requests:
                resources["requests"] = requests
            if limits or requests:
                qos["besteffort"] = False
            if not all(
                limits.get(r) and limits.get(r) == requests.get(r) for r in ("cpu", "memory")
            ):
                qos["guaranteed"] = False
        pod["status"] = {
            "phase": "Pending",
            "qosClass": "BestEffort"
            if qos["besteffort"]
            else "Guaranteed"
            if qos["guaranteed"]
            else "Burstable",
        }

    @staticmethod
    def _resource_problems(container: dict[str, Any], field: str) -> list[tuple[str, str]]:
        problems: list[tuple[str, str]] = []
        resources = container.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        parsed: dict[str, dict[str, Any]] = {"limits": {}, "requests": {}}
        for section, values in (("limits", limits), ("requests", requests)):
            for key, value in values.items():
                try:
                    parsed[section][key] = parse_quantity(value)
                except ValueError:
                    problems.append(
                        (
                            f"{field}.{section}[{key}]",
                            f'Invalid value: "{value}": '
                            "quantities must match the regular expression "
                            "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
                        )
                    )
        for key, value in parsed["requests"].items():
            limit = parsed["limits"].get(key)
            if "/" in key and "kubernetes.io/" not in key:  # extended resources: not overcommitable
                if limit is None:
                    problems.append(
                        (
                            f"{field}.limits",
                            "Required value: Limit must be set for non overcommitable resources",
                        )
                    )
                elif limit != value:
                    problems.append(
                        (
                            f"{field}.requests[{key}]",
                            f'Invalid value: "{requests[key]}":'
                            f" must be equal to {key} limit of {limits[key]}",
                        )
                    )
                if value.denominator != 1:
                    problems.append(
                        (f"{field}.requests[{key}]", "Invalid value: must be an integer")
                    )
            elif limit is not None and value > limit:
                problems.append(
                    (
                        f"{field}.requests",
                        f'Invalid value: "{requests[key]}": must be '
                        f"less than or equal to {key} limit of {limits[key]}",
                    )
                )
        return problems

    def _admit_job(self, job: dict[str, Any]) -> None:
        meta, spec = job["metadata"], job.setdefault("spec", {})
        name, uid = meta["name"], meta["uid"]
        problems: list[tuple[str, str]] = []
        template = spec.get("template")
        if not isinstance(template, dict) or not (template.get("spec") or {}).get("containers"):
            problems.append(("spec.template.spec.containers", "Required value"))
            template = spec.setdefault("template", {"spec": {}})
        tspec = template.setdefault("spec", {})
        policy = tspec.get("restartPolicy")
        if policy not in ("Never", "OnFailure"):
            problems.append(
                (
                    "spec.template.spec.restartPolicy",
                    'Required value: valid values: "OnFailure", "Never"'
                    if not policy
                    else f'Unsupported value: "{policy}": supported values: "OnFailure", "Never"',
                )
            )
        mode = spec.setdefault("completionMode", "NonIndexed")
        if mode not in ("NonIndexed", "Indexed"):
            problems.append(("spec.completionMode", f'Unsupported value: "{mode}"'))
        if mode == "Indexed" and spec.get("completions") is None:
            problems.append(("spec.completions", "Required value: when completion mode is Indexed"))
        if len(name) > 63:
            problems.append(
                (
                    "spec.template.labels",
                    f'Invalid value: "{name}": must be no more than 63 characters',
                )
            )
        for field in ("parallelism", "completions", "backoffLimit", "activeDeadlineSeconds"):
            value = spec.get(field)
            if value is not None and (not isinstance(value, int) or value < 0):
                problems.append(
                    (f"spec.{field}", f"Invalid value: {value}: must be greater than or equal to 0")
                )
        for i, container in enumerate(tspec.get("containers") or []):
            problems += self._resource_problems(
                container, f"spec.template.spec.containers[{i}].resources"
            )
        problems += label_errors(
            (template.get("metadata") or {}).get("labels"), "spec.template.metadata.labels"
        )
        if problems:
            raise invalid("Job", JOBS, name, problems)
        if spec.get("parallelism") is None and spec.get("completions") is None:
            spec["completions"] = 1
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("suspend", False)
        # as batch/v1's defaults.go: Failed with a pod failure policy (the only value allowed)
        spec.setdefault("podReplacementPolicy",
                        "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed")
        spec.setdefault("manualSelector", False)
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        labels = template.setdefault("metadata", {}).setdefault("labels", {})
        labels.update(
            {
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": name,
                "controller-uid": uid,
                "job-name": name,
            }
        )
        meta.setdefault("labels", {}).update(
            {
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": name,
                "controller-uid": uid,
                "job-name": name,
            }
        )
        job["status"] = {}

    def _admit_service(self, svc: dict[str, Any]) -> None:
        spec = svc.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        if spec.get("clusterIP") not in ("None",):
            self.service_ip_counter += 1
            index = self.service_ip_counter
            # Loopback, never a private range: nothing should send traffic to a fake service IP.
            spec["clusterIP"] = f"127.0.{96 + index // 254}.{index % 254 + 1}"
        spec["clusterIPs"] = [spec["clusterIP"]]
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        svc["status"] = {"loadBalancer": {}}

    @staticmethod
    def _admit_secret(secret: dict[str, Any]) -> None:
        secret_string_data(secret)
        secret.setdefault("type", "Opaque")
        for key, value in (secret.get("data") or {}).items():
            try:
                base64.b64decode(str(value), validate=True)
            except ValueError as exc:
                raise invalid(
                    "Secret",
                    SECRETS,
                    secret["metadata"]["name"],
                    [(f"data[{key}]", "Invalid value: illegal base64 data")],
                ) from exc

    # ------------------------------------------------------------------ update / patch
    def replace(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        body: Any,
        subresource: str | None = None,
        precondition: bool = True,
    ) -> dict[str, Any]:
        """PUT (or the tail of PATCH): replace spec/metadata, or status for ``/status``."""
        old = self.store.get(res, namespace, name)
        if old is None:
            raise not_found(res, name)
        if not isinstance(body, dict):
            raise api_error(400, "BadRequest", "the body of the request was in an unknown format")
        body_meta = body.get("metadata") or {}
        if body_meta.get("name") not in (None, name):
            raise api_error(
                400,
                "BadRequest",
                f"the name of the object ({body_meta.get('name')}) "
                f"does not match the name on the URL ({name})",
            )
        body_rv = body_meta.get("resourceVersion")
        if precondition and body_rv and body_rv != old["metadata"]["resourceVersion"]:
            raise api_error(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {qualified(res)} "
                f'"{name}": the object has been modified; please apply your changes '
                "to the latest version and try again",
                name=name,
                group=res.group,
                kind=res.plural,
            )
        info = self.store.info(res)
        has_status = bool(info and "status" in info.subresources)
        if subresource == "status":
            new = clone(old)
            new["status"] = clone(body.get("status"))
        else:
            new = clone(body)
            if has_status:
                new["status"] = clone(old.get("status"))
            meta = new.setdefault("metadata", {})
            for key in (
                "uid",
                "creationTimestamp",
                "namespace",
                "name",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
            ):
                if key in old["metadata"]:
                    meta[key] = old["metadata"][key]
            if new.get("spec") != old.get("spec") and "generation" in meta:
                meta["generation"] = int(meta["generation"]) + 1
            problems = label_errors(meta.get("labels"), "metadata.labels")
            if problems:
                raise invalid(self.store.kind(res), res, name, problems)
            if res == SECRETS:
                secret_string_data(new)
        new["apiVersion"], new["kind"] = old.get("apiVersion"), old.get("kind")
        stored = self.store.put(res, new)
        meta = stored["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._finish_delete(res, namespace, name)
        return stored

    def update_status(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        mutate: Callable[[dict[str, Any]], None],
    ) -> dict[str, Any] | None:
        """Internal read-modify-write; writes (and wakes watchers) only if something changed."""
        obj = self.store.get(res, namespace, name)
        if obj is None:
            return None
        before = clone(obj)
        mutate(obj)
        if obj == before:
            return obj
        return self.store.put(res, obj)

    # ------------------------------------------------------------------ delete
    def delete(
        self, res: Resource, namespace: str | None, name: str, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], int, list[str]]:
        """DELETE: returns (body, HTTP status, warnings), with Kubernetes' propagation rules."""
        options = options or {}
        obj = self.store.get(res, namespace, name)
        if obj is None:
            raise not_found(res, name)
        meta = obj["metadata"]
        warnings: list[str] = []
        policy = options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        if policy is None:
            if res == JOBS:
                policy = "Orphan"  # batch/v1 Jobs keep their pods unless told otherwise
                warnings.append(
                    "child pods are preserved by default when jobs are deleted; set "
                    "propagationPolicy=Background to remove them or set "
                    "propagationPolicy=Orphan to suppress this warning"
                )
            else:
                policy = "Background"
        if policy not in ("Orphan", "Background", "Foreground"):
            raise api_error(
                422,
                "Invalid",
                f'DeleteOptions.meta.k8s.io "" is invalid: '
                f'propagationPolicy: Unsupported value: "{policy}"',
            )
        status_body = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Success",
            "details": {
                "name": name,
                "group": res.group,
                "kind": res.plural,
                "uid": meta.get("uid"),
            },
        }

        if res == PODS:
            grace = options.get("gracePeriodSeconds")
            return self.delete_pod(namespace or "", name, grace), 200, warnings
        if policy == "Orphan":
            self._orphan_dependents(meta["uid"])
        if policy == "Foreground":

            def mark(o: dict[str, Any]) -> None:
                o["metadata"].setdefault("deletionTimestamp", rfc3339())
                o["metadata"]["deletionGracePeriodSeconds"] = 0
                fins = o["metadata"].setdefault("finalizers", [])
                if "foregroundDeletion" not in fins:
                    fins.append("foregroundDeletion")

            updated = self.update_status(res, namespace, name, mark) or obj
            return updated, 202, warnings
        if meta.get("finalizers"):

            def mark_only(o: dict[str, Any]) -> None:
                o["metadata"].setdefault("deletionTimestamp", rfc3339())
                o["metadata"]["deletionGracePeriodSeconds"] = 0

            return self.update_status(res, namespace, name, mark_only) or obj, 200, warnings
        if res == NAMESPACES:
            if name in BUILTIN_NAMESPACES:
                raise api_error(
                    403,
                    "Forbidden",
                    f'namespaces "{name}" is forbidden: this namespace may not be deleted',
                    name=name,
                    kind="namespaces",
                )

            def terminate(o: dict[str, Any]) -> None:
                o["metadata"].setdefault("deletionTimestamp", rfc3339())
                o["status"] = {"phase": "Terminating"}

            return self.update_status(res, namespace, name, terminate) or obj, 200, warnings
        self._finish_delete(res, namespace, name)
        if res == NODES:
            for pod in self.store.items(PODS):
                if pod["spec"].get("nodeName") == name:
                    self.delete_pod(pod["metadata"]["namespace"], pod["metadata"]["name"], 0)
        return status_body, 200, warnings

    def _finish_delete(self, res: Resource, namespace: str | None, name: str) -> None:
        removed = self.store.remove(res, namespace, name)
        if removed is not None and res == PODS:
            self.kubelet.forget(removed["metadata"]["uid"], removed)

    def _orphan_dependents(self, uid: str) -> None:
        for res, ns, name in self.store.all_namespaced():
            obj = self.store.get(res, ns, name)
            refs = (obj or {}).get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("uid") == uid for ref in refs):

                def strip(o: dict[str, Any]) -> None:
                    kept = [
                        r for r in o["metadata"].get("ownerReferences") or [] if r.get("uid") != uid
                    ]
                    if kept:
                        o["metadata"]["ownerReferences"] = kept
                    else:
                        o["metadata"].pop("ownerReferences", None)

                self.update_status(res, ns, name, strip)

    def delete_pod(self, namespace: str, name: str, grace: int | None = None) -> dict[str, Any]:
        """Graceful pod deletion: Terminating while the kubelet stops it, then gone."""
        pod = self.store.get(PODS, namespace, name)
        if pod is None:
            raise not_found(PODS, name)
        meta = pod["metadata"]
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        running = self.kubelet.is_running(meta["uid"])
        if grace == 0 or not running:
            pod["metadata"].setdefault("deletionTimestamp", rfc3339())
            pod["metadata"]["deletionGracePeriodSeconds"] = 0
            self._finish_delete(PODS, namespace, name)
            if running:
                self.kubelet.kill(meta["uid"], "delete", 0)
            return pod
        if meta.get("deletionTimestamp"):
            return pod

        def mark(o: dict[str, Any]) -> None:
            o["metadata"]["deletionTimestamp"] = rfc3339()
            o["metadata"]["deletionGracePeriodSeconds"] = grace

        updated = self.update_status(PODS, namespace, name, mark) or pod
        self.kubelet.kill(meta["uid"], "delete", grace)
        self.record_event(
            updated,
            "Normal",
            "Killing",
            f"Stopping container {pod['spec']['containers'][0]['name']}",
            host=pod["spec"].get("nodeName"),
        )
        return updated

    def delete_collection(
        self,
        res: Resource,
        namespace: str | None,
        predicate: Callable[[dict[str, Any]], bool],
        options: dict[str, Any],
    ) -> dict[str, Any]:
        items = [o for o in self.store.items(res, namespace) if predicate(o)]
        for obj in items:
            meta = obj["metadata"]
            try:
                self.delete(res, meta.get("namespace"), meta["name"], options)
            except kmock.KubernetesError:
                pass
        return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success"}

    # ------------------------------------------------------------------ pod subresources
    def bind(self, namespace: str, name: str, node: str) -> None:
        pod = self.store.get(PODS, namespace, name)
        if pod is None:
            raise not_found(PODS, name)
        if pod["spec"].get("nodeName"):
            raise api_error(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on pods/binding "{name}": '
                f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"',
            )
        self._bind(pod, node)

    def _bind(self, pod: dict[str, Any], node: str) -> None:
        meta = pod["metadata"]

        def assign(o: dict[str, Any]) -> None:
            o["spec"]["nodeName"] = node
            status = o.setdefault("status", {})
            status["conditions"] = set_condition(
                status.get("conditions") or [], condition("PodScheduled", True)
            )

        updated = self.update_status(PODS, meta["namespace"], meta["name"], assign)
        if updated is not None:
            self.record_event(
                updated,
                "Normal",
                "Scheduled",
                f"Successfully assigned {meta['namespace']}/{meta['name']} to {node}",
                component="default-scheduler",
            )

    def evict(self, namespace: str, name: str) -> None:
        """The Eviction API (and the ``evict_pod`` fault): the pod fails as Evicted."""
        pod = self.store.get(PODS, namespace, name)
        if pod is None:
            raise not_found(PODS, name)
        if pod["status"].get("phase") in TERMINAL:
            return
        if self.kubelet.is_running(pod["metadata"]["uid"]):
            self.kubelet.kill(
                pod["metadata"]["uid"],
                "evict",
                int(pod["spec"].get("terminationGracePeriodSeconds", 30)),
            )
        else:
            self.update_status(
                PODS, namespace, name, lambda o: self.kubelet.mark_disrupted(o, "evict")
            )
        self.record_event(
            pod,
            "Normal",
            "Killing",
            "Evicted via the Eviction API",
            host=pod["spec"].get("nodeName"),
        )

    # ------------------------------------------------------------------ node faults
    def _node_or_404(self, name: str) -> dict[str, Any]:
        node = self.store.get(NODES, None, name)
        if node is None:
            raise not_found(NODES, name)
        return node

    def _mutate_node(self, name: str, mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        self._node_or_404(name)
        result = self.update_status(NODES, None, name, mutate)
        assert result is not None
        return result

    @staticmethod
    def _add_taint(node: dict[str, Any], key: str, effect: str, value: str = "") -> None:
        taints = node["spec"].setdefault("taints", [])
        if not any(t.get("key") == key and t.get("effect") == effect for t in taints):
            taint: dict[str, Any] = {"key": key, "effect": effect}
            if value:
                taint["value"] = value
            if effect == "NoExecute":
                taint["timeAdded"] = rfc3339()
            taints.append(taint)

    @staticmethod
    def _remove_taints(node: dict[str, Any], keys: set[str]) -> None:
        taints = [t for t in node["spec"].get("taints") or [] if t.get("key") not in keys]
        if taints:
            node["spec"]["taints"] = taints
        else:
            node["spec"].pop("taints", None)

    @staticmethod
    def _set_ready(node: dict[str, Any], status: str, reason: str, message: str) -> None:
        """Set the Ready condition; a silent kubelet (Unknown) makes every condition Unknown."""
        stamp = rfc3339()
        conds = []
        for cond in node["status"].get("conditions") or []:
            cond = dict(cond)
            if cond["type"] == "Ready":
                new = (status, reason, message)
            elif status == "Unknown":
                new = ("Unknown", "NodeStatusUnknown", message)
            else:
                new = (cond["status"], cond.get("reason", ""), cond.get("message", ""))
            if cond["status"] != new[0]:
                cond["lastTransitionTime"] = stamp
            cond["status"], cond["reason"], cond["message"] = new
            cond["lastHeartbeatTime"] = stamp
            conds.append(cond)
        node["status"]["conditions"] = conds

    def cordon(self, name: str) -> None:
        def do(node: dict[str, Any]) -> None:
            node["spec"]["unschedulable"] = True
            self._add_taint(node, "node.kubernetes.io/unschedulable", "NoSchedule")

        self._mutate_node(name, do)

    def uncordon(self, name: str) -> None:
        def do(node: dict[str, Any]) -> None:
            node["spec"].pop("unschedulable", None)
            self._remove_taints(node, {"node.kubernetes.io/unschedulable"})

        self._mutate_node(name, do)

    def taint(self, name: str, key: str, effect: str = "NoSchedule", value: str = "") -> None:
        if effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise api_error(422, "Invalid", f'Unsupported taint effect "{effect}"')
        self._mutate_node(name, lambda node: self._add_taint(node, key, effect, value))
        if effect == "NoExecute":  # the taint manager evicts pods that do not tolerate it
            for pod in self.store.items(PODS):
                if pod["spec"].get("nodeName") != name or pod["status"].get("phase") in TERMINAL:
                    continue
                if not tolerates(
                    pod["spec"].get("tolerations") or [],
                    {"key": key, "effect": effect, "value": value},
                ):
                    self._disrupt(pod, "taint")

    def untaint(self, name: str, key: str) -> None:
        self._mutate_node(name, lambda node: self._remove_taints(node, {key}))

    def set_not_ready(self, name: str) -> None:
        """Ready=False (the kubelet reports a problem); running pods keep running."""

        def do(node: dict[str, Any]) -> None:
            self._set_ready(
                node,
                "False",
                "KubeletNotReady",
                "container runtime network not ready: NetworkReady=false",
            )
            self._add_taint(node, "node.kubernetes.io/not-ready", "NoSchedule")

        self._mutate_node(name, do)

    def fail_node(self, name: str) -> None:
        """Node loss: kubelet silent (Ready=Unknown), unreachable taints, its pods die."""

        def do(node: dict[str, Any]) -> None:
            self._set_ready(
                node, "Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status."
            )
            self._add_taint(node, "node.kubernetes.io/unreachable", "NoSchedule")
            self._add_taint(node, "node.kubernetes.io/unreachable", "NoExecute")

        self._mutate_node(name, do)
        self.kubelet.down_nodes.add(name)
        for pod in self.store.items(PODS):
            if pod["spec"].get("nodeName") == name and pod["status"].get("phase") not in TERMINAL:
                self._disrupt(pod, "node-lost")

    def restore_node(self, name: str) -> None:
        """Bring a node back to its initial healthy state (Ready, schedulable, untainted)."""
        self._node_or_404(name)
        self.kubelet.down_nodes.discard(name)
        spec = next((s for s in INITIAL_NODES if s.name == name), None)

        def do(node: dict[str, Any]) -> None:
            node["spec"].pop("unschedulable", None)
            node["spec"].pop("taints", None)
            if spec is not None:
                node["status"]["conditions"] = self.node_object(spec)["status"]["conditions"]
            else:
                for cond in node["status"].get("conditions") or []:
                    ok = "True" if cond["type"] == "Ready" else "False"
                    cond.update(
                        status=ok,
                        reason="KubeletReady" if ok == "True" else "",
                        message="kubelet is posting ready status" if ok == "True" else "",
                    )

        self._mutate_node(name, do)
        for pod in self.store.items(PODS):  # pods the lost node left Terminating are now gone
            meta = pod["metadata"]
            if (
                pod["spec"].get("nodeName") == name
                and meta.get("deletionTimestamp")
                and not self.kubelet.is_running(meta["uid"])
            ):
                self._finish_delete(PODS, meta["namespace"], meta["name"])

    def _disrupt(self, pod: dict[str, Any], mode: str) -> None:
        uid = pod["metadata"]["uid"]
        if self.kubelet.is_running(uid):
            self.kubelet.kill(
                uid,
                mode,
                0
                if mode == "node-lost"
                else int(pod["spec"].get("terminationGracePeriodSeconds", 30)),
            )
        else:
            self.update_status(
                PODS,
                pod["metadata"]["namespace"],
                pod["metadata"]["name"],
                lambda o: self.kubelet.mark_disrupted(o, mode),
            )
        if mode in ("node-lost", "taint"):
            self.record_event(
                pod,
                "Normal",
                "TaintManagerEviction",
                "Marking for deletion Pod "
                + pod["metadata"]["namespace"]
                + "/"
                + pod["metadata"]["name"],
                component="taint-eviction-controller",
            )

    # ------------------------------------------------------------------ reset
    async def reset(self) -> None:
        """Back to a fresh cluster: no workloads, healthy nodes, built-in namespaces only."""
        # Objects go first, so no controller can start anything while the processes die.
        for res, ns, name in self.store.all_namespaced():
            self.store.remove(res, ns, name)
        for ns_obj in self.store.items(NAMESPACES):
            if ns_obj["metadata"]["name"] not in BUILTIN_NAMESPACES:
                self.store.remove(NAMESPACES, None, ns_obj["metadata"]["name"])
        for node in self.store.items(NODES):
            self.store.remove(NODES, None, node["metadata"]["name"])
        self.kubelet.down_nodes.clear()
        self.tracks.clear()
        self.event_index.clear()
        for ns in BUILTIN_NAMESPACES:
            if self.store.get(NAMESPACES, None, ns) is None:
                self.create(NAMESPACES, None, {"metadata": {"name": ns}})
            elif self.store.get(SERVICEACCOUNTS, ns, "default") is None:
                self.create(SERVICEACCOUNTS, ns, {"metadata": {"name": "default"}})
        self.bootstrap()
        await self.kubelet.kill_all()
        self.kubelet.clean_dirs()

    # ------------------------------------------------------------------ controllers
    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile when woken by a write, and at least every half second (timers)."""
        last_reap = 0.0
        while not stop.is_set():
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=0.5)
            except TimeoutError:
                pass
            self.wake.clear()
            try:
                self.reconcile()
                if time.monotonic() - last_reap > 2:
                    last_reap = time.monotonic()
                    self.kubelet.reap_orphans()
            except Exception:  # a controller bug must not take the API server down
                log.exception("reconcile failed")
            await asyncio.sleep(0.02)  # coalesce bursts of writes into one pass

    def reconcile(self) -> None:
        self._namespaces()
        self._garbage_collect()
        self._jobs()
        self._schedule()
        self.kubelet.sync()

    def _namespaces(self) -> None:
        for ns_obj in self.store.items(NAMESPACES):
            if (ns_obj.get("status") or {}).get("phase") != "Terminating":
                continue
            name = ns_obj["metadata"]["name"]
            remaining = [(r, n, o) for r, n, o in self.store.all_namespaced() if n == name]
            for res, ns, obj_name in remaining:
                obj = self.store.get(res, ns, obj_name)
                if obj and not obj["metadata"].get("deletionTimestamp"):
                    try:
                        self.delete(res, ns, obj_name, {"propagationPolicy": "Background"})
                    except kmock.KubernetesError:
                        pass
            if not [1 for _, n, _ in self.store.all_namespaced() if n == name]:
                self.store.remove(NAMESPACES, None, name)

    def _garbage_collect(self) -> None:
        live: dict[str, dict[str, Any]] = {}
        dependents: dict[str, int] = {}
        scan: list[tuple[Resource, str | None, dict[str, Any]]] = []
        for (res, ns, _), entry in list(self.store.objects.items()):
            if entry.deleted:
                continue
            obj = entry.raw
            meta = obj.get("metadata") or {}
            live[meta.get("uid", "")] = obj
            refs = meta.get("ownerReferences") or []
            if refs:
                scan.append((res, ns, obj))
                for ref in refs:
                    dependents[ref.get("uid", "")] = dependents.get(ref.get("uid", ""), 0) + 1
        for res, ns, obj in scan:
            meta = obj["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            owners = [live.get(ref.get("uid", "")) for ref in meta["ownerReferences"]]
            gone = all(owner is None for owner in owners)
            foreground = any(
                owner is not None
                and owner["metadata"].get("deletionTimestamp")
                and "foregroundDeletion" in (owner["metadata"].get("finalizers") or [])
                for owner in owners
            )
            if gone or foreground:
                try:
                    self.delete(res, ns, meta["name"], {"propagationPolicy": "Background"})
                except kmock.KubernetesError:
                    pass
        for uid, obj in live.items():
            meta = obj.get("metadata") or {}
            fins = meta.get("finalizers") or []
            if (
                meta.get("deletionTimestamp")
                and "foregroundDeletion" in fins
                and not dependents.get(uid)
            ):
                kept = [f for f in fins if f != "foregroundDeletion"]
                res = next(
                    r
                    for (r, n, nm), e in self.store.objects.items()
                    if not e.deleted and e.raw.get("metadata", {}).get("uid") == uid
                )
                if kept:
                    self.update_status(
                        res,
                        meta.get("namespace"),
                        meta["name"],
                        lambda o, k=kept: o["metadata"].__setitem__("finalizers", k),
                    )
                else:
                    self._finish_delete(res, meta.get("namespace"), meta["name"])

    # ---- Job controller ----
    def _jobs(self) -> None:
        pods_by_owner: dict[str, list[dict[str, Any]]] = {}
        for pod in self.store.items(PODS):
            uid = owner_uid(pod, "Job")
            if uid:
                pods_by_owner.setdefault(uid, []).append(pod)
        jobs = self.store.items(JOBS)
        live = {job["metadata"]["uid"] for job in jobs}
        for uid in list(self.tracks):
            if uid not in live:
                del self.tracks[uid]
        for job in jobs:
            try:
                self._sync_job(job, pods_by_owner.get(job["metadata"]["uid"], []))
            except Exception:
                log.exception("job %s failed to sync", job["metadata"]["name"])
        self._release_tracked_pods({job["metadata"]["uid"]: job for job in jobs})

    def _release_tracked_pods(self, jobs: dict[str, dict[str, Any]]) -> None:
        """Drop the Job controller's finalizer from the pods it has counted (ended, their
        outcome recorded), and from pods whose Job is gone or going that no longer run: a
        deleted pod is removed then, once its end (phase, exit codes) could be read."""
        for pod in self.store.items(PODS):
            meta = pod["metadata"]
            if JOB_TRACKING not in (meta.get("finalizers") or []):
                continue
            owner = jobs.get(owner_uid(pod, "Job") or "")
            track = self.tracks.get(owner["metadata"]["uid"]) if owner else None
            ended = pod["status"].get("phase") in TERMINAL
            counted = ended and track is not None and meta["uid"] in track.outcomes
            orphan = owner is None or bool(owner["metadata"].get("deletionTimestamp"))
            if not (counted or (orphan and (ended or not self.kubelet.is_running(meta["uid"])))):
                continue
            kept = [f for f in meta["finalizers"] if f != JOB_TRACKING]
            self.update_status(PODS, meta["namespace"], meta["name"],
                               lambda o, k=kept: o["metadata"].__setitem__("finalizers", k))
            # gone once its kubelet has confirmed the deletion (grace 0; not a lost node's)
            if meta.get("deletionTimestamp") and not kept and \
                    meta.get("deletionGracePeriodSeconds") == 0:
                self._finish_delete(PODS, meta["namespace"], meta["name"])

    @staticmethod
    def _pod_index(pod: dict[str, Any]) -> int | None:
        value = (pod["metadata"].get("annotations") or {}).get(INDEX_KEY)
        return int(value) if value is not None and str(value).isdigit() else None

    @staticmethod
    def _failure_action(job: dict[str, Any], pod: dict[str, Any]) -> tuple[str, str]:
        """The first pod failure policy rule the failed pod matches: its action, and the Job
        controller's message for it (pkg/controller/job/pod_failure_policy.go)."""
        rules = ((job["spec"].get("podFailurePolicy") or {}).get("rules")) or []
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        ns, name = pod["metadata"].get("namespace", ""), pod["metadata"]["name"]
        for index, rule in enumerate(rules):
            action = rule.get("action", "Count")
            codes = rule.get("onExitCodes")
            if codes:
                values = set(codes.get("values") or [])
                for cs in statuses:
                    if codes.get("containerName") and cs.get("name") != codes["containerName"]:
                        continue
                    code = ((cs.get("state") or {}).get("terminated") or {}).get("exitCode")
                    if code is None or code == 0:
                        continue
                    if (codes.get("operator") == "In") == (code in values):
                        return action, (f"Container {cs.get('name')} for pod {ns}/{name} failed "
                                        f"with exit code {code} matching {action} rule at "
                                        f"index {index}")
            for pattern in rule.get("onPodConditions") or []:
                cond = get_condition(pod, pattern.get("type", ""))
                if cond and cond.get("status") == pattern.get("status", "True"):
                    return action, (f"Pod {ns}/{name} has condition {pattern.get('type')} "
                                    f"matching {action} rule at index {index}")
        return "Count", ""

    def _sync_job(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta, spec = job["metadata"], job["spec"]
        if meta.get("deletionTimestamp"):
            return
        uid, ns = meta["uid"], meta["namespace"]
        track = self.tracks.setdefault(uid, JobTrack())
        indexed = spec.get("completionMode") == "Indexed"
        clock = time.monotonic()
        status = clone(job.get("status") or {})
        finished = any(
            c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        live_uids = set()
        for pod in pods:
            puid = pod["metadata"]["uid"]
            live_uids.add(puid)
            index = self._pod_index(pod) if indexed else None
            if puid in track.outcomes:
                continue
            phase = pod["status"].get("phase")
            if phase == "Succeeded":
                track.outcomes[puid] = "succeeded"
                if index is not None:
                    track.succeeded_indexes.add(index)
            elif phase == "Failed":
                action, message = self._failure_action(job, pod)
                track.outcomes[puid] = "ignored" if action == "Ignore" else "failed"
                if action == "FailJob" and track.fail is None:
                    track.fail = ("PodFailurePolicy", message)
                if action != "Ignore":
                    track.index_failures[index] = track.index_failures.get(index, 0) + 1
                track.last_failure[index] = clock
            else:
                track.active_seen[puid] = index
        for puid, index in list(track.active_seen.items()):
            if puid in track.outcomes:
                del track.active_seen[puid]
            elif puid not in live_uids:  # deleted before it finished: counts as failed
                track.outcomes[puid] = "failed"
                track.index_failures[index] = track.index_failures.get(index, 0) + 1
                track.last_failure[index] = clock
                del track.active_seen[puid]
        active = [
            p
            for p in pods
            if p["status"].get("phase") not in TERMINAL
            and not p["metadata"].get("deletionTimestamp")
        ]
        terminating = [
            p
            for p in pods
            if p["metadata"].get("deletionTimestamp") and p["status"].get("phase") not in TERMINAL
        ]
        succeeded = sum(1 for o in track.outcomes.values() if o == "succeeded")
        failed = sum(1 for o in track.outcomes.values() if o == "failed")
        completions = spec.get("completions")
        parallelism = int(spec.get("parallelism") or 0)
        status.setdefault("startTime", rfc3339())

        if not finished:
            reason: tuple[str, str] | None = track.fail
            restarts = 0
            if spec["template"]["spec"].get("restartPolicy") == "OnFailure":
                restarts = sum(
                    int(cs.get("restartCount") or 0)
                    for p in active
                    for cs in p["status"].get("containerStatuses") or []
                )
            if reason is None and failed + restarts > int(spec.get("backoffLimit", 6)):
                reason = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
            deadline = spec.get("activeDeadlineSeconds")
            if reason is None and deadline is not None:
                started = parse_time(status["startTime"])
                if (now() - started).total_seconds() >= int(deadline):
                    reason = ("DeadlineExceeded", "Job was active longer than specified deadline")
            if indexed:
                complete = len(track.succeeded_indexes) >= int(completions or 0)
            elif completions is not None:
                complete = succeeded >= int(completions)
            else:
                complete = succeeded >= 1 and not active
            if reason is not None:
                for pod in active:
                    self._delete_quietly(pod)
                status["conditions"] = set_condition(
                    status.get("conditions") or [], condition("Failed", True, *reason)
                )
                self.record_event(job, "Warning", reason[0], reason[1], component="job-controller")
                finished, active = True, []
            elif complete:
                for pod in active:
                    self._delete_quietly(pod)
                status["conditions"] = set_condition(
                    status.get("conditions") or [],
                    condition(
                        "Complete",
                        True,
                        "CompletionsReached",
                        "Reached expected number of succeeded pods",
                    ),
                )
                status["completionTime"] = rfc3339()
                self.record_event(
                    job, "Normal", "Completed", "Job completed", component="job-controller"
                )
                finished, active = True, []
            elif spec.get("suspend"):
                # suspended while it runs: the controller deletes the active pods, which
                # count as failures (KEP-2232), and creates none
                for pod in active:
                    self._delete_quietly(pod)
                active = []
            elif clock - track.create_failed_at > 2.0 and not (
                    terminating and self._replace_only_failed(spec)):
                active += self._create_job_pods(
                    job, active, track, indexed, succeeded, completions, parallelism, clock
                )

        for key, value in (("active", len(active)), ("succeeded", succeeded), ("failed", failed)):
            if value:
                status[key] = value
            else:
                status.pop(key, None)
        status["ready"] = sum(
            1 for p in active if (get_condition(p, "Ready") or {}).get("status") == "True"
        )
        status["terminating"] = len(terminating)
        status["uncountedTerminatedPods"] = {}
        if indexed:
            done = compact_indexes(track.succeeded_indexes)
            if done:
                status["completedIndexes"] = done
        if status != (job.get("status") or {}):
            self.update_status(JOBS, ns, meta["name"], lambda o: o.__setitem__("status", status))
        if finished and spec.get("ttlSecondsAfterFinished") is not None:
            ended = status.get("completionTime") or next(
                (
                    c.get("lastTransitionTime")
                    for c in status.get("conditions") or []
                    if c.get("type") == "Failed"
                ),
                None,
            )
            if ended and (now() - parse_time(ended)).total_seconds() >= int(
                spec["ttlSecondsAfterFinished"]
            ):
                self.delete(JOBS, ns, meta["name"], {"propagationPolicy": "Background"})

    def _delete_quietly(self, pod: dict[str, Any]) -> None:
        try:
            self.delete_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
        except kmock.KubernetesError:
            pass

    @staticmethod
    def _replace_only_failed(spec: dict[str, Any]) -> bool:
        """``podReplacementPolicy: Failed``: no replacement while a pod is terminating; it is
        counted, and the pod failure policy applied, once it has ended."""
        return spec.get("podReplacementPolicy") == "Failed"

    def _create_job_pods(
        self,
        job: dict[str, Any],
        active: list[dict[str, Any]],
        track: JobTrack,
        indexed: bool,
        succeeded: int,
        completions: int | None,
        parallelism: int,
        clock: float,
    ) -> list[dict[str, Any]]:
        created: list[dict[str, Any]] = []
        slots = parallelism - len(active)

        def backing_off(index: int | None) -> bool:
            failures = (
                track.index_failures.get(index, 0)
                if indexed
                else sum(track.index_failures.values())
            )
            last = (
                track.last_failure.get(index)
                if indexed
                else max(track.last_failure.values(), default=None)
            )
            if not failures or last is None:
                return False
            delay = min(JOB_BACKOFF_MAX, JOB_BACKOFF_BASE * 2 ** (failures - 1))
            return clock - last < delay

        if indexed:
            busy = {self._pod_index(p) for p in active}
            for index in range(int(completions or 0)):
                if slots <= 0:
                    break
                if index in track.succeeded_indexes or index in busy or backing_off(index):
                    continue
                pod = self._job_pod(job, index)
                if pod is None:
                    track.create_failed_at = clock
                    break
                created.append(pod)
                slots -= 1
        else:
            if completions is not None:
                want = min(parallelism, int(completions) - succeeded)
            else:
                want = parallelism if succeeded == 0 else 0
            if want > len(active) and not backing_off(None):
                for _ in range(want - len(active)):
                    pod = self._job_pod(job, None)
                    if pod is None:
                        track.create_failed_at = clock
                        break
                    created.append(pod)
        return created

    def _job_pod(self, job: dict[str, Any], index: int | None) -> dict[str, Any] | None:
        meta, spec = job["metadata"], job["spec"]
        template = clone(spec["template"])
        tmeta = template.get("metadata") or {}
        pspec = template["spec"]
        labels = dict(tmeta.get("labels") or {})
        annotations = dict(tmeta.get("annotations") or {})
        generate = f"{meta['name']}-"
        if index is not None:
            labels[INDEX_KEY] = str(index)
            annotations[INDEX_KEY] = str(index)
            generate = f"{meta['name']}-{index}-"
            pspec["hostname"] = f"{meta['name']}-{index}"
            for container in [
                *(pspec.get("containers") or []),
                *(pspec.get("initContainers") or []),
            ]:
                env = container.setdefault("env", [])
                if not any(e.get("name") == "JOB_COMPLETION_INDEX" for e in env):
                    env.append(
                        {
                            "name": "JOB_COMPLETION_INDEX",
                            "valueFrom": {
                                "fieldRef": {
                                    "apiVersion": "v1",
                                    "fieldPath": f"metadata.annotations['{INDEX_KEY}']",
                                }
                            },
                        }
                    )
        pod = {
            "metadata": {
                "generateName": generate,
                "namespace": meta["namespace"],
                "labels": labels,
                "annotations": annotations,
                "finalizers": [JOB_TRACKING],
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": pspec,
        }
        try:
            created = self.create(PODS, meta["namespace"], pod)
        except kmock.KubernetesError as exc:
            self.record_event(
                job,
                "Warning",
                "FailedCreate",
                f"Error creating: {exc.message}",
                component="job-controller",
            )
            return None
        self.record_event(
            job,
            "Normal",
            "SuccessfulCreate",
            f"Created pod: {created['metadata']['name']}",
            component="job-controller",
        )
        return created

    # ---- scheduler ----
    def _schedule(self) -> None:
        pending = [
            p
            for p in self.store.items(PODS)
            if not p["spec"].get("nodeName")
            and p["status"].get("phase") == "Pending"
            and not p["metadata"].get("deletionTimestamp")
            and p["spec"].get("schedulerName", "default-scheduler") == "default-scheduler"
        ]
        if not pending:
            return
        nodes = self.store.items(NODES)
        used: dict[str, dict[str, Any]] = {n["metadata"]["name"]: {} for n in nodes}
        for pod in self.store.iter_raw(PODS):
            node = pod["spec"].get("nodeName")
            if node in used and pod["status"].get("phase") not in TERMINAL:
                for key, value in pod_requests(pod).items():
                    used[node][key] = used[node].get(key, 0) + value
        pending.sort(key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]))
        for pod in pending:
            requests = pod_requests(pod)
            reasons: dict[str, int] = {}
            resource_only = 0
            chosen = None
            for node in nodes:
                why = self._filter(pod, node, requests, used[node["metadata"]["name"]])
                if not why:
                    chosen = node
                    break
                for reason in why:
                    reasons[reason] = reasons.get(reason, 0) + 1
                if all(r.startswith("Insufficient") for r in why):
                    resource_only += 1
            if chosen is not None:
                name = chosen["metadata"]["name"]
                for key, value in requests.items():
                    used[name][key] = used[name].get(key, 0) + value
                self._bind(pod, name)
                continue
            total = len(nodes)
            detail = ", ".join(sorted(f"{count} {reason}" for reason, count in reasons.items()))
            preempt = []
            if resource_only:
                preempt.append(f"{resource_only} No preemption victims found for incoming pod")
            if total - resource_only:
                preempt.append(f"{total - resource_only} Preemption is not helpful for scheduling")
            message = (
                (
                    f"0/{total} nodes are available: {detail}. preemption: 0/{total} nodes are "
                    f"available: {', '.join(sorted(preempt))}."
                )
                if total
                else "no nodes available to schedule pods"
            )
            current = get_condition(pod, "PodScheduled") or {}
            if current.get("message") != message:

                def unschedulable(o: dict[str, Any], msg: str = message) -> None:
                    o["status"]["conditions"] = set_condition(
                        o["status"].get("conditions") or [],
                        condition("PodScheduled", False, "Unschedulable", msg),
                    )

                updated = self.update_status(
                    PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], unschedulable
                )
                if updated is not None:
                    self.record_event(
                        updated,
                        "Warning",
                        "FailedScheduling",
                        message,
                        component="default-scheduler",
                    )

    @staticmethod
    def _filter(
        pod: dict[str, Any], node: dict[str, Any], requests: dict[str, Any], used: dict[str, Any]
    ) -> list[str]:
        """The reasons ``node`` cannot take ``pod`` (filter plugins in the scheduler's order)."""
        spec = pod["spec"]
        tolerations = spec.get("tolerations") or []
        if node["spec"].get("unschedulable") and not tolerates(
            tolerations, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
        ):
            return ["node(s) were unschedulable"]
        for taint in node["spec"].get("taints") or []:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(
                tolerations, taint
            ):
                return [
                    f"node(s) had untolerated taint {{{taint.get('key')}: "
                    f"{taint.get('value', '')}}}"
                ]
        labels = node["metadata"].get("labels") or {}
        for key, value in (spec.get("nodeSelector") or {}).items():
            if labels.get(key) != value:
                return ["node(s) didn't match Pod's node affinity/selector"]
        required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or {}
        terms = required.get("nodeSelectorTerms") or []
        if terms:

            def term_ok(term: dict[str, Any]) -> bool:
                exprs_ok = all(
                    selectors.match_expression(
                        e, labels.get(e.get("key", "")), e.get("key", "") in labels
                    )
                    for e in term.get("matchExpressions") or []
                )
                fields_ok = all(
                    selectors.match_expression(
                        e,
                        node["metadata"]["name"] if e.get("key") == "metadata.name" else None,
                        e.get("key") == "metadata.name",
                    )
                    for e in term.get("matchFields") or []
                )
                return exprs_ok and fields_ok

            if not any(term_ok(t) for t in terms):
                return ["node(s) didn't match Pod's node affinity/selector"]
        allocatable = {
            k: parse_quantity(v) for k, v in (node["status"].get("allocatable") or {}).items()
        }
        short = []
        for key, value in sorted(requests.items()):
            if value and allocatable.get(key, 0) - used.get(key, 0) < value:
                short.append(f"Insufficient {key}")
        return short

    # ---- read helpers for the API ----
    def list_objects(
        self, res: Resource, namespace: str | None, label: str | None, field: str | None
    ) -> list[dict[str, Any]]:
        try:
            by_label = selectors.parse_label_selector(label)
            by_field = selectors.parse_field_selector(field, str(res.plural))
        except selectors.SelectorError as exc:
            raise api_error(400, "BadRequest", str(exc)) from exc
        return [o for o in self.store.items(res, namespace) if by_label(o) and by_field(o)]


def configmap_or_secret(
    store: Store, kind: str, namespace: str, name: str
) -> dict[str, str] | None:
    """Decoded data of a Secret or ConfigMap (None if it does not exist)."""
    res = SECRETS if kind == "Secret" else CONFIGMAPS
    obj = store.get(res, namespace, name)
    if obj is None:
        return None
    if kind == "Secret":
        return {
            k: base64.b64decode(v).decode(errors="replace")
            for k, v in (obj.get("data") or {}).items()
        }
    data = dict(obj.get("data") or {})
    for key, value in (obj.get("binaryData") or {}).items():
        data[key] = base64.b64decode(value).decode(errors="replace")
    return data
