"""A test kubelet: runs each bound pod's containers as local processes, reports like a real one.

There are no container images here, so a container's ``command + args`` run directly on this
machine, in a per-pod directory. Everything the backend observes through the API (phases,
container states, exit codes, restarts, logs, events) follows the real kubelet's rules.

Filesystem mapping (what a backend author must know): the pod's filesystem root is
``$SANDBOX_MOUNT_ROOT`` (a directory under the state dir). Volume mounts, ``workingDir`` and
``HOME`` (``/root``) live under it, so a script reads a mounted secret at
``${SANDBOX_MOUNT_ROOT:-}/etc/secret/key``: the same line works on a real cluster.
"""

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tests.sandbox.kubernetes.store import NODES, PODS
from tests.sandbox.kubernetes.util import rfc3339, rfc3339_nano

if TYPE_CHECKING:
    from tests.sandbox.kubernetes.cluster import Cluster

log = logging.getLogger("k8s-sandbox")

TERMINAL = ("Succeeded", "Failed")
BAD_IMAGE_MARKERS = ("does-not-exist", "invalid")
RESTART_BACKOFF_MAX = 10.0  # seconds; a real kubelet doubles from 10 s up to 5 min
IMAGE_BACKOFF_AFTER = 1.0  # seconds of ErrImagePull before ImagePullBackOff
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


class ConfigError(Exception):
    """A container cannot start yet: (waiting reason, message, event reason)."""

    def __init__(self, reason: str, message: str, event: str = "Failed") -> None:
        super().__init__(message)
        self.reason, self.message, self.event = reason, message, event


@dataclasses.dataclass
class ContainerRun:
    name: str
    spec: dict[str, Any]
    init: bool
    env: dict[str, str]
    restart_count: int = 0
    proc: asyncio.subprocess.Process | None = None
    started_at: str | None = None


@dataclasses.dataclass
class PodRun:
    uid: str
    namespace: str
    name: str
    node: str
    poddir: Path
    containers: dict[str, ContainerRun]
    mode: str | None = None  # why it is being stopped: delete, evict, node-lost, taint, ...
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)


def bad_image(image: str) -> bool:
    return any(marker in image for marker in BAD_IMAGE_MARKERS)


_VAR_REF = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.-]*)\))")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined vars are replaced, ``$$`` becomes ``$``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(1) == "$":
            return "$"
        name = match.group(2)
        return env[name] if name in env else match.group(0)

    return _VAR_REF.sub(replace, text)


def proc_start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/pid/stat), to spot pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def reap_stale(pid_file: Path) -> int:
    """Kill process groups a previous daemon left behind (by pid, checked against start time)."""
    killed = 0
    if not pid_file.exists():
        return 0
    for line in pid_file.read_text().splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        if proc_start_time(pid) == parts[1]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
                killed += 1
    pid_file.write_text("")
    return killed


