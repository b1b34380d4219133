"""``config.kubernetes.pod_config`` fields that take a pod out of its cluster's control.

SkyPilot merges a task's ``pod_config`` (a Pod object) over the pod it builds. A task could so
ask for the node's namespaces, its files, root on the node, another identity or another node
than the connection's. :func:`refused` lists such fields: the Pod Security Standards' *baseline*
profile (host namespaces, host ports, hostPath volumes, privileged containers, capabilities
beyond the baseline set, unsafe sysctls, AppArmor/seccomp/SELinux/procMount relaxations,
Windows host processes), plus what the connection decides (service account and its token,
scheduler, node, priority, tolerations), the namespace's Secrets (a ``secret`` volume, a
projected ``secret`` or ``serviceAccountToken``, ``envFrom.secretRef``,
``env.valueFrom.secretKeyRef``, a volume's secret reference: a DAG could otherwise read any
Secret of the namespace, other jobs' included) and GPU requests made outside ``resources``.

A Kubernetes connection refuses a task with such fields (its offers do not fit, and nothing is
submitted) unless its extra :data:`ALLOW_EXTRA` is true. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

#: the Kubernetes connection extra that lets tasks use the fields below
ALLOW_EXTRA = "allow_privileged_pod_config"

Path = tuple[str | int, ...]

#: capabilities a baseline pod may add (Pod Security Standards, baseline)
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
#: sysctls a baseline pod may set
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})
_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
_HOST = "shares the node's {}"
_SECRET = "reads a Secret of the namespace ({})"
_CONNECTION = "the connection decides the pod's {}"

#: pod spec fields refused when set at all (to anything but the harmless value, if one)
_POD_FIELDS: dict[str, tuple[str, Any]] = {
    "hostNetwork": (_HOST.format("network"), False),
    "hostPID": (_HOST.format("processes"), False),
    "hostIPC": (_HOST.format("IPC"), False),
    "serviceAccountName": (_CONNECTION.format("service account (extra 'service_account')"), None),
    "serviceAccount": (_CONNECTION.format("service account (extra 'service_account')"), None),
    "automountServiceAccountToken": (_CONNECTION.format("service account token"), False),
    "nodeName": ("bypasses the scheduler and the connection's node_selector", None),
    "schedulerName": ("bypasses the scheduler the capacity was counted for", None),
    "priorityClassName": (_CONNECTION.format("priority (extra 'priority_class')"), None),
    "priority": (_CONNECTION.format("priority (extra 'priority_class')"), None),
    "tolerations": (_CONNECTION.format("tolerations (extra 'tolerations')"), None),
}


def refused(pod_config: Mapping[str, Any]) -> list[tuple[Path, str]]:
    """(path inside ``pod_config``, why) for every field a connection refuses by default."""
    return list(_walk(pod_config))


def _walk(pod: Mapping[str, Any]) -> Iterator[tuple[Path, str]]:
    meta = pod.get("metadata")
    if isinstance(meta, Mapping) and isinstance(meta.get("annotations"), Mapping):
        for key, value in meta["annotations"].items():
            if str(key).startswith("container.apparmor.security.beta.kubernetes.io/") and \
                    not _apparmor_ok(value):
                yield ("metadata", "annotations", key), f"AppArmor profile {value!r} (unconfined)"
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return
    for field, (why, harmless) in _POD_FIELDS.items():
        if field in spec and not (harmless is not None and spec[field] == harmless):
            yield ("spec", field), why
    if isinstance(spec.get("securityContext"), Mapping):
        yield from _security_context(spec["securityContext"], ("spec", "securityContext"),
                                     pod_level=True)
    for i, volume in _items(spec.get("volumes")):
        if "hostPath" in volume:
            yield ("spec", "volumes", i, "hostPath"), "mounts a directory of the node (hostPath)"
        yield from _volume_secrets(volume, ("spec", "volumes", i))
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        for i, container in _items(spec.get(kind)):
            yield from _container(container, ("spec", kind, i))


#: keys of other volume sources (csi, cephfs, rbd, azureFile, flexVolume...) naming a Secret
_VOLUME_SECRET_KEYS = ("secretRef", "nodePublishSecretRef", "secretName")


def _volume_secrets(volume: Mapping[str, Any], at: Path) -> Iterator[tuple[Path, str]]:
    if "secret" in volume:
        yield (*at, "secret"), _SECRET.format("a secret volume")
    projected = volume.get("projected")
    if isinstance(projected, Mapping):
        for j, source in _items(projected.get("sources")):
            if "secret" in source:
                yield (*at, "projected", "sources", j, "secret"), \
                    _SECRET.format("a projected secret")
            if "serviceAccountToken" in source:
                yield (*at, "projected", "sources", j, "serviceAccountToken"), \
                    _CONNECTION.format("service account token")
    for kind, source in volume.items():
        if kind in ("secret", "projected") or not isinstance(source, Mapping):
            continue
        for key in _VOLUME_SECRET_KEYS:
            if source.get(key):
                yield (*at, kind, key), _SECRET.format(f"the {kind} volume's {key}")


def _container(container: Mapping[str, Any], at: Path) -> Iterator[tuple[Path, str]]:
    for j, source in _items(container.get("envFrom")):
        if "secretRef" in source:
            yield (*at, "envFrom", j, "secretRef"), _SECRET.format("envFrom")
    for j, var in _items(container.get("env")):
        value_from = var.get("valueFrom")
        if isinstance(value_from, Mapping) and "secretKeyRef" in value_from:
            yield (*at, "env", j, "valueFrom", "secretKeyRef"), _SECRET.format("secretKeyRef")
    for j, port in _items(container.get("ports")):
        if port.get("hostPort") not in (None, 0):
            yield (*at, "ports", j, "hostPort"), _HOST.format("ports (hostPort)")
    if isinstance(container.get("securityContext"), Mapping):
        yield from _security_context(container["securityContext"], (*at, "securityContext"),
                                     pod_level=False)
    resources = container.get("resources")
    if isinstance(resources, Mapping):
        for part in ("limits", "requests"):
            for name in resources.get(part) or {}:
                if str(name).endswith("/gpu"):
                    yield (*at, "resources", part, name), \
                        "GPUs are asked for with resources.accelerators, where they are counted"


def _security_context(ctx: Mapping[str, Any], at: Path,
                      pod_level: bool) -> Iterator[tuple[Path, str]]:
    if not pod_level:
        if ctx.get("privileged") not in (None, False):
            yield (*at, "privileged"), "a privileged container is root on the node"
        if ctx.get("allowPrivilegeEscalation") not in (None, False):
            yield (*at, "allowPrivilegeEscalation"), "allows privilege escalation"
        caps = ctx.get("capabilities")
        if isinstance(caps, Mapping):
            for k, cap in enumerate(caps.get("add") or []):
                if str(cap).upper().removeprefix("CAP_") not in BASELINE_CAPABILITIES:
                    yield (*at, "capabilities", "add", k), \
                        f"adds capability {cap!r} (beyond the baseline set)"
        if ctx.get("procMount") not in (None, "Default"):
            yield (*at, "procMount"), "unmasks /proc"
    windows = ctx.get("windowsOptions")
    if isinstance(windows, Mapping) and windows.get("hostProcess") not in (None, False):
        yield (*at, "windowsOptions", "hostProcess"), "a Windows host process"
    seccomp = ctx.get("seccompProfile")
    if isinstance(seccomp, Mapping) and seccomp.get("type") == "Unconfined":
        yield (*at, "seccompProfile", "type"), "no seccomp profile (Unconfined)"
    apparmor = ctx.get("appArmorProfile")
    if isinstance(apparmor, Mapping) and apparmor.get("type") == "Unconfined":
        yield (*at, "appArmorProfile", "type"), "no AppArmor profile (Unconfined)"
    selinux = ctx.get("seLinuxOptions")
    if isinstance(selinux, Mapping):
        if selinux.get("type", "") not in _SELINUX_TYPES:
            yield (*at, "seLinuxOptions", "type"), f"SELinux type {selinux.get('type')!r}"
        for key in ("user", "role"):
            if selinux.get(key):
                yield (*at, "seLinuxOptions", key), f"sets the SELinux {key}"
    if pod_level:
        for k, sysctl in _items(ctx.get("sysctls")):
            if sysctl.get("name") not in SAFE_SYSCTLS:
                yield (*at, "sysctls", k, "name"), f"sets the unsafe sysctl {sysctl.get('name')!r}"


def _apparmor_ok(value: Any) -> bool:
    return value == "runtime/default" or str(value).startswith("localhost/")


def _items(value: Any) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(index, item) for the mappings of a list (other items are the schema's business)."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, Mapping):
                yield i, item
