"""The account's vCPU quotas: how many instances of a type may start in a region now.

EC2 limits running vCPUs per region and instance class (Standard, G and VT, P; on-demand and
spot apart). The limit comes from Service Quotas (cached five minutes); the use is the vCPUs
of the account's pending and running instances of that class, as EC2 counts them: instances
still launching (placements made moments ago, from this deployment or not) take their share
before the next placement sees the room (:attr:`QuotaView.pending`). A RunInstances so recent
that DescribeInstances does not list it yet (eventual consistency) is not seen. Families
with quotas of their own (inf, trn, dl, f, x, ...) are not checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_skypilot.backends.aws.catalog import InstanceTypeInfo, region_catalog
from airflow_skypilot.backends.aws.clients import AwsClients, client_error, is_unreachable
from airflow_skypilot.backends.aws.ec2 import ALIVE, TAG_JOB, describe_instances

QUOTA_TTL = 300.0
#: (instance class, spot) -> Service Quotas code (vCPUs)
QUOTA_CODES: dict[tuple[str, bool], str] = {
    ("standard", False): "L-1216C47A",
    ("g", False): "L-DB2E81BA",
    ("p", False): "L-417A185B",
    ("standard", True): "L-34B43A08",
    ("g", True): "L-3819A6DF",
    ("p", True): "L-7212CCBC",
}
QUOTA_LABELS = {"standard": "Standard (A, C, D, H, I, M, R, T, Z)", "g": "G and VT", "p": "P"}


def quota_class(instance_type: str) -> str | None:
    """The vCPU quota class of a type: ``g`` (G and VT), ``p``, ``standard``; None for the
    families with quotas of their own (inf, trn, dl, f, x, u-, mac, hpc): not checked here."""
    family = instance_type.split(".")[0].lower()
    if family.startswith(("inf", "trn", "dl", "hpc", "mac", "u-", "f", "x")):
        return None
    if family.startswith(("g", "vt")):
        return "g"
    if family.startswith("p"):
        return "p"
    if family[:1] in tuple("acdhimrtz"):
        return "standard"
    return None


@dataclass
class QuotaView:
    """One vCPU quota of a region and how much of it running instances use."""

    instance_class: str
    spot: bool
    code: str | None
    limit: float | None  # None: unknown (no permission, no such quota)
    used: float = 0.0
    note: str = ""
    #: of ``used``: the vCPUs of instances still launching (``pending``), how many there are,
    #: and how many of them are jobs' (tagged by this provider: placements made moments ago)
    pending: float = 0.0
    pending_instances: int = 0
    pending_ours: int = 0

    @property
    def label(self) -> str:
        kind = "spot" if self.spot else "on-demand"
        return f"{QUOTA_LABELS.get(self.instance_class, self.instance_class)} {kind}"

    @property
    def room(self) -> float | None:
        return None if self.limit is None else max(0.0, self.limit - self.used)

    def nodes(self, vcpus_per_node: int) -> tuple[int | None, int | None]:
        """(instances that can start now, instances the whole quota allows)."""
        if self.limit is None or vcpus_per_node <= 0:
            return None, None
        return int(self.room // vcpus_per_node), int(self.limit // vcpus_per_node)

    def describe(self, need_vcpus: float) -> str:
        code = f" ({self.code})" if self.code else ""
        if self.limit is None:
            return f"{self.label} vCPU quota{code} unknown{': ' + self.note if self.note else ''}"
        return (f"needs {need_vcpus:g} vCPUs of the {self.label} quota{code}, "
                f"{self.room:g} of {self.limit:g} left")


def vcpus_in_use(instances: Iterable[Mapping[str, Any]],
                 vcpus_of: Callable[[str], int | None]) -> dict[tuple[str, bool], float]:
    """vCPUs of pending/running instances per (quota class, spot), as quotas count them."""
    used: dict[tuple[str, bool], float] = {}
    for inst in instances:
        if (inst.get("State") or {}).get("Name") not in ALIVE:
            continue
        itype = inst.get("InstanceType", "")
        cls = quota_class(itype)
        if cls is None:
            continue
        cpu = inst.get("CpuOptions") or {}
        vcpus = (cpu.get("CoreCount") or 0) * (cpu.get("ThreadsPerCore") or 0) \
            or vcpus_of(itype) or 0
        key = (cls, inst.get("InstanceLifecycle") == "spot")
        used[key] = used.get(key, 0.0) + vcpus
    return used


def launching(instances: Iterable[Mapping[str, Any]],
              vcpus_of: Callable[[str], int | None]
              ) -> dict[tuple[str, bool], tuple[float, int, int]]:
    """Per (quota class, spot): (vCPUs, instances, of them ours) of the instances still
    ``pending`` (launching): already counted by EC2's quota, not running a job yet."""
    out: dict[tuple[str, bool], tuple[float, int, int]] = {}
    for inst in instances:
        if (inst.get("State") or {}).get("Name") != "pending":
            continue
        cls = quota_class(inst.get("InstanceType", ""))
        if cls is None:
            continue
        vcpus = vcpus_in_use([inst], vcpus_of).get((cls, inst.get("InstanceLifecycle") ==
                                                     "spot"), 0.0)
        ours = any(t.get("Key") == TAG_JOB for t in inst.get("Tags") or [])
        key = (cls, inst.get("InstanceLifecycle") == "spot")
        v, n, o = out.get(key, (0.0, 0, 0))
        out[key] = (v + vcpus, n + 1, o + int(ours))
    return out