class Kubelet:
    """One kubelet for every node: the nodes differ only in name, IP and capacity."""

    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self.store = cluster.store
        self.runs: dict[str, PodRun] = {}
        self.down_nodes: set[str] = set()
        self.pull_started: dict[str, float] = {}
        self.ips: dict[str, str] = {}
        self.pods_dir = cluster.state_dir / "pods"
        self.pid_file = cluster.state_dir / "pods.pids"
        self.pids: dict[int, str] = {}

    # ------------------------------------------------------------------ queries
    def is_running(self, uid: str) -> bool:
        return uid in self.runs

    def poddir(self, pod: dict[str, Any]) -> Path:
        meta = pod["metadata"]
        return self.pods_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"

    def log_files(self, pod: dict[str, Any], container: str) -> list[Path]:
        """Log files of a container, one per run (restart), oldest first."""
        folder = self.poddir(pod) / "logs" / container
        if not folder.is_dir():
            return []
        return sorted(folder.glob("*.log"), key=lambda p: int(p.stem))

    def processes(self) -> list[dict[str, Any]]:
        """Live pod processes (for tests that check nothing is left running)."""
        result = []
        for run in self.runs.values():
            for cr in run.containers.values():
                if cr.proc is not None and cr.proc.returncode is None:
                    result.append(
                        {
                            "namespace": run.namespace,
                            "pod": run.name,
                            "uid": run.uid,
                            "container": cr.name,
                            "pid": cr.proc.pid,
                            "node": run.node,
                        }
                    )
        return result

    # ------------------------------------------------------------------ sync loop
    def sync(self) -> None:
        """Start pods bound to a live node; finish deletions of pods with nothing running."""
        nodes = {n["metadata"]["name"] for n in self.store.iter_raw(NODES)}
        for pod in self.store.items(PODS):
            meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
            node = spec.get("nodeName")
            if not node or node not in nodes or node in self.down_nodes:
                continue
            run = self.runs.get(meta["uid"])
            if run is not None:
                self._check_deadline(pod, run)
                continue
            if meta.get("deletionTimestamp"):
                self.cluster._finish_delete(PODS, meta["namespace"], meta["name"])
                continue
            if status.get("phase") in TERMINAL:
                continue
            try:
                self._try_start(pod)
            except Exception:
                log.exception("could not start pod %s/%s", meta["namespace"], meta["name"])

    def _check_deadline(self, pod: dict[str, Any], run: PodRun) -> None:
        deadline = pod["spec"].get("activeDeadlineSeconds")
        if (
            deadline is not None
            and run.mode is None
            and time.monotonic() - run.started >= int(deadline)
        ):
            self.kill(
                run.uid, "deadline", int(pod["spec"].get("terminationGracePeriodSeconds", 30))
            )

    def _all_containers(self, pod: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
        spec = pod["spec"]
        return [(c, True) for c in spec.get("initContainers") or []] + [
            (c, False) for c in spec.get("containers") or []
        ]

    def _try_start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        pod_ip = self.ips.setdefault(uid, self.cluster.allocate_pod_ip())
        pod["status"]["podIP"] = pod_ip
        pod["status"]["hostIP"] = self.cluster.node_ip(pod["spec"]["nodeName"])
        bad = [c for c, _ in self._all_containers(pod) if bad_image(c.get("image", ""))]
        if bad:
            self._image_pull_failure(pod, bad)
            return
        try:
            self._check_volumes(pod)
            envs = {c["name"]: self.resolve_env(pod, c) for c, _ in self._all_containers(pod)}
        except ConfigError as exc:
            self._waiting(pod, exc)
            return
        containers = {
            c["name"]: ContainerRun(c["name"], c, init, envs[c["name"]])
            for c, init in self._all_containers(pod)
        }
        run = PodRun(
            uid,
            meta["namespace"],
            meta["name"],
            pod["spec"]["nodeName"],
            self.poddir(pod),
            containers,
        )
        self.runs[uid] = run
        run.task = asyncio.create_task(self._run(run, pod), name=f"pod-{meta['name']}")

    # ------------------------------------------------------------------ status helpers
    def _write(
        self, run_or_pod: PodRun | dict[str, Any], mutate: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any] | None:
        if isinstance(run_or_pod, PodRun):
            ns, name = run_or_pod.namespace, run_or_pod.name
        else:
            ns, name = run_or_pod["metadata"]["namespace"], run_or_pod["metadata"]["name"]
        return self.cluster.update_status(PODS, ns, name, mutate)

    def _event(self, pod: dict[str, Any], etype: str, reason: str, message: str) -> None:
        self.cluster.record_event(pod, etype, reason, message, host=pod["spec"].get("nodeName"))

    @staticmethod
    def _container_status(
        container: dict[str, Any],
        state: dict[str, Any],
        ready: bool = False,
        restarts: int = 0,
        last: dict[str, Any] | None = None,
        started: bool = False,
        container_id: str | None = None,
    ) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": container["name"],
            "image": container["image"],
            "imageID": f"sandbox://{container['image']}",
            "ready": ready,
            "restartCount": restarts,
            "started": started,
            "state": state,
            "lastState": last or {},
        }
        if container_id:
            status["containerID"] = container_id
        return status

    def _pod_conditions(
        self,
        pod: dict[str, Any],
        initialized: bool,
        ready: bool,
        reason: str = "",
        message: str = "",
    ) -> list[dict[str, Any]]:
        from tests.sandbox.kubernetes.cluster import condition, set_condition

        conds = pod["status"].get("conditions") or []
        conds = set_condition(conds, condition("PodReadyToStartContainers", True))
        conds = set_condition(
            conds,
            condition(
                "Initialized",
                initialized,
                "" if initialized else "ContainersNotInitialized",
                ""
                if initialized
                else "containers with incomplete status: "
                f"[{' '.join(c['name'] for c in pod['spec'].get('initContainers') or [])}]",
            ),
        )
        for ctype in ("Ready", "ContainersReady"):
            conds = set_condition(
                conds, condition(ctype, ready, "" if ready else reason, "" if ready else message)
            )
        conds = set_condition(conds, condition("PodScheduled", True))
        return conds

    def _image_pull_failure(self, pod: dict[str, Any], bad: list[dict[str, Any]]) -> None:
        uid = pod["metadata"]["uid"]
        first = uid not in self.pull_started
        before = ((pod["status"].get("containerStatuses") or [{}])[0].get("state") or {}).get(
            "waiting"
        ) or {}
        started = self.pull_started.setdefault(uid, time.monotonic())
        backoff = time.monotonic() - started >= IMAGE_BACKOFF_AFTER
        bad_names = {c["name"] for c in bad}

        def mutate(o: dict[str, Any]) -> None:
            status = o["status"]
            status["podIP"] = pod["status"]["podIP"]
            status["podIPs"] = [{"ip": status["podIP"]}]
            status["hostIP"] = pod["status"]["hostIP"]
            status["hostIPs"] = [{"ip": status["hostIP"]}]
            status.setdefault("startTime", rfc3339())
            statuses = []
            for c in o["spec"]["containers"]:
                if c["name"] in bad_names:
                    image = c["image"]
                    waiting = (
                        {
                            "reason": "ImagePullBackOff",
                            "message": f'Back-off pulling image "{image}"',
                        }
                        if backoff
                        else {
                            "reason": "ErrImagePull",
                            "message": f'failed to pull and unpack image "{image}": failed to '
                            f'resolve reference "{image}": {image}: not found',
                        }
                    )
                else:
                    waiting = {"reason": "ContainerCreating"}
                statuses.append(self._container_status(c, {"waiting": waiting}))
            status["containerStatuses"] = statuses
            names = " ".join(c["name"] for c in o["spec"]["containers"])
            status["conditions"] = self._pod_conditions(
                o,
                not o["spec"].get("initContainers"),
                False,
                "ContainersNotReady",
                f"containers with unready status: [{names}]",
            )

        updated = self._write(pod, mutate)
        if updated is None:
            return
        for c in bad:
            if first:
                self._event(updated, "Normal", "Pulling", f'Pulling image "{c["image"]}"')
                self._event(
                    updated,
                    "Warning",
                    "Failed",
                    f'Failed to pull image "{c["image"]}": '
                    f'failed to resolve reference "{c["image"]}": not found',
                )
                self._event(updated, "Warning", "Failed", "Error: ErrImagePull")
            elif backoff and before.get("reason") == "ErrImagePull":
                self._event(updated, "Normal", "BackOff", f'Back-off pulling image "{c["image"]}"')
                self._event(updated, "Warning", "Failed", "Error: ImagePullBackOff")

    def _waiting(self, pod: dict[str, Any], exc: ConfigError) -> None:
        def mutate(o: dict[str, Any]) -> None:
            status = o["status"]
            status.setdefault("startTime", rfc3339())
            status["hostIP"] = pod["status"]["hostIP"]
            status["hostIPs"] = [{"ip": status["hostIP"]}]
            waiting = (
                {"reason": exc.reason, "message": exc.message}
                if exc.reason != "ContainerCreating"
                else {"reason": "ContainerCreating"}
            )
            status["containerStatuses"] = [
                self._container_status(c, {"waiting": waiting}) for c in o["spec"]["containers"]
            ]
            names = " ".join(c["name"] for c in o["spec"]["containers"])
            status["conditions"] = self._pod_conditions(
                o,
                not o["spec"].get("initContainers"),
                False,
                "ContainersNotReady",
                f"containers with unready status: [{names}]",
            )

        before = (pod["status"].get("containerStatuses") or [{}])[0].get("state")
        updated = self._write(pod, mutate)
        if updated is not None and before != updated["status"]["containerStatuses"][0]["state"]:
            self._event(
                updated,
                "Warning",
                exc.event,
                exc.message if exc.event == "FailedMount" else f"Error: {exc.message}",
            )

    def mark_disrupted(self, pod: dict[str, Any], mode: str) -> None:
        """Status mutator for a pod stopped by the control plane (eviction, node loss, ...)."""
        from tests.sandbox.kubernetes.cluster import condition, set_condition

        status = pod.setdefault("status", {})
        status["phase"] = "Failed"
        conds = status.get("conditions") or []
        if mode == "evict":
            status["reason"] = "Evicted"
            status["message"] = "Evicted via the Eviction API"
            conds = set_condition(
                conds,
                condition(
                    "DisruptionTarget", True, "EvictionByEvictionAPI", "Eviction API: evicting"
                ),
            )
        elif mode in ("node-lost", "taint"):
            conds = set_condition(
                conds,
                condition(
                    "DisruptionTarget",
                    True,
                    "DeletionByTaintManager",
                    "Taint manager: deleting due to NoExecute taint",
                ),
            )
            if mode == "node-lost":
                pod["metadata"].setdefault("deletionTimestamp", rfc3339())
                pod["metadata"].setdefault("deletionGracePeriodSeconds", 30)
        elif mode == "deadline":
            status["reason"] = "DeadlineExceeded"
            status["message"] = "Pod was active on the node longer than the specified deadline"
        for ctype in ("Ready", "ContainersReady"):
            conds = set_condition(conds, condition(ctype, False, "PodFailed"))
        status["conditions"] = conds
        stamp = rfc3339()
        for key in ("containerStatuses", "initContainerStatuses"):
            for cs in status.get(key) or []:
                state = cs.get("state") or {}
                finished_ok = (state.get("terminated") or {}).get("reason") == "Completed"
                if mode == "node-lost" and not finished_ok:
                    cs["state"] = {
                        "terminated": {
                            "exitCode": 137,
                            "reason": "ContainerStatusUnknown",
                            "message": "The container could not be located when the pod "
                            "was terminated",
                            "startedAt": None,
                            "finishedAt": None,
                        }
                    }
                elif "terminated" not in state:
                    cs["state"] = {
                        "terminated": {
                            "exitCode": 137,
                            "reason": "Error",
                            "startedAt": (state.get("running") or {}).get("startedAt"),
                            "finishedAt": stamp,
                        }
                    }
                cs["ready"] = False
                cs["started"] = False

    # ------------------------------------------------------------------ config resolution
    def _lookup(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        from tests.sandbox.kubernetes.cluster import configmap_or_secret

        return configmap_or_secret(self.store, kind, namespace, name)

    def resolve_env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        """The container's environment, resolved as the kubelet does (raises ConfigError)."""
        ns = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix") or ""
            for kind, ref in (
                ("Secret", source.get("secretRef")),
                ("ConfigMap", source.get("configMapRef")),
            ):
                if not ref:
                    continue
                data = self._lookup(kind, ns, ref.get("name", ""))
                if data is None:
                    if ref.get("optional"):
                        continue
                    raise ConfigError(
                        "CreateContainerConfigError",
                        f'{kind.lower()} "{ref.get("name")}" not found',
                    )
                for key, value in data.items():
                    env[prefix + key] = value
        for var in container.get("env") or []:
            name = var["name"]
            if "valueFrom" not in var:
                env[name] = expand(str(var.get("value") or ""), env)
                continue
            source = var["valueFrom"]
            value: str | None = None
            for kind, key in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                ref = source.get(key)
                if not ref:
                    continue
                data = self._lookup(kind, ns, ref.get("name", ""))
                if data is None:
                    if ref.get("optional"):
                        break
                    raise ConfigError(
                        "CreateContainerConfigError",
                        f'{kind.lower()} "{ref.get("name")}" not found',
                    )
                if ref.get("key") not in data:
                    if ref.get("optional"):
                        break
                    raise ConfigError(
                        "CreateContainerConfigError",
                        f"couldn't find key {ref.get('key')} in {kind} {ns}/{ref.get('name')}",
                    )
                value = data[ref["key"]]
            if source.get("fieldRef"):
                value = self._field_ref(pod, source["fieldRef"].get("fieldPath", ""))
            if source.get("resourceFieldRef"):
                value = self._resource_ref(pod, container, source["resourceFieldRef"])
            if value is not None:
                env[name] = value
        return env

    def _field_ref(self, pod: dict[str, Any], path: str) -> str:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        match = re.match(r"^metadata\.(labels|annotations)\['(.+)'\]$", path)
        if match:
            return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
        simple = {
            "metadata.name": meta.get("name"),
            "metadata.namespace": meta.get("namespace"),
            "metadata.uid": meta.get("uid"),
            "spec.nodeName": spec.get("nodeName"),
            "spec.serviceAccountName": spec.get("serviceAccountName"),
            "status.hostIP": status.get("hostIP"),
            "status.hostIPs": status.get("hostIP"),
            "status.podIP": status.get("podIP"),
            "status.podIPs": status.get("podIP"),
        }
        if path not in simple:
            raise ConfigError("CreateContainerConfigError", f"unsupported fieldPath: {path}")
        return str(simple[path] or "")

    @staticmethod
    def _resource_ref(pod: dict[str, Any], container: dict[str, Any], ref: dict[str, Any]) -> str:
        from tests.sandbox.kubernetes.util import parse_quantity

        section, _, resource = str(ref.get("resource", "")).partition(".")
        resources = (container.get("resources") or {}).get(section) or {}
        raw = resources.get(resource)
        if raw is None:  # unset limits default to the node's allocatable
            raw = "16" if resource == "cpu" else "64Gi" if resource == "memory" else "0"
        value = parse_quantity(raw) / parse_quantity(ref.get("divisor") or "1")
        return str(-int(-value // 1))  # ceil, as the kubelet rounds up

    def _check_volumes(self, pod: dict[str, Any]) -> None:
        ns = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes") or []:
            for kind, key, ref_key in (
                ("Secret", "secret", "secretName"),
                ("ConfigMap", "configMap", "name"),
            ):
                source = volume.get(key)
                if source is None:
                    continue
                if source.get("optional"):
                    continue
                if self._lookup(kind, ns, source.get(ref_key, "")) is None:
                    raise ConfigError(
                        "ContainerCreating",
                        f'MountVolume.SetUp failed for volume "{volume["name"]}" : '
                        f'{kind.lower()} "{source.get(ref_key)}" not found',
                        event="FailedMount",
                    )

    def _prepare_filesystem(self, pod: dict[str, Any], run: PodRun) -> Path:
        """Create the pod's root, write its volumes and link each mount into the root."""
        ns = pod["metadata"]["namespace"]
        root = run.poddir / "root"
        (root / "root").mkdir(parents=True, exist_ok=True)
        volumes: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes") or []:
            vdir = run.poddir / "volumes" / volume["name"]
            vdir.mkdir(parents=True, exist_ok=True)
            for kind, key, ref_key in (
                ("Secret", "secret", "secretName"),
                ("ConfigMap", "configMap", "name"),
            ):
                source = volume.get(key)
                if source is None:
                    continue
                data = self._lookup(kind, ns, source.get(ref_key, "")) or {}
                mode = int(source.get("defaultMode", 0o644))
                items = source.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    if item["key"] not in data:
                        continue
                    target = vdir / item.get("path", item["key"])
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(data[item["key"]])
                    target.chmod(int(item.get("mode", mode)))
            if volume.get("hostPath"):
                volumes[volume["name"]] = Path(volume["hostPath"]["path"])
            elif volume.get("persistentVolumeClaim"):
                claim = (
                    self.cluster.state_dir
                    / "pvc"
                    / ns
                    / volume["persistentVolumeClaim"].get("claimName", volume["name"])
                )
                claim.mkdir(parents=True, exist_ok=True)
                volumes[volume["name"]] = claim
            else:
                volumes[volume["name"]] = vdir
        for cr in run.containers.values():
            for mount in cr.spec.get("volumeMounts") or []:
                source = volumes.get(mount.get("name", ""))
                if source is None:
                    continue
                if mount.get("subPath"):
                    source = source / mount["subPath"]
                    source.mkdir(parents=True, exist_ok=True) if not source.exists() else None
                link = root / str(mount.get("mountPath", "")).lstrip("/")
                if link.exists() or link.is_symlink():
                    continue
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(source)
        return root

    # ------------------------------------------------------------------ running
    async def _run(self, run: PodRun, pod: dict[str, Any]) -> None:
        try:
            await self._run_pod(run, pod)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s/%s crashed in the kubelet", run.namespace, run.name)
        finally:
            for cr in run.containers.values():
                self._killpg(cr, signal.SIGKILL)
            if self.runs.get(run.uid) is run:
                del self.runs[run.uid]
            if run.mode in ("delete",):
                left = self.store.get(PODS, run.namespace, run.name)
                # the kubelet's final delete (grace 0); a finalizer (the Job controller's,
                # until it has counted the pod) keeps the object until it is dropped
                if left is None or not (left.get("metadata") or {}).get("finalizers"):
                    self.cluster._finish_delete(PODS, run.namespace, run.name)
                else:
                    self.cluster.update_status(
                        PODS, run.namespace, run.name,
                        lambda o: o["metadata"].__setitem__("deletionGracePeriodSeconds", 0))
            if self.store.get(PODS, run.namespace, run.name) is None:
                shutil.rmtree(run.poddir, ignore_errors=True)
            self.cluster.kick()

    async def _run_pod(self, run: PodRun, pod: dict[str, Any]) -> None:
        root = self._prepare_filesystem(pod, run)
        pod_ip = self.ips[run.uid]
        host_ip = self.cluster.node_ip(run.node)
        init_specs = [cr for cr in run.containers.values() if cr.init]
        main_specs = [cr for cr in run.containers.values() if not cr.init]

        def start(o: dict[str, Any]) -> None:
            status = o["status"]
            status.update(
                podIP=pod_ip, podIPs=[{"ip": pod_ip}], hostIP=host_ip, hostIPs=[{"ip": host_ip}]
            )
            status.setdefault("startTime", rfc3339())
            waiting = {"reason": "PodInitializing" if init_specs else "ContainerCreating"}
            status["containerStatuses"] = [
                self._container_status(cr.spec, {"waiting": waiting}) for cr in main_specs
            ]
            if init_specs:
                status["initContainerStatuses"] = [
                    self._container_status(cr.spec, {"waiting": {"reason": "PodInitializing"}})
                    for cr in init_specs
                ]
            names = " ".join(cr.name for cr in main_specs)
            status["conditions"] = self._pod_conditions(
                o,
                not init_specs,
                False,
                "ContainersNotReady",
                f"containers with unready status: [{names}]",
            )

        if self._write(run, start) is None:
            return
        for cr in init_specs:
            code = await self._run_container(run, pod, cr, root)
            if run.mode or code != 0:
                self._finalize(run, [code])
                return
        codes = await asyncio.gather(
            *(self._run_container(run, pod, cr, root) for cr in main_specs)
        )
        self._finalize(run, list(codes))

    def _finalize(self, run: PodRun, codes: list[int]) -> None:
        if run.mode in ("reset", "forget"):
            return
        from tests.sandbox.kubernetes.cluster import condition, set_condition

        def mutate(o: dict[str, Any]) -> None:
            # a deleted pod ends in a terminal phase by its containers' codes (the kubelet
            # does since 1.27), seen by whoever holds a finalizer on it
            if run.mode is not None and run.mode != "delete":
                self.mark_disrupted(o, run.mode)
                return
            status = o["status"]
            status["phase"] = "Succeeded" if all(code == 0 for code in codes) else "Failed"
            conds = status.get("conditions") or []
            for ctype in ("Ready", "ContainersReady"):
                conds = set_condition(conds, condition(ctype, False, "PodCompleted"))
            status["conditions"] = conds

        self._write(run, mutate)

    def _killpg(self, cr: ContainerRun, sig: int) -> None:
        if cr.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(cr.proc.pid, sig)

    def _base_env(self, pod: dict[str, Any], root: Path) -> dict[str, str]:
        spec = pod["spec"]
        port = str(self.cluster.api_port)
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(root / "root"),
            "HOSTNAME": spec.get("hostname") or pod["metadata"]["name"],
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_PORT": f"tcp://127.0.0.1:{port}",
            "SANDBOX_MOUNT_ROOT": str(root),
            "SANDBOX_POD_NAME": pod["metadata"]["name"],
            "SANDBOX_POD_NAMESPACE": pod["metadata"]["namespace"],
            "SANDBOX_NODE_NAME": spec.get("nodeName", ""),
            "SANDBOX_POD_IP": self.ips.get(pod["metadata"]["uid"], ""),
        }
        for key in ("LANG", "LC_ALL", "TZ"):
            if key in os.environ:
                env[key] = os.environ[key]
        return env

    async def _run_container(
        self, run: PodRun, pod: dict[str, Any], cr: ContainerRun, root: Path
    ) -> int:
        """Run one container until it ends for good (restarting per restartPolicy)."""
        policy = pod["spec"].get("restartPolicy", "Always")
        key = "initContainerStatuses" if cr.init else "containerStatuses"
        last_state: dict[str, Any] = {}
        code = 137
        while True:
            if run.mode:
                return code
            argv = [
                expand(str(a), cr.env)
                for a in [*(cr.spec.get("command") or []), *(cr.spec.get("args") or [])]
            ] or ["true"]
            workdir = root / str(cr.spec.get("workingDir") or "").lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
            env = {**self._base_env(pod, root), **cr.env}
            log_dir = run.poddir / "logs" / cr.name
            log_dir.mkdir(parents=True, exist_ok=True)
            container_id = f"sandbox://{run.uid[:8]}-{cr.name}-{cr.restart_count}"
            started_at = rfc3339()
            terminated: dict[str, Any]
            # terminationMessagePath (its default): a file the container may write, read
            # at its end (the kubelet's limit: 4096 bytes)
            message_file = root / str(
                cr.spec.get("terminationMessagePath") or "/dev/termination-log").lstrip("/")
            message_file.parent.mkdir(parents=True, exist_ok=True)
            message_file.write_bytes(b"")
            with open(log_dir / f"{cr.restart_count}.log", "ab") as sink:
                try:
                    cr.proc = await asyncio.create_subprocess_exec(
                        *argv,
                        cwd=str(workdir),
                        env=env,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                        start_new_session=True,
                    )
                except OSError as exc:
                    code = 128
                    terminated = {
                        "exitCode": 128,
                        "reason": "StartError",
                        "message": "failed to create containerd task: failed to create shim task: "
                        "OCI runtime create failed: runc create failed: unable to start "
                        f'container process: exec: "{argv[0]}": {exc.strerror}: unknown',
                        "startedAt": "1970-01-01T00:00:00Z",
                        "finishedAt": rfc3339(),
                        "containerID": container_id,
                    }
                    self._event(pod, "Warning", "Failed", f"Error: {terminated['message']}")
                else:
                    self._register(cr.proc.pid, run.uid)
                    if run.mode:  # killed while we were starting it
                        self._killpg(cr, signal.SIGKILL)
                    self._on_running(run, pod, cr, key, started_at, container_id, last_state)
                    pumps = [
                        asyncio.create_task(self._pump(stream, name, sink))
                        for stream, name in ((cr.proc.stdout, "stdout"), (cr.proc.stderr, "stderr"))
                    ]
                    raw = await cr.proc.wait()
                    self._killpg(cr, signal.SIGKILL)  # PID 1 gone: the container's rest goes too
                    _, pending = await asyncio.wait(pumps, timeout=2)
                    for task in pending:
                        task.cancel()
                    self._unregister(cr.proc.pid)
                    code = raw if raw >= 0 else 128 - raw
                    terminated = {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                        "startedAt": started_at,
                        "finishedAt": rfc3339(),
                        "containerID": container_id,
                    }
                    if code != 0 and raw < 0:
                        terminated["signal"] = -raw
                    with contextlib.suppress(OSError):
                        with open(message_file, "rb") as fh:
                            text = fh.read(4096).decode("utf-8", "replace")
                        if text:
                            terminated["message"] = text
            restart = not run.mode and (
                policy == "Always"
                or (policy == "OnFailure" and code != 0)
                or (cr.init and policy != "Never" and code != 0)
            )
            if cr.init and code == 0:
                restart = False
            if not restart:
                self._on_terminated(run, pod, cr, key, terminated, last_state)
                return code
            cr.restart_count += 1
            delay = min(RESTART_BACKOFF_MAX, 2.0 ** (cr.restart_count - 1))
            last_state = {"terminated": terminated}
            self._on_backoff(run, pod, cr, key, delay, last_state)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.stop.wait(), timeout=delay)

    def _update_container(
        self,
        run: PodRun,
        cr: ContainerRun,
        key: str,
        status: dict[str, Any],
        pod_mutate: Callable[[dict[str, Any]], None],
    ) -> dict[str, Any] | None:
        if run.mode == "node-lost":  # a lost node's kubelet reports nothing
            return None

        def mutate(o: dict[str, Any]) -> None:
            statuses = o["status"].get(key) or []
            o["status"][key] = [status if s.get("name") == cr.name else s for s in statuses]
            if not any(s.get("name") == cr.name for s in statuses):
                o["status"][key].append(status)
            pod_mutate(o)

        return self._write(run, mutate)

    def _on_running(
        self,
        run: PodRun,
        pod: dict[str, Any],
        cr: ContainerRun,
        key: str,
        started_at: str,
        container_id: str,
        last_state: dict[str, Any],
    ) -> None:
        status = self._container_status(
            cr.spec,
            {"running": {"startedAt": started_at}},
            ready=not cr.init,
            restarts=cr.restart_count,
            last=last_state,
            started=True,
            container_id=container_id,
        )

        def pod_mutate(o: dict[str, Any]) -> None:
            if cr.init:
                return
            main = o["status"].get("containerStatuses") or []
            all_ready = all(s.get("ready") for s in main)
            o["status"]["phase"] = "Running"
            names = " ".join(s["name"] for s in main if not s.get("ready"))
            o["status"]["conditions"] = self._pod_conditions(
                o,
                True,
                all_ready,
                "ContainersNotReady",
                f"containers with unready status: [{names}]",
            )

        updated = self._update_container(run, cr, key, status, pod_mutate)
        if updated is not None:
            image = cr.spec["image"]
            if cr.restart_count == 0:
                self._event(
                    updated,
                    "Normal",
                    "Pulled",
                    f'Container image "{image}" already present on machine',
                )
            self._event(updated, "Normal", "Created", f"Created container {cr.name}")
            self._event(updated, "Normal", "Started", f"Started container {cr.name}")

    def _on_terminated(
        self,
        run: PodRun,
        pod: dict[str, Any],
        cr: ContainerRun,
        key: str,
        terminated: dict[str, Any],
        last_state: dict[str, Any],
    ) -> None:
        status = self._container_status(
            cr.spec,
            {"terminated": terminated},
            restarts=cr.restart_count,
            last=last_state,
            container_id=terminated.get("containerID"),
        )

        def pod_mutate(o: dict[str, Any]) -> None:
            if cr.init:
                return
            main = o["status"].get("containerStatuses") or []
            names = " ".join(s["name"] for s in main if not s.get("ready"))
            o["status"]["conditions"] = self._pod_conditions(
                o, True, False, "ContainersNotReady", f"containers with unready status: [{names}]"
            )

        self._update_container(run, cr, key, status, pod_mutate)

    def _on_backoff(
        self,
        run: PodRun,
        pod: dict[str, Any],
        cr: ContainerRun,
        key: str,
        delay: float,
        last_state: dict[str, Any],
    ) -> None:
        meta = pod["metadata"]
        waiting = {
            "reason": "CrashLoopBackOff",
            "message": f"back-off {int(delay)}s restarting failed container={cr.name} "
            f"pod={meta['name']}_{meta['namespace']}({meta['uid']})",
        }
        status = self._container_status(
            cr.spec, {"waiting": waiting}, restarts=cr.restart_count, last=last_state
        )

        def pod_mutate(o: dict[str, Any]) -> None:
            o["status"]["conditions"] = self._pod_conditions(
                o,
                not cr.init,
                False,
                "ContainersNotReady",
                f"containers with unready status: [{cr.name}]",
            )

        updated = self._update_container(run, cr, key, status, pod_mutate)
        if updated is not None:
            self._event(
                updated,
                "Warning",
                "BackOff",
                f"Back-off restarting failed container {cr.name} in pod "
                f"{meta['name']}_{meta['namespace']}({meta['uid']})",
            )

    @staticmethod
    async def _pump(stream: asyncio.StreamReader | None, name: str, sink: IO[bytes]) -> None:
        """Copy a stream into the CRI-style log file: "<time> <stream> F <line>"."""
        if stream is None:
            return
        pending = b""
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            stamp = rfc3339_nano().encode()
            for line in lines:
                sink.write(stamp + b" " + name.encode() + b" F " + line + b"\n")
            sink.flush()
        if pending:
            sink.write(rfc3339_nano().encode() + b" " + name.encode() + b" F " + pending + b"\n")
            sink.flush()

    # ------------------------------------------------------------------ stopping
    def kill(self, uid: str, mode: str, grace: int) -> None:
        """Stop a pod's processes: SIGTERM to each container's first process (as the kubelet
        does: the runtime signals the container's PID 1 only), SIGKILL to all of each
        container after ``grace``."""
        run = self.runs.get(uid)
        if run is None:
            return
        if run.mode is None or mode in ("delete", "node-lost", "reset", "forget"):
            run.mode = mode
        run.stop.set()
        for cr in run.containers.values():
            if cr.proc is not None and cr.proc.returncode is None:
                if grace <= 0:
                    self._killpg(cr, signal.SIGKILL)
                else:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(cr.proc.pid, signal.SIGTERM)
        if grace > 0:
            asyncio.get_running_loop().call_later(grace, self._force, run)

    def _force(self, run: PodRun) -> None:
        for cr in run.containers.values():
            if cr.proc is not None and cr.proc.returncode is None:
                self._killpg(cr, signal.SIGKILL)

    def forget(self, uid: str, pod: dict[str, Any] | None = None) -> None:
        """The pod object is gone: stop whatever still runs and drop its bookkeeping (and
        its folder, once nothing runs in it: a finalizer kept it after its containers ended)."""
        self.pull_started.pop(uid, None)
        self.ips.pop(uid, None)
        if uid in self.runs:
            self.kill(uid, "forget", 0)
        elif pod is not None:
            shutil.rmtree(self.poddir(pod), ignore_errors=True)

    async def kill_all(self, grace: float = 0) -> None:
        """Stop every pod process (reset and shutdown), waiting a bounded time."""
        runs = list(self.runs.values())
        for run in runs:
            self.kill(run.uid, "reset", int(grace))
        tasks = [run.task for run in runs if run.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace + 5)
            for task in pending:
                task.cancel()
        for run in runs:
            for cr in run.containers.values():
                self._killpg(cr, signal.SIGKILL)
        self.runs.clear()
        self.pull_started.clear()
        self.ips.clear()

    def clean_dirs(self) -> None:
        live = {run.poddir for run in self.runs.values()}
        if self.pods_dir.is_dir():
            for child in self.pods_dir.iterdir():
                if child not in live:
                    shutil.rmtree(child, ignore_errors=True)

    def reap_orphans(self) -> int:
        """Reap zombies of pod grandchildren reparented to us (the daemon is a subreaper:
        this machine's PID 1 does not reap, so without this they would pile up)."""
        ours = {
            cr.proc.pid
            for run in self.runs.values()
            for cr in run.containers.values()
            if cr.proc is not None
        }
        me, reaped = os.getpid(), 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in ours:
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == me:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(int(entry.name), os.WNOHANG)
                    reaped += 1
        return reaped

    # ------------------------------------------------------------------ pid registry
    def _register(self, pid: int, uid: str) -> None:
        start = proc_start_time(pid)
        if start is not None:
            self.pids[pid] = f"{pid} {start} {uid}"
            self._save_pids()

    def _unregister(self, pid: int) -> None:
        if self.pids.pop(pid, None) is not None:
            self._save_pids()

    def _save_pids(self) -> None:
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in self.pids.values()))
        tmp.replace(self.pid_file)