class Quotas:
    """The vCPU quotas of one connection's regions (Service Quotas values cached)."""

    def __init__(self, clients: AwsClients):
        self._clients = clients
        self._cache: dict[tuple[str, str], tuple[float, float | None, str]] = {}

    def limit(self, region: str, cls: str, spot: bool) -> tuple[float | None, str]:
        """(the quota's vCPUs or None when unknown, why unknown)."""
        code = QUOTA_CODES.get((cls, spot))
        if code is None:
            return None, "no quota code known for this class"
        key = (region, code)
        cached = self._cache.get(key)
        if cached and time.time() - cached[0] < QUOTA_TTL:
            return cached[1], cached[2]
        try:
            quota = self._clients.client("service-quotas", region).get_service_quota(
                ServiceCode="ec2", QuotaCode=code)["Quota"]
            value: float | None = float(quota["Value"])
            note = ""
        except Exception as exc:
            if is_unreachable(exc):
                raise self._clients.error(exc, f"Service Quotas in {region}") from exc
            value, note = None, "{}: {}".format(*client_error(exc))
        self._cache[key] = (time.time(), value, note)
        return value, note

    def views(self, region: str, catalog: Mapping[str, InstanceTypeInfo],
              classes: set[tuple[str, bool]], cpu_families: Iterable[str],
              ) -> dict[tuple[str, bool], QuotaView]:
        """The quotas ``classes`` of ``region`` with the vCPUs the account's instances use
        (types missing from ``catalog`` are looked up for their vCPUs)."""
        if not classes:
            return {}
        clients = self._clients
        instances = describe_instances(clients, region, [
            {"Name": "instance-state-name", "Values": list(ALIVE)}])
        unknown = {i.get("InstanceType", "") for i in instances} - set(catalog)
        if unknown:
            catalog = {**catalog, **region_catalog(clients, region, cpu_families, unknown)}
        def vcpus_of(t: str) -> int | None:
            return catalog[t].vcpus if t in catalog else None

        used = vcpus_in_use(instances, vcpus_of)
        starting = launching(instances, vcpus_of)
        out = {}
        for cls, spot in classes:
            limit, note = self.limit(region, cls, spot)
            pending, count, ours = starting.get((cls, spot), (0.0, 0, 0))
            out[(cls, spot)] = QuotaView(cls, spot, QUOTA_CODES.get((cls, spot)), limit,
                                         used.get((cls, spot), 0.0), note, pending, count,
                                         ours)
        return out
