"""AWS as a place to run jobs: EC2 instances, on the amazon provider's hooks.

An AWS account is an Airflow connection of type ``aws`` (credentials, ``region_name``,
``endpoint_url`` as the amazon provider reads them) with extras (see :class:`AwsSettings`).
Sync calls use ``EC2Hook`` / ``AwsBaseHook(client_type=...)`` boto3 clients; the triggerer's
calls use the same hooks' aiobotocore clients (``get_async_conn``), kept open per region.

probe
    per region, concurrently: the GPU instance types (``DescribeInstanceTypes``: GpuInfo name,
    count, memory; cached for an hour), which AZs offer the types a candidate can use
    (``DescribeInstanceTypeOfferings``), the latest spot price per AZ
    (``DescribeSpotPriceHistory``), the account's vCPU quota per instance class (Service Quotas)
    minus the vCPUs of its pending/running instances of that class. On-demand prices come from
    the catalog shipped in ``data/aws_prices.json`` (source and date inside). One offer per
    candidate and AZ: the cheapest instance type with the requested GPUs (at least that many;
    fewest first), cpus and memory; ``nodes_free`` is how many such instances the quota still
    allows, so ``free_now`` means "the quota lets all ``num_nodes`` start now".
submit
    ``RunInstances`` of ``num_nodes`` instances in one call (so EC2 numbers them 0..N-1: the
    rank), in the offer's AZ, then the region's other AZs that offer the type if EC2 has no
    capacity there; tags name the job, so a job is found, adopted and cleaned up by its name.
    The user-data is :mod:`airflow_skypilot.backends._aws_userdata`; secrets go to SSM Parameter
    Store (SecureString) under ``<ssm_prefix>/<job name>/`` and are deleted on cleanup/cancel.
status
    one ``DescribeInstances`` per region for every watched job (filtered by the job-name tag),
    plus one S3 listing per job with a started instance: ``<prefix><job>/rank-<r>/exit_code``
    (the node's exit code), ``preempted`` (spot notice), ``bootstrap_error``, ``aborted``.

S3 layout, under ``s3://<s3_bucket>/<s3_prefix><job name>/``: ``handle.json`` (written at
submit: lets a retried worker find the job even after EC2 forgot its instances),
``payload.tgz`` (only when the job's files do not fit in 16 KB of user-data), and per node
``rank-<r>/log``, ``rank-<r>/exit_code`` and the other markers. Logs and markers stay (give
the bucket a lifecycle rule); the payload and the SSM parameters are deleted by cleanup.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from importlib import resources
from typing import Any

from airflow_skypilot.backends import _aws_userdata as userdata
from airflow_skypilot.backends.base import (
    Backend,
    CapacityRow,
    JobHandle,
    JobState,
    JobStatus,
    Offer,
)
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.backends.common.features import Feature
from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError
from airflow_skypilot.spec import accelerators as acc
from airflow_skypilot.spec import fields
from airflow_skypilot.spec.task import ResourceRequest, Task

log = logging.getLogger(__name__)

TAG_JOB = "skypilot-airflow:job-name"
TAG_META = "skypilot-airflow:meta"
TAG_CONN = "skypilot-airflow:connection"
TAG_CANCELLED = "skypilot-airflow:cancelled"

ALIVE = ("pending", "running")
GONE = ("shutting-down", "terminated", "stopping", "stopped")

#: RunInstances errors that are about this AZ (another AZ of the region may work)
CAPACITY_ERRORS = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity", "Unsupported", "InsufficientFreeAddressesInSubnet",
    "SpotMaxPriceTooLow",
})
#: RunInstances errors about the region's quota (no other AZ helps)
QUOTA_ERRORS = frozenset({"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded",
                          "InstanceLimitExceeded"})
#: botocore errors that mean "cannot talk to AWS at all"
_UNREACHABLE_NAMES = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                      "NoCredentialsError", "ConnectionClosedError", "NoRegionError",
                      "ClientConnectorError", "ServerDisconnectedError", "TimeoutError")

CATALOG_TTL = 3600.0
QUOTA_TTL = 300.0
REFUSED_TTL = 120.0
#: SkyPilot's default for a task that names neither cpus nor memory (m6i.2xlarge on AWS)
DEFAULT_CPUS = "8+"


# --- price catalog ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PriceCatalog:
    """On-demand list prices shipped with the package (``data/aws_prices.json``)."""

    source: str
    as_of: str
    regions: tuple[str, ...]
    prices: Mapping[str, float]

    def price(self, region: str, instance_type: str) -> tuple[float | None, str]:
        """(USD per instance-hour or None, where the number comes from)."""
        value = self.prices.get(instance_type)
        if value is None:
            return None, f"no on-demand price for {instance_type} in the shipped catalog"
        if region in self.regions:
            return value, f"on-demand list price as of {self.as_of}"
        return value, (f"on-demand list price of {self.regions[0]} as of {self.as_of} "
                       f"({region} may differ)")


@lru_cache(maxsize=1)
def price_catalog() -> PriceCatalog:
    raw = resources.files("airflow_skypilot.backends").joinpath("data/aws_prices.json")
    data = json.loads(raw.read_text(encoding="utf-8"))
    return PriceCatalog(source=data["source"], as_of=data["as_of"],
                        regions=tuple(data["regions"]),
                        prices={k: float(v) for k, v in data["prices"].items()})


# --- instance types (pure) -------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceTypeInfo:
    """What placement needs of one EC2 instance type."""

    name: str
    vcpus: int
    memory_gb: float
    gpu: str | None = None  # canonical accelerator name (SkyPilot's spelling)
    gpu_label: str = ""  # EC2's GpuInfo name
    gpus: float = 0  # per instance; a fraction for shares of one GPU (g6f)
    gpu_memory_gb: float = 0
    archs: tuple[str, ...] = ("x86_64",)

    @property
    def family(self) -> str:
        return self.name.split(".")[0]

    @property
    def arch(self) -> str:
        return "x86_64" if "x86_64" in self.archs or not self.archs else self.archs[0]


def gpu_name(label: str, memory_mib: float) -> str:
    """EC2 GpuInfo name -> canonical name; the memory tells A100 from A100-80GB."""
    name = acc.canonical_from_label(label)
    if name == "A100" and memory_mib >= 70 * 1024:
        return "A100-80GB"
    if name == "V100" and memory_mib >= 30 * 1024:
        return "V100-32GB"
    return name


def parse_instance_types(raw: Iterable[Mapping[str, Any]]) -> dict[str, InstanceTypeInfo]:
    """``DescribeInstanceTypes`` entries -> InstanceTypeInfo by name.

    A GPU entry with ``Count: 0`` (g6f, gr6f) is a share of one GPU: its count is its GPU
    memory over the memory of the full GPU of that name.
    """
    items = list(raw)
    full: dict[str, float] = {}
    for item in items:
        for gpu in (item.get("GpuInfo") or {}).get("Gpus") or []:
            if gpu.get("Count"):
                mem = float((gpu.get("MemoryInfo") or {}).get("SizeInMiB") or 0)
                full[gpu["Name"]] = max(full.get(gpu["Name"], 0.0), mem)
    out: dict[str, InstanceTypeInfo] = {}
    for item in items:
        name = item["InstanceType"]
        vcpus = int((item.get("VCpuInfo") or {}).get("DefaultVCpus") or 0)
        mem_gb = float((item.get("MemoryInfo") or {}).get("SizeInMiB") or 0) / 1024
        archs = tuple((item.get("ProcessorInfo") or {}).get("SupportedArchitectures") or ())
        gpus = (item.get("GpuInfo") or {}).get("Gpus") or []
        if not gpus:
            out[name] = InstanceTypeInfo(name, vcpus, mem_gb, archs=archs or ("x86_64",))
            continue
        gpu = gpus[0]
        mem = float((gpu.get("MemoryInfo") or {}).get("SizeInMiB") or 0)
        count = float(gpu.get("Count") or 0)
        if not count:
            whole = full.get(gpu["Name"])
            if not whole or not mem:
                out[name] = InstanceTypeInfo(name, vcpus, mem_gb, archs=archs or ("x86_64",))
                continue
            count = round(mem / whole, 3)
            mem = whole
        out[name] = InstanceTypeInfo(
            name, vcpus, mem_gb, gpu=gpu_name(gpu["Name"], mem), gpu_label=gpu["Name"],
            gpus=int(count) if float(count).is_integer() else count,
            gpu_memory_gb=round(mem / 1024, 1), archs=archs or ("x86_64",))
    return out


def _count_text(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{n:g}"


def _shape_problem(info: InstanceTypeInfo, req: ResourceRequest, default_cpus: bool) -> str:
    """Why ``info`` does not have the candidate's cpus/memory ("" when it does)."""
    cpus_text = req.cpus if req.cpus is not None or req.memory is not None or not default_cpus \
        else DEFAULT_CPUS
    cpus, cpus_plus = fields.split_at_least(cpus_text)
    mem, mem_plus = req.memory_needed_gb()
    if cpus is not None and (info.vcpus < cpus if cpus_plus else info.vcpus != cpus):
        return f"{'at least ' if cpus_plus else ''}{_count_text(cpus)} vCPUs"
    if mem is not None and (info.memory_gb < mem - 1e-6 if mem_plus
                            else abs(info.memory_gb - mem) > 0.01):
        return f"{'at least ' if mem_plus else ''}{_count_text(mem)} GB of memory"
    return ""


def gpu_matches(requested: str, info: InstanceTypeInfo) -> bool:
    if not info.gpu:
        return False
    try:
        return acc.same_accelerator(requested, info.gpu)
    except acc.AmbiguousAcceleratorError:
        return False


def suitable_types(catalog: Mapping[str, InstanceTypeInfo], req: ResourceRequest, *,
                   cpu_families: Iterable[str] = ("m6i",),
                   price_of: Callable[[str], float | None] = lambda _: None,
                   ) -> tuple[list[InstanceTypeInfo], str]:
    """The instance types that can run one node of ``req``, best first, or ([], why not).

    With ``instance_type``: exactly that type. With an accelerator: the types with at least
    ``accelerator_count`` of it, fewest GPUs first, then the cheaper, then the smaller. CPU only:
    the general-purpose ``cpu_families`` (m6i by default, SkyPilot's choice; 8+ vCPUs when the
    task names neither cpus nor memory, as SkyPilot).
    """
    def order(info: InstanceTypeInfo) -> tuple[Any, ...]:
        price = price_of(info.name)
        return (info.gpus, math.inf if price is None else price, info.vcpus, info.memory_gb,
                info.name)

    if req.instance_type:
        info = catalog.get(req.instance_type)
        if info is None:
            return [], f"unknown EC2 instance type {req.instance_type}"
        if req.accelerator:
            if not gpu_matches(req.accelerator, info):
                have = f"{_count_text(info.gpus)} x {info.gpu}" if info.gpu else "no GPU"
                return [], f"{info.name} has {have}, not {req.accelerator}"
            if info.gpus + 1e-9 < req.accelerator_count:
                return [], (f"{info.name} has {_count_text(info.gpus)} x {info.gpu}; "
                            f"{_count_text(req.accelerator_count)} requested")
        if why := _shape_problem(info, req, default_cpus=False):
            return [], f"{info.name} does not have {why}"
        return [info], ""
    if req.accelerator:
        with_gpu = [i for i in catalog.values() if gpu_matches(req.accelerator, i)]
        if not with_gpu:
            return [], f"no EC2 instance type has {req.accelerator}"
        enough = [i for i in with_gpu if i.gpus + 1e-9 >= req.accelerator_count]
        if not enough:
            most = max(i.gpus for i in with_gpu)
            return [], (f"no EC2 instance type has {_count_text(req.accelerator_count)} x "
                        f"{req.accelerator} (at most {_count_text(most)})")
        shaped = [i for i in enough if not _shape_problem(i, req, default_cpus=False)]
        if not shaped:
            why = _shape_problem(enough[0], req, default_cpus=False)
            return [], (f"no EC2 instance type with {_count_text(req.accelerator_count)} x "
                        f"{req.accelerator} has {why}")
        return sorted(shaped, key=order), ""
    families = tuple(cpu_families)
    general = [i for i in catalog.values() if not i.gpu and i.family in families
               and not i.name.endswith(".metal")]
    shaped = [i for i in general if not _shape_problem(i, req, default_cpus=True)]
    if not shaped:
        wanted = ", ".join(x for x in (req.cpus and f"{req.cpus} CPUs",
                                       req.memory and f"{req.memory} GB") if x)
        return [], (f"no {'/'.join(families)} instance type has {wanted or DEFAULT_CPUS + ' CPUs'}"
                    " (CPU-only tasks use these general-purpose families)")
    return sorted(shaped, key=order), ""


# --- quotas (pure) ---------------------------------------------------------------------------

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


# --- settings --------------------------------------------------------------------------------


def _strings(value: Any) -> list[str]:
    if value in (None, "", []):
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def _per_region(value: Any, listy: bool) -> dict[str, Any]:
    """A dict keyed by region (``default``/``*`` for all), or one value for every region."""
    if value in (None, "", [], {}):
        return {}
    if isinstance(value, dict):
        return {("*" if k in ("default", "*") else str(k)): (_strings(v) if listy else str(v))
                for k, v in value.items() if v not in (None, "", [])}
    return {"*": _strings(value) if listy else str(value)}


@dataclass
class AwsSettings:
    """What an ``aws`` connection's extras may say (all optional but ``s3_bucket`` to run).

    ``regions`` (list; default the connection's ``region_name``), ``s3_bucket``, ``s3_prefix``,
    per region (a dict keyed by region, ``default`` for the rest, or one value for all):
    ``subnet_id`` (one or a list; their AZs are the only ones used), ``security_group_ids``,
    ``ami_id``, ``instance_profile`` (name or ARN; needs s3:GetObject/PutObject/ListBucket on the
    prefix, ssm:GetParameters on ``ssm_prefix`` and, for multi-node jobs,
    ec2:DescribeInstances). ``ami_name_pattern`` / ``ami_owners``: the AMI when none is given
    (newest by creation date). ``max_price_per_hour`` (USD for the whole job), ``key_name``,
    ``boot_seconds`` (expected launch-to-running delay), ``log_interval`` /
    ``spot_check_interval`` (seconds, on the instance), ``ssm_prefix``, ``prices`` (instance type
    -> USD/h, over the shipped catalog), ``cpu_families`` (CPU-only tasks; default m6i), ``tags``.
    """

    regions: list[str]
    s3_bucket: str | None = None
    s3_prefix: str = "airflow-skypilot/"
    subnet_id: dict[str, list[str]] = field(default_factory=dict)
    security_group_ids: dict[str, list[str]] = field(default_factory=dict)
    ami_id: dict[str, str] = field(default_factory=dict)
    instance_profile: dict[str, str] = field(default_factory=dict)
    ami_name_pattern: str = "Deep Learning*GPU*"
    ami_owners: list[str] = field(default_factory=lambda: ["amazon"])
    max_price_per_hour: float | None = None
    key_name: str | None = None
    boot_seconds: float = 120.0
    log_interval: int = 10
    spot_check_interval: int = 5
    ssm_prefix: str = "/airflow-skypilot"
    prices: dict[str, float] = field(default_factory=dict)
    cpu_families: list[str] = field(default_factory=lambda: ["m6i"])
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> AwsSettings:
        regions = _strings(extra.get("regions")) or _strings(extra.get("region_name")) \
            or ["us-east-1"]
        prefix = str(extra.get("s3_prefix") or "airflow-skypilot/").lstrip("/")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        ssm = "/" + str(extra.get("ssm_prefix") or "/airflow-skypilot").strip("/")
        max_price = extra.get("max_price_per_hour")
        return cls(
            regions=regions,
            s3_bucket=extra.get("s3_bucket") or None,
            s3_prefix=prefix,
            subnet_id=_per_region(extra.get("subnet_id") or extra.get("subnet_ids"), True),
            security_group_ids=_per_region(extra.get("security_group_ids"), True),
            ami_id=_per_region(extra.get("ami_id"), False),
            instance_profile=_per_region(extra.get("instance_profile"), False),
            ami_name_pattern=str(extra.get("ami_name_pattern") or "Deep Learning*GPU*"),
            ami_owners=_strings(extra.get("ami_owners")) or ["amazon"],
            max_price_per_hour=float(max_price) if max_price not in (None, "") else None,
            key_name=extra.get("key_name") or None,
            boot_seconds=float(extra.get("boot_seconds") or 120.0),
            log_interval=max(1, int(extra.get("log_interval") or 10)),
            spot_check_interval=max(1, int(extra.get("spot_check_interval") or 5)),
            ssm_prefix=ssm,
            prices={str(k): float(v) for k, v in (extra.get("prices") or {}).items()},
            cpu_families=_strings(extra.get("cpu_families")) or ["m6i"],
            tags={str(k): str(v) for k, v in (extra.get("tags") or {}).items()},
        )

    @staticmethod
    def pick(mapping: Mapping[str, Any], region: str) -> Any:
        return mapping.get(region, mapping.get("*"))


# --- status (pure) ---------------------------------------------------------------------------


@dataclass
class InstanceView:
    """One instance of a job, as DescribeInstances shows it."""

    instance_id: str
    rank: int
    state: str
    spot: bool = False
    reason_code: str = ""
    reason: str = ""
    launch_time: float | None = None
    private_ip: str = ""
    az: str = ""
    reservation_id: str = ""
    instance_type: str = ""
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_api(cls, inst: Mapping[str, Any], reservation_id: str = "") -> InstanceView:
        launched = inst.get("LaunchTime")
        if isinstance(launched, datetime):
            launch_time: float | None = launched.timestamp()
        else:
            launch_time = None
        reason = inst.get("StateReason") or {}
        return cls(
            instance_id=inst["InstanceId"], rank=int(inst.get("AmiLaunchIndex") or 0),
            state=(inst.get("State") or {}).get("Name", "unknown"),
            spot=inst.get("InstanceLifecycle") == "spot",
            reason_code=reason.get("Code", ""),
            reason=reason.get("Message") or inst.get("StateTransitionReason") or "",
            launch_time=launch_time, private_ip=inst.get("PrivateIpAddress") or "",
            az=(inst.get("Placement") or {}).get("AvailabilityZone", ""),
            reservation_id=reservation_id, instance_type=inst.get("InstanceType", ""),
            tags={t["Key"]: t["Value"] for t in inst.get("Tags") or []})


@dataclass
class Markers:
    """What a job's nodes wrote to S3."""

    exit_codes: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    preempted: dict[int, str] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    setup_done: set[int] = field(default_factory=set)

    @property
    def any(self) -> bool:
        return bool(self.exit_codes or self.errors or self.preempted or self.aborted)


_MARKER_RE = re.compile(r"^rank-(\d+)/(exit_code|bootstrap_error|preempted|aborted|setup_done)$")
#: markers whose content matters (the rest only need to exist)
CONTENT_MARKERS = ("exit_code", "bootstrap_error")


def marker_keys(keys: Iterable[str]) -> list[tuple[str, int, str]]:
    """Relative S3 keys -> (key, rank, marker name) for the ones that are markers."""
    out = []
    for key in keys:
        match = _MARKER_RE.match(key)
        if match:
            out.append((key, int(match.group(1)), match.group(2)))
    return out


def _add_listing(objects: dict[str, str], page: Mapping[str, Any], prefix: str) -> None:
    """One ``list_objects_v2`` page into ``objects``: key relative to ``prefix`` -> ETag."""
    for obj in page.get("Contents", []):
        objects[obj["Key"][len(prefix):]] = obj.get("ETag", "")


def build_markers(found: Iterable[tuple[str, int, str]], content: Mapping[str, str]) -> Markers:
    markers = Markers()
    for key, rank, name in found:
        text = (content.get(key) or "").strip()
        if name == "exit_code":
            try:
                markers.exit_codes[rank] = int(text.split()[0]) if text else 1
            except ValueError:
                markers.errors[rank] = f"unreadable exit code {text!r}"
        elif name == "bootstrap_error":
            markers.errors[rank] = text or "node bootstrap failed"
        elif name == "preempted":
            markers.preempted[rank] = text
        elif name == "aborted":
            markers.aborted.add(rank)
        elif name == "setup_done":
            markers.setup_done.add(rank)
    return markers


def newest_reservation(instances: list[InstanceView]) -> list[InstanceView]:
    """The instances of the latest launch (a job name is launched once; be safe anyway)."""
    if not instances:
        return []
    by_res: dict[str, list[InstanceView]] = {}
    for inst in instances:
        by_res.setdefault(inst.reservation_id, []).append(inst)
    latest = max(by_res.values(), key=lambda g: max(i.launch_time or 0 for i in g))
    return sorted(latest, key=lambda i: i.rank)


def judge(num_nodes: int, spot: bool, instances: list[InstanceView], markers: Markers,
          now: float | None = None) -> JobStatus:
    """A job's state from its instances and its S3 markers (SkyPilot's rule: the program's
    exit code decides when there is one; an allocation lost without one is infra).

    Every rank's exit code 0 -> SUCCEEDED; any non-zero -> FAILED with it (lowest rank first);
    a bootstrap error -> INFRA_FAILED; a spot notice or reclaim, or an instance that stopped or
    terminated without an exit code -> PREEMPTED (spot) / INFRA_FAILED (on-demand), unless we
    terminated it (``cancelled`` tag) -> CANCELLED; no instance at all -> LOST; else
    PENDING/RUNNING.
    """
    now = time.time() if now is None else now
    spot = spot or any(i.spot for i in instances)
    started = min((i.launch_time for i in instances if i.launch_time), default=None)
    ips = [i.private_ip for i in instances if i.private_ip]
    raw = ",".join(f"{i.rank}:{i.state}" for i in instances) or "(no instances)"

    def status(state: JobState, reason: str = "", code: int | None = None) -> JobStatus:
        return JobStatus(state, reason=reason, exit_code=code, started_at=started,
                         ended_at=now if state.terminal else None, nodes=ips, raw_state=raw)

    failed = sorted((r, c) for r, c in markers.exit_codes.items() if c != 0)
    if failed:
        rank, code = failed[0]
        where = f" on rank {rank}" if num_nodes > 1 else ""
        return status(JobState.FAILED, f"exit code {code}{where}", code)
    if all(markers.exit_codes.get(r) == 0 for r in range(num_nodes)):
        return status(JobState.SUCCEEDED, "", 0)
    cancelled = any(i.tags.get(TAG_CANCELLED) for i in instances)
    if markers.errors:
        rank, text = sorted(markers.errors.items())[0]
        return status(JobState.INFRA_FAILED, f"node bootstrap failed on rank {rank}: {text}")
    lost_state = JobState.PREEMPTED if spot else JobState.INFRA_FAILED
    pending_preempt = {r: t for r, t in markers.preempted.items() if r not in markers.exit_codes}
    if pending_preempt:  # the notice came first: a later cancel does not change what happened
        rank = min(pending_preempt)
        return status(lost_state, f"spot interruption notice on rank {rank}"
                      + (f": {pending_preempt[rank]}" if pending_preempt[rank] else ""))
    if not instances:
        return status(JobState.LOST, "no instance of the job exists (never launched, or gone)")
    gone = [i for i in instances if i.state in GONE and i.rank not in markers.exit_codes]
    if gone:
        first = gone[0]
        what = first.reason or first.reason_code or first.state
        reclaimed = [i for i in gone if i.reason_code == "Server.SpotInstanceTermination"]
        if reclaimed:
            first, what = reclaimed[0], "spot instance reclaimed by EC2 " \
                f"({reclaimed[0].reason_code})"
        elif cancelled:
            return status(JobState.CANCELLED, "cancelled (instances terminated)")
        return status(lost_state, f"instance {first.instance_id} (rank {first.rank}) is "
                                  f"{first.state} without an exit code: {what}")
    if any(i.state == "pending" for i in instances) or len(instances) < num_nodes:
        return status(JobState.PENDING, f"{sum(i.state == 'running' for i in instances)} of "
                                        f"{num_nodes} instance(s) running")
    return status(JobState.RUNNING, "")


# --- misc helpers ----------------------------------------------------------------------------


def _client_error(exc: BaseException) -> tuple[str, str]:
    response = getattr(exc, "response", None) or {}
    err = response.get("Error") or {}
    return str(err.get("Code") or type(exc).__name__), str(err.get("Message") or exc)


def _is_unreachable(exc: BaseException) -> bool:
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & set(_UNREACHABLE_NAMES)) or isinstance(exc, (OSError, asyncio.TimeoutError))


def _decode_log(data: bytes) -> tuple[str, int]:
    """Decode UTF-8, keeping a trailing partial character for the next read."""
    cut = len(data)
    for i in range(1, min(4, len(data)) + 1):
        byte = data[-i]
        if byte & 0xC0 == 0x80:
            continue
        if byte & 0x80:
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
            if i < need:
                cut = len(data) - i
        break
    return data[:cut].decode("utf-8", "replace"), cut


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


# --- the backend -----------------------------------------------------------------------------


@dataclass
class RegionState:
    """One probe's view of one region."""

    region: str
    catalog: dict[str, InstanceTypeInfo]
    offered: dict[str, set[str]]  # instance type -> AZs
    spot_prices: dict[tuple[str, str], float]  # (type, az) -> USD/h
    quotas: dict[tuple[str, bool], QuotaView]
    subnet_azs: dict[str, str] | None  # az -> subnet (None: default VPC, any AZ)
    now: float


_CATALOG_CACHE: dict[tuple[str, str], tuple[float, dict[str, InstanceTypeInfo]]] = {}
_CATALOG_LOCK = threading.Lock()


class AwsBackend(Backend):
    """EC2 instances in the regions of one AWS connection."""

    name = "aws"
    conn_types = ("aws",)
    unsupported_features = {
        Feature.DOCKER_IMAGE: "not run on AWS by this backend (jobs run directly on the "
                              "instance's AMI: give an ami-... image_id, or use Kubernetes for "
                              "containers)",
        Feature.GIT_WORKDIR: "a git workdir is not cloned on AWS; use a local workdir",
        Feature.STORAGE_MOUNTS: "only local paths and s3:// sources work on AWS",
        Feature.OTHER_BUCKET_MOUNTS: "only local paths and s3:// sources work on AWS",
        Feature.VOLUMES: "volumes are Kubernetes volumes; EC2 instances here have none",
    }

    def unsupported(self, task: Task, req: ResourceRequest) -> str:
        why = super().unsupported(task, req)
        if not why and isinstance(req.image_id, str) and not req.image_id.startswith(
                ("ami-", "skypilot:")) and not req.container_image:
            why = f"image_id {req.image_id!r} is not an AMI id (ami-...)"
        return why

    def __init__(self, conn_id: str, settings: AwsSettings | None = None):
        super().__init__(conn_id)
        self._settings = settings
        self._clients: dict[tuple[str, str, int], Any] = {}
        self._lock = threading.Lock()
        self._aclients: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._alock: asyncio.Lock | None = None
        self._quota_cache: dict[tuple[str, str], tuple[float, float | None, str]] = {}
        self._marker_cache: dict[tuple[str, str], str] = {}
        self._refused: dict[tuple[str, str, str, bool], tuple[float, str]] = {}
        self._ami_cache: dict[tuple[str, str, str], tuple[str, str]] = {}

    # --- connection ---------------------------------------------------------------------------
    @property
    def settings(self) -> AwsSettings:
        if self._settings is None:
            from airflow_skypilot.compat import get_connection

            conn = get_connection(self.conn_id)
            self._settings = AwsSettings.from_extra(conn.extra_dejson or {})
        return self._settings

    @staticmethod
    def _config(attempts: int) -> Any:
        from botocore.config import Config

        # Few attempts: botocore retries HTTP 500s, and EC2 answers a capacity shortage with one.
        return Config(retries={"total_max_attempts": attempts, "mode": "standard"},
                      connect_timeout=5, read_timeout=30)

    def _hook(self, service: str, region: str, attempts: int) -> Any:
        if service == "ec2":
            from airflow.providers.amazon.aws.hooks.ec2 import EC2Hook

            return EC2Hook(aws_conn_id=self.conn_id, region_name=region, api_type="client_type",
                           config=self._config(attempts))
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

        return AwsBaseHook(aws_conn_id=self.conn_id, client_type=service, region_name=region,
                           config=self._config(attempts))

    def _client(self, service: str, region: str, attempts: int = 3) -> Any:
        """A boto3 client from the amazon provider's hook (cached per service and region)."""
        key = (service, region, attempts)
        with self._lock:
            if key not in self._clients:
                try:
                    self._clients[key] = self._hook(service, region, attempts).conn
                except Exception as exc:
                    raise BackendUnreachable(f"{self.conn_id}: cannot create the {service} "
                                             f"client for {region}: {exc}") from exc
            return self._clients[key]

    async def _aclient(self, service: str, region: str) -> Any:
        """An aiobotocore client from the hook's ``get_async_conn`` (kept open; see aclose)."""
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            if (service, region) not in self._aclients:
                ctx = await self._hook(service, region, 3).get_async_conn()
                client = await ctx.__aenter__()
                self._aclients[(service, region)] = (ctx, client)
            return self._aclients[(service, region)][1]

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                try:
                    client.close()
                except Exception:  # closing is best effort
                    pass
            self._clients.clear()

    async def aclose(self) -> None:
        clients, self._aclients = self._aclients, {}
        for ctx, _ in clients.values():
            try:
                await ctx.__aexit__(None, None, None)
            except Exception:  # a broken connection is gone either way
                pass

    def _unreachable(self, exc: BaseException, what: str) -> BackendError:
        code, message = _client_error(exc)
        if _is_unreachable(exc):
            return BackendUnreachable(f"{self.conn_id}: {what}: {type(exc).__name__}: {exc}")
        return BackendError(f"{self.conn_id}: {what}: {code}: {message}")

    # --- catalog, prices, quotas --------------------------------------------------------------
    def _catalog(self, region: str, extra_types: Iterable[str] = ()) -> dict[str, InstanceTypeInfo]:
        """GPU types, the CPU-only families and any named types of a region (cached 1 h)."""
        key = (self.conn_id, region)
        with _CATALOG_LOCK:
            cached = _CATALOG_CACHE.get(key)
        if cached is None or time.time() - cached[0] > CATALOG_TTL:
            ec2 = self._client("ec2", region)
            patterns = ["g*", "p*", "vt*"] + [f"{f}.*" for f in self.settings.cpu_families]
            raw: list[dict] = []
            try:
                for page in ec2.get_paginator("describe_instance_types").paginate(
                        Filters=[{"Name": "instance-type", "Values": patterns}]):
                    raw += page["InstanceTypes"]
            except Exception as exc:
                raise self._unreachable(exc, f"DescribeInstanceTypes in {region}") from exc
            types = {n: i for n, i in parse_instance_types(raw).items()
                     if i.gpu or i.family in self.settings.cpu_families}
            cached = (time.time(), types)
            with _CATALOG_LOCK:
                _CATALOG_CACHE[key] = cached
        catalog = dict(cached[1])
        missing = sorted({t for t in extra_types if t and t not in catalog})
        for name in missing:  # one by one: an unknown name must not hide the others
            try:
                raw = self._client("ec2", region).describe_instance_types(
                    InstanceTypes=[name])["InstanceTypes"]
            except Exception as exc:
                if _client_error(exc)[0].startswith("InvalidInstanceType"):
                    continue
                raise self._unreachable(exc, f"DescribeInstanceTypes {name} in {region}") from exc
            catalog.update(parse_instance_types(raw))
            with _CATALOG_LOCK:
                _CATALOG_CACHE[key][1].update(parse_instance_types(raw))
        return catalog

    def on_demand_price(self, region: str, info: InstanceTypeInfo,
                        catalog: Mapping[str, InstanceTypeInfo] | None = None,
                        ) -> tuple[float | None, str]:
        """The connection's ``prices``, else the shipped catalog, else an estimate from the
        catalog's per-GPU price of the same GPU (said so), else None."""
        if info.name in self.settings.prices:
            return self.settings.prices[info.name], "connection extra 'prices'"
        price, source = price_catalog().price(region, info.name)
        if price is not None or not info.gpu or not catalog:
            return price, source
        per_gpu = [p / c.gpus for n, p in price_catalog().prices.items()
                   if (c := catalog.get(n)) is not None and c.gpu == info.gpu and c.gpus >= 1]
        if per_gpu:
            return round(min(per_gpu) * info.gpus, 4), (
                f"estimated: {info.gpu} per-GPU list price x {_count_text(info.gpus)} "
                f"({info.name} is not in the shipped catalog)")
        return None, source

    def _quota(self, region: str, cls: str, spot: bool) -> tuple[float | None, str]:
        code = QUOTA_CODES.get((cls, spot))
        if code is None:
            return None, "no quota code known for this class"
        key = (region, code)
        cached = self._quota_cache.get(key)
        if cached and time.time() - cached[0] < QUOTA_TTL:
            return cached[1], cached[2]
        try:
            quota = self._client("service-quotas", region).get_service_quota(
                ServiceCode="ec2", QuotaCode=code)["Quota"]
            value: float | None = float(quota["Value"])
            note = ""
        except Exception as exc:
            if _is_unreachable(exc):
                raise self._unreachable(exc, f"Service Quotas in {region}") from exc
            value, note = None, "{}: {}".format(*_client_error(exc))
        self._quota_cache[key] = (time.time(), value, note)
        return value, note

    def _quotas(self, region: str, catalog: Mapping[str, InstanceTypeInfo],
                classes: set[tuple[str, bool]]) -> dict[tuple[str, bool], QuotaView]:
        if not classes:
            return {}
        instances = self._describe(region, [{"Name": "instance-state-name", "Values": list(ALIVE)}])
        unknown = {i.get("InstanceType", "") for i in instances} - set(catalog)
        catalog = {**catalog, **(self._catalog(region, unknown) if unknown else {})}
        used = vcpus_in_use(instances, lambda t: catalog[t].vcpus if t in catalog else None)
        out = {}
        for cls, spot in classes:
            limit, note = self._quota(region, cls, spot)
            out[(cls, spot)] = QuotaView(cls, spot, QUOTA_CODES.get((cls, spot)), limit,
                                         used.get((cls, spot), 0.0), note)
        return out

    def _describe(self, region: str, filters: list[dict]) -> list[dict]:
        """Instances matching ``filters`` (each with ``_reservation``)."""
        out = []
        try:
            pages = self._client("ec2", region).get_paginator("describe_instances").paginate(
                Filters=filters)
            for page in pages:
                for res in page.get("Reservations", []):
                    for inst in res.get("Instances", []):
                        out.append({**inst, "_reservation": res.get("ReservationId", "")})
        except Exception as exc:
            raise self._unreachable(exc, f"DescribeInstances in {region}") from exc
        return out

    def _offerings(self, region: str, types: Iterable[str]) -> dict[str, set[str]]:
        names = sorted(set(types))
        offered: dict[str, set[str]] = {}
        ec2 = self._client("ec2", region)
        try:
            for chunk in _chunks(names, 100):
                for page in ec2.get_paginator("describe_instance_type_offerings").paginate(
                        LocationType="availability-zone",
                        Filters=[{"Name": "instance-type", "Values": chunk}]):
                    for item in page["InstanceTypeOfferings"]:
                        offered.setdefault(item["InstanceType"], set()).add(item["Location"])
        except Exception as exc:
            raise self._unreachable(exc, f"DescribeInstanceTypeOfferings in {region}") from exc
        return offered

    def _spot_prices(self, region: str, types: Iterable[str]) -> dict[tuple[str, str], float]:
        names = sorted(set(types))
        latest: dict[tuple[str, str], tuple[datetime, float]] = {}
        ec2 = self._client("ec2", region)
        try:
            for chunk in _chunks(names, 100):
                for page in ec2.get_paginator("describe_spot_price_history").paginate(
                        InstanceTypes=chunk, ProductDescriptions=["Linux/UNIX"],
                        StartTime=datetime.now(timezone.utc)):
                    for item in page["SpotPriceHistory"]:
                        if not item.get("ProductDescription", "").startswith("Linux/UNIX"):
                            continue
                        key = (item["InstanceType"], item["AvailabilityZone"])
                        stamp = item.get("Timestamp") or datetime.min.replace(tzinfo=timezone.utc)
                        if key not in latest or stamp > latest[key][0]:
                            latest[key] = (stamp, float(item["SpotPrice"]))
        except Exception as exc:
            raise self._unreachable(exc, f"DescribeSpotPriceHistory in {region}") from exc
        return {k: v[1] for k, v in latest.items()}

    def _subnet_azs(self, region: str) -> dict[str, str] | None:
        subnets = self.settings.pick(self.settings.subnet_id, region)
        if not subnets:
            return None
        try:
            found = self._client("ec2", region).describe_subnets(SubnetIds=list(subnets))
        except Exception as exc:
            raise self._unreachable(exc, f"DescribeSubnets in {region}") from exc
        return {s["AvailabilityZone"]: s["SubnetId"] for s in found["Subnets"]}

    # --- placement ---------------------------------------------------------------------------
    def _regions_for(self, req: ResourceRequest) -> list[str]:
        """The connection's regions the candidate's infra allows (its zone is checked later)."""
        wanted = "/".join(req.infra.split("/")[:2]) if req.infra else None
        return [r for r in self.settings.regions if fields.infra_matches(wanted, f"aws/{r}")]

    def _no_fit(self, task: Task, req: ResourceRequest, location: str, reason: str,
                now: float) -> Offer:
        region = location.split("/")[0]
        return Offer(connection=self.conn_id, backend=self.name, location=location,
                     infra=f"aws/{location}" if region in self.settings.regions else "aws",
                     request=req, num_nodes=task.num_nodes, fits=False, reason=reason,
                     accelerator=req.accelerator, gpus_per_node=req.gpus_per_node(),
                     spot=req.use_spot, probed_at=now)

    def probe(self, task: Task) -> list[Offer]:
        s = self.settings
        now = time.time()
        offers: list[Offer] = []
        wanted: dict[str, list[ResourceRequest]] = {}
        everywhere = ",".join(s.regions)
        for req in task.candidates:
            if req.cloud not in (None, "aws"):
                continue  # another cloud's candidate: not ours to explain
            regions = self._regions_for(req)
            if not regions:
                offers.append(self._no_fit(task, req, everywhere, (
                    f"infra {req.infra} names no region of connection {self.conn_id} "
                    f"({everywhere})"), now))
                continue
            if why := self.unsupported(task, req):
                offers.append(self._no_fit(task, req, everywhere, why, now))
                continue
            for region in regions:
                wanted.setdefault(region, []).append(req)
        if not wanted:
            return offers
        with ThreadPoolExecutor(max_workers=len(wanted),
                                thread_name_prefix=f"aws-probe-{self.conn_id}") as pool:
            futures = {r: pool.submit(self._probe_region, task, r, reqs, now)
                       for r, reqs in wanted.items()}
            errors = []
            for region, future in futures.items():
                try:
                    offers.extend(future.result())
                except BackendError as exc:
                    errors.append((region, exc))
        if errors and len(errors) == len(wanted):
            raise errors[0][1]
        for region, exc in errors:  # one region down: say so, keep the others
            for req in wanted[region]:
                offers.append(self._no_fit(task, req, region, f"region unreachable: {exc}", now))
        return offers

    def _probe_region(self, task: Task, region: str, reqs: list[ResourceRequest],
                      now: float) -> list[Offer]:
        s = self.settings
        catalog = self._catalog(region, [r.instance_type for r in reqs if r.instance_type])
        choices: dict[int, tuple[list[InstanceTypeInfo], str]] = {}
        for req in reqs:
            choices[req.index] = suitable_types(
                catalog, req, cpu_families=s.cpu_families,
                price_of=lambda n: self.on_demand_price(region, catalog[n], catalog)[0])
        types = {i.name for lst, _ in choices.values() for i in lst}
        offered = self._offerings(region, types) if types else {}
        spot_types = {i.name for r in reqs if r.use_spot for i in choices[r.index][0]}
        spot_prices = self._spot_prices(region, spot_types) if spot_types else {}
        classes = {(c, r.use_spot) for r in reqs for i in choices[r.index][0]
                   if (c := quota_class(i.name)) is not None}
        state = RegionState(region=region, catalog=catalog, offered=offered,
                            spot_prices=spot_prices, quotas=self._quotas(region, catalog, classes),
                            subnet_azs=self._subnet_azs(region), now=now)
        offers = []
        for req in reqs:
            offers.extend(self._offers_for(task, req, state, *choices[req.index]))
        return offers

    def _offers_for(self, task: Task, req: ResourceRequest, st: RegionState,
                    types: list[InstanceTypeInfo], why: str) -> list[Offer]:
        """The offers of one candidate in one region: one per AZ that can take it."""
        region = st.region
        if why:
            return [self._no_fit(task, req, region, why, st.now)]
        image = req.image_id
        if isinstance(image, dict) and region not in image:
            return [self._no_fit(task, req, region, f"image_id names no AMI for {region}", st.now)]
        azs = sorted({az for t in types for az in st.offered.get(t.name, ())})
        names = ", ".join(t.name for t in types[:3]) + (" ..." if len(types) > 3 else "")
        if not azs:
            return [self._no_fit(task, req, region, f"{names} not offered in {region}", st.now)]
        if st.subnet_azs is not None:
            azs = [az for az in azs if az in st.subnet_azs]
            if not azs:
                return [self._no_fit(task, req, region, (
                    f"{names} not offered in the AZs of the configured subnets "
                    f"({', '.join(sorted(st.subnet_azs))})"), st.now)]
        zoned = [az for az in azs if fields.infra_matches(req.infra, f"aws/{region}/{az}")]
        if not zoned:
            return [self._no_fit(task, req, f"{region}/{req.infra.split('/')[-1]}",
                                 f"{names} not offered in {req.infra.split('/')[-1]}", st.now)]
        return [self._offer_in(task, req, st, az, types) for az in zoned]

    def _offer_in(self, task: Task, req: ResourceRequest, st: RegionState, az: str,
                  types: list[InstanceTypeInfo]) -> Offer:
        s = self.settings
        region, n = st.region, task.num_nodes
        location = f"{region}/{az}"
        here = [t for t in types if az in st.offered.get(t.name, ())]
        chosen = None
        od_price: float | None = None
        source = ""
        spot_price: float | None = None
        problems = []
        for info in here:
            od_price, source = self.on_demand_price(region, info, st.catalog)
            spot_price = st.spot_prices.get((info.name, az))
            if req.use_spot and spot_price is None:
                problems.append(f"no spot price for {info.name} in {az} (no spot market)")
                continue
            if not req.use_spot and od_price is None:
                problems.append(f"{source} (add it to the connection's extra 'prices')")
                continue
            chosen = info
            break
        if chosen is None:
            return self._no_fit(task, req, location, "; ".join(problems) or "no instance type",
                                st.now)
        each = spot_price if req.use_spot else od_price
        assert each is not None
        offer = Offer(
            connection=self.conn_id, backend=self.name, location=location,
            infra=f"aws/{location}", request=req, num_nodes=n,
            accelerator=chosen.gpu or req.accelerator, gpus_per_node=chosen.gpus,
            price_per_hour=round(each * n, 6), spot=req.use_spot, instance_type=chosen.name,
            probed_at=st.now,
            details={"region": region, "az": az, "instance_type": chosen.name,
                     "vcpus": chosen.vcpus, "memory_gb": round(chosen.memory_gb, 1),
                     "gpus_per_instance": chosen.gpus, "gpu_memory_gb": chosen.gpu_memory_gb,
                     "on_demand_price": od_price, "spot_price": spot_price,
                     "price_source": "spot price history" if req.use_spot else source,
                     "boot_seconds": s.boot_seconds})
        if s.max_price_per_hour is not None and offer.price_per_hour > s.max_price_per_hour:
            offer.fits = False
            offer.reason = (f"${offer.price_per_hour:.4g}/h for {n} x {chosen.name} is over the "
                            f"connection's max_price_per_hour ${s.max_price_per_hour:g}")
            return offer
        need = chosen.vcpus * n
        cls = quota_class(chosen.name)
        quota = st.quotas.get((cls, req.use_spot)) if cls else None
        if quota is None or quota.limit is None:
            offer.details["quota"] = quota.describe(need) if quota else \
                f"{chosen.family} has a quota class of its own; not checked"
            offer.est_start = st.now + s.boot_seconds  # unknown room: expect a normal launch
            return offer
        offer.details.update({"quota": quota.describe(need), "quota_code": quota.code,
                              "quota_vcpus": quota.limit, "quota_used_vcpus": quota.used})
        if quota.limit < need:
            offer.fits = False
            offer.reason = (f"needs {need:g} vCPUs of the {quota.label} quota ({quota.code}); "
                            f"the quota is {quota.limit:g}")
            return offer
        free, total = quota.nodes(chosen.vcpus)
        offer.nodes_free, offer.nodes_total = free, total
        if chosen.gpus:
            offer.gpus_free = int((free or 0) * chosen.gpus)
            offer.gpus_total = int((total or 0) * chosen.gpus)
        if (free or 0) >= n:
            offer.est_start = st.now + s.boot_seconds
        else:  # fits the quota, not now: others' instances hold it; no ETA
            offer.reason = quota.describe(need)
        return offer

    def capacity(self) -> list[CapacityRow]:
        rows: list[CapacityRow] = []
        with ThreadPoolExecutor(max_workers=len(self.settings.regions)) as pool:
            futures = {r: pool.submit(self._capacity_region, r) for r in self.settings.regions}
            for region, future in futures.items():
                try:
                    rows.extend(future.result())
                except BackendError as exc:
                    rows.append(CapacityRow(connection=self.conn_id, location=region,
                                            accelerator=None, error=str(exc)))
        if rows and all(r.error for r in rows):
            raise BackendUnreachable(rows[0].error or "unreachable")
        return rows

    def _capacity_region(self, region: str) -> list[CapacityRow]:
        """Rows per (AZ, accelerator): GPUs startable under the region's vCPU quota now
        (the most GPU-dense offered type decides), on-demand price of the smallest type."""
        catalog = self._catalog(region)
        gpu_types = {n: i for n, i in catalog.items() if i.gpu}
        offered = self._offerings(region, gpu_types)
        spot = self._spot_prices(region, gpu_types)
        classes = {(c, s) for n in gpu_types if (c := quota_class(n)) for s in (False, True)}
        quotas = self._quotas(region, catalog, classes)
        subnet_azs = self._subnet_azs(region)
        by_az: dict[tuple[str, str], list[InstanceTypeInfo]] = {}
        for name, azs in offered.items():
            for az in azs:
                if subnet_azs is None or az in subnet_azs:
                    by_az.setdefault((az, gpu_types[name].gpu or ""), []).append(gpu_types[name])
        rows = []
        for (az, gpu), infos in sorted(by_az.items()):
            def startable(spot_kind: bool, infos: list[InstanceTypeInfo] = infos) -> int | None:
                best: int | None = None
                for info in infos:
                    cls = quota_class(info.name)
                    quota = quotas.get((cls, spot_kind)) if cls else None
                    free, _ = quota.nodes(info.vcpus) if quota else (None, None)
                    if free is not None:
                        best = max(best or 0, int(free * info.gpus))
                return best

            priced = sorted(infos, key=lambda i: (
                i.gpus < 1, i.gpus, self.on_demand_price(region, i, catalog)[0] or math.inf))
            small = priced[0]
            price, source = self.on_demand_price(region, small, catalog)
            rows.append(CapacityRow(
                connection=self.conn_id, location=f"{region}/{az}", accelerator=gpu,
                total=None, free=startable(False), pending=None, price_per_hour=price,
                details={
                    "price_basis": f"on-demand, per instance-hour of {small.name} "
                                   f"({_count_text(small.gpus)} x {gpu}); {source}",
                    "instance_type": small.name, "gpus_per_instance": small.gpus,
                    "spot_price_per_hour": spot.get((small.name, az)),
                    "free_spot": startable(True),
                    "free_basis": "GPUs startable now under the region's vCPU quotas (shared "
                                  "by its AZs), on the most GPU-dense offered type",
                    "instance_types": sorted(i.name for i in infos),
                }))
        return rows

    # --- jobs --------------------------------------------------------------------------------
    def _job_prefix(self, job_name: str) -> str:
        return f"{self.settings.s3_prefix}{job_name}/"

    def _ssm_path(self, job_name: str) -> str:
        return f"{self.settings.ssm_prefix}/{job_name}"

    def _region_of(self, handle: JobHandle) -> str:
        return handle.extra.get("region") or handle.location.split("/")[0]

    def find(self, job_name: str) -> JobHandle | None:
        stored = self._stored_handle(job_name)
        if stored is not None:
            return stored
        for region in self.settings.regions:
            found = [InstanceView.from_api(i, i["_reservation"]) for i in self._describe(
                region, [{"Name": f"tag:{TAG_JOB}", "Values": [job_name]}])]
            if found:
                return self._handle_from_instances(job_name, region, newest_reservation(found))
        return None

    def _stored_handle(self, job_name: str) -> JobHandle | None:
        s = self.settings
        if not s.s3_bucket:
            return None
        s3 = self._client("s3", s.regions[0])
        try:
            body = s3.get_object(Bucket=s.s3_bucket, Key=self._job_prefix(job_name)
                                 + "handle.json")["Body"].read()
        except Exception as exc:
            code, _ = _client_error(exc)
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._unreachable(exc, f"reading s3://{s.s3_bucket}/"
                                         f"{self._job_prefix(job_name)}handle.json") from exc
        handle = JobHandle.from_dict(json.loads(body))
        handle.adopted = True
        return handle

    def _handle_from_instances(self, job_name: str, region: str,
                               insts: list[InstanceView]) -> JobHandle:
        first = insts[0]
        try:
            meta = json.loads(first.tags.get(TAG_META) or "{}")
        except ValueError:
            meta = {}
        location = f"{region}/{first.az}"
        return JobHandle(
            backend=self.name, connection=self.conn_id, job_id=job_name, job_name=job_name,
            location=location, infra=f"aws/{location}", num_nodes=int(meta.get("n", len(insts))),
            accelerator=meta.get("acc") or None, gpus_per_node=float(meta.get("gpn", 0)),
            price_per_hour=float(meta.get("pph", 0.0)),
            submitted_at=float(meta.get("t", first.launch_time or time.time())), adopted=True,
            extra=self._extra(job_name, region, first.az, first.instance_type,
                              [i.instance_id for i in insts], first.reservation_id,
                              bool(meta.get("spot", first.spot))))

    def _extra(self, job_name: str, region: str, az: str, instance_type: str,
               instance_ids: list[str], reservation_id: str, spot: bool) -> dict[str, Any]:
        s = self.settings
        return {"region": region, "az": az, "instance_type": instance_type,
                "instance_ids": instance_ids, "reservation_id": reservation_id, "spot": spot,
                "bucket": s.s3_bucket, "prefix": self._job_prefix(job_name),
                "log": f"s3://{s.s3_bucket}/{self._job_prefix(job_name)}rank-0/log",
                "ssm_path": self._ssm_path(job_name)}

    def submit(self, task: Task, offer: Offer, job_name: str,
               env: Mapping[str, str]) -> JobHandle:
        s = self.settings
        existing = self.find(job_name)
        if existing is not None:
            log.info("Adopting AWS job %s on %s: its instances were launched before (%s)",
                     job_name, self.conn_id, ", ".join(existing.extra.get("instance_ids", [])))
            return existing
        req = offer.request
        if why := self.unsupported(task, req):
            raise SubmissionError(why, retry_elsewhere=True)
        if not s.s3_bucket:
            raise SubmissionError(f"connection {self.conn_id} has no s3_bucket extra (needed for "
                                  "job logs and exit codes)", retry_elsewhere=True)
        region = offer.details.get("region") or offer.location.split("/")[0]
        first_az = offer.details.get("az") or offer.location.split("/")[-1]
        itype = offer.instance_type or offer.details.get("instance_type")
        if not itype:
            raise SubmissionError(f"offer {offer.place_key} names no instance type",
                                  retry_elsewhere=True)
        catalog = self._catalog(region, [itype])
        info = catalog.get(itype)
        if info is None:
            raise SubmissionError(f"unknown instance type {itype} in {region}")
        spot = req.use_spot
        self._check_quota(region, info, spot, task.num_nodes, catalog)
        azs = self._launch_azs(region, itype, first_az)
        fresh = [az for az in azs if not self._recently_refused(region, az, itype, spot)]
        if not fresh:
            raise SubmissionError(
                f"EC2 refused {itype}{' (spot)' if spot else ''} in every AZ of {region} within "
                f"the last {REFUSED_TTL:g}s: " + "; ".join(
                    self._refused[(region, az, itype, spot)][1] for az in azs),
                retry_elsewhere=True)
        ami, root_device = self._ami(region, info, req)
        prefix = self._job_prefix(job_name)
        uri = f"s3://{s.s3_bucket}/{prefix}"
        gpus_env = jobscript.gpus_per_node(req.accelerator_count) if req.accelerator \
            else int(info.gpus)
        node_env = jobscript.skypilot_env(
            task, task_id=env.get("SKYPILOT_TASK_ID", job_name), num_gpus_per_node=gpus_env,
            cluster_info={"cluster_name": job_name, "cloud": "AWS", "region": region,
                          "zone": first_az, "instance_type": itype}, extra=env)
        payload = userdata.render_payload(task, node_env)
        boot = userdata.Bootstrap(
            job_name=job_name, region=region, s3_job_uri=uri, num_nodes=task.num_nodes,
            spot=spot, tag_key=TAG_JOB,
            secret_params=[f"{self._ssm_path(job_name)}/{k}" for k in sorted(task.secrets)],
            payload_b64=payload.b64, log_interval=s.log_interval,
            spot_interval=s.spot_check_interval)
        script = userdata.render_user_data(boot)
        staged = False
        try:
            if userdata.user_data_size(script) > userdata.USER_DATA_BUDGET:
                self._s3_put(prefix + "payload.tgz", payload.data)
                staged = True
                boot.payload_b64, boot.payload_uri = None, f"{uri}payload.tgz"
                script = userdata.render_user_data(boot)
            self._put_secrets(region, job_name, task.secrets)
            meta = {"n": task.num_nodes, "acc": req.accelerator or "",
                    "gpn": req.accelerator_count if req.accelerator else 0,
                    "pph": offer.price_per_hour, "spot": int(spot), "t": round(time.time(), 3)}
            params = self._launch_params(task, req, job_name, info, ami, root_device, script,
                                         meta)
            reservation, az = self._launch(region, itype, spot, fresh, params, task.num_nodes)
        except BaseException:
            try:
                self._delete_secrets(region, job_name)
            except BackendError as exc:  # keep the launch error; this one is only logged
                log.warning("Could not delete the secrets of %s: %s", job_name, exc)
            if staged:
                self._s3_delete(prefix + "payload.tgz")
            raise
        instances = sorted(reservation["Instances"], key=lambda i: i.get("AmiLaunchIndex", 0))
        location = f"{region}/{az}"
        handle = JobHandle(
            backend=self.name, connection=self.conn_id, job_id=job_name, job_name=job_name,
            location=location, infra=f"aws/{location}", num_nodes=task.num_nodes,
            accelerator=req.accelerator, gpus_per_node=req.accelerator_count if req.accelerator
            else 0, price_per_hour=offer.price_per_hour, submitted_at=meta["t"],
            extra=self._extra(job_name, region, az, itype, [i["InstanceId"] for i in instances],
                              reservation.get("ReservationId", ""), spot))
        handle.extra["payload_staged"] = staged
        try:
            self._s3_put(prefix + "handle.json", json.dumps(handle.to_dict()).encode())
        except BackendError as exc:  # find() falls back to the instance tags
            log.warning("Could not store the handle of %s in S3: %s", job_name, exc)
        log.info("Launched %d x %s%s for %s in %s (%s)", task.num_nodes, itype,
                 " (spot)" if spot else "", job_name, location,
                 ", ".join(handle.extra["instance_ids"]))
        return handle

    def _check_quota(self, region: str, info: InstanceTypeInfo, spot: bool, n: int,
                     catalog: Mapping[str, InstanceTypeInfo]) -> None:
        """Refuse a launch the account's vCPU quota cannot hold now (EC2 would refuse it too,
        with VcpuLimitExceeded; checking first keeps the answer the same everywhere)."""
        cls = quota_class(info.name)
        if cls is None:
            return
        quota = self._quotas(region, catalog, {(cls, spot)})[(cls, spot)]
        need = info.vcpus * n
        if quota.limit is not None and (quota.room or 0) < need:
            raise SubmissionError(f"{region}: {quota.describe(need)}", retry_elsewhere=True)

    def _launch_azs(self, region: str, itype: str, first: str) -> list[str]:
        azs = sorted(self._offerings(region, [itype]).get(itype, set()))
        subnets = self._subnet_azs(region)
        if subnets is not None:
            azs = [az for az in azs if az in subnets]
        return [first] + [az for az in azs if az != first]

    def _recently_refused(self, region: str, az: str, itype: str, spot: bool) -> bool:
        seen = self._refused.get((region, az, itype, spot))
        return seen is not None and time.time() - seen[0] < REFUSED_TTL

    def _launch_params(self, task: Task, req: ResourceRequest, job_name: str,
                       info: InstanceTypeInfo, ami: str, root_device: str, script: str,
                       meta: Mapping[str, Any]) -> dict[str, Any]:
        s = self.settings
        tags = {**s.tags, **{str(k): str(v) for k, v in req.labels.items()},
                "Name": job_name, TAG_JOB: job_name, TAG_CONN: self.conn_id,
                TAG_META: json.dumps(meta, separators=(",", ":"))}
        tag_list = [{"Key": k, "Value": v[:256]} for k, v in tags.items()]
        params: dict[str, Any] = {
            "ImageId": ami, "InstanceType": info.name, "MinCount": task.num_nodes,
            "MaxCount": task.num_nodes, "UserData": script,
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                                "HttpPutResponseHopLimit": 2},
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tag_list},
                                  {"ResourceType": "volume", "Tags": tag_list}],
        }
        if req.use_spot:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time",
                                "InstanceInterruptionBehavior": "terminate"}}
        if req.disk_size:  # the root volume (SkyPilot's disk_size); disk_tier is not mapped
            params["BlockDeviceMappings"] = [{"DeviceName": root_device, "Ebs": {
                "VolumeSize": int(req.disk_size), "VolumeType": "gp3",
                "DeleteOnTermination": True}}]
        if s.key_name:
            params["KeyName"] = s.key_name
        return params

    def _region_params(self, region: str, az: str, subnets: dict[str, str] | None) -> dict:
        s = self.settings
        out: dict[str, Any] = {}
        groups = s.pick(s.security_group_ids, region)
        if subnets is not None:
            out["SubnetId"] = subnets[az]
        else:
            out["Placement"] = {"AvailabilityZone": az}
        if groups:
            out["SecurityGroupIds"] = list(groups)
        profile = s.pick(s.instance_profile, region)
        if profile:
            out["IamInstanceProfile"] = {"Arn": profile} if profile.startswith("arn:") \
                else {"Name": profile}
        return out

    def _launch(self, region: str, itype: str, spot: bool, azs: list[str],
                params: dict[str, Any], n: int) -> tuple[dict, str]:
        """RunInstances in each AZ in turn until one has capacity; every refusal is listed."""
        ec2 = self._client("ec2", region, attempts=1)
        subnets = self._subnet_azs(region)
        job = next(t["Value"] for t in params["TagSpecifications"][0]["Tags"]
                   if t["Key"] == TAG_JOB)
        attempts: list[str] = []
        for az in azs:
            # Idempotency token per (job, AZ): a request resent by the client is one launch.
            token = hashlib.sha256(f"{job}\0{az}".encode()).hexdigest()[:64]
            call = {**params, **self._region_params(region, az, subnets), "ClientToken": token}
            try:
                reservation = ec2.run_instances(**call)
            except Exception as exc:
                code, message = _client_error(exc)
                if _is_unreachable(exc):
                    raise SubmissionError(f"{self.conn_id}: RunInstances in {az} could not be "
                                          f"sent: {exc}", retry_elsewhere=True) from exc
                attempts.append(f"{az}: {code}: {message}")
                log.warning("RunInstances of %d x %s in %s refused: %s: %s", n, itype, az, code,
                            message)
                if code in CAPACITY_ERRORS:
                    self._refused[(region, az, itype, spot)] = (time.time(), attempts[-1])
                    continue
                break  # quota or a configuration error: no other AZ of the region helps
            if attempts:
                log.info("Launched in %s after: %s", az, "; ".join(attempts))
            return reservation, az
        raise SubmissionError(
            f"launch of {n} x {itype}{' (spot)' if spot else ''} in {region} failed: "
            + "; ".join(attempts), retry_elsewhere=True)

    def _ami(self, region: str, info: InstanceTypeInfo, req: ResourceRequest) -> tuple[str, str]:
        """(AMI id, root device name): the task's ami-..., the connection's, or the newest AMI
        matching ``ami_name_pattern`` for the type's architecture."""
        s = self.settings
        image = req.image_id
        if isinstance(image, dict):
            image = image.get(region)
        if isinstance(image, str) and image.startswith("ami-"):
            wanted: str | None = image
        else:
            wanted = s.pick(s.ami_id, region)
        key = (region, wanted or s.ami_name_pattern, info.arch)
        if key in self._ami_cache:
            return self._ami_cache[key]
        ec2 = self._client("ec2", region)
        try:
            if wanted:
                images = ec2.describe_images(ImageIds=[wanted])["Images"]
            else:
                images = ec2.describe_images(Owners=s.ami_owners, Filters=[
                    {"Name": "name", "Values": [s.ami_name_pattern]},
                    {"Name": "state", "Values": ["available"]},
                    {"Name": "architecture", "Values": [info.arch]}])["Images"]
        except Exception as exc:
            if _is_unreachable(exc):
                raise self._unreachable(exc, f"DescribeImages in {region}") from exc
            code, message = _client_error(exc)
            raise SubmissionError(f"AMI {wanted or s.ami_name_pattern} in {region}: {code}: "
                                  f"{message}", retry_elsewhere=True) from exc
        if not images:
            raise SubmissionError(
                f"no AMI {wanted or repr(s.ami_name_pattern)} ({info.arch}) in {region}",
                retry_elsewhere=True)
        best = max(images, key=lambda i: i.get("CreationDate") or "")
        found = (best["ImageId"], best.get("RootDeviceName") or "/dev/sda1")
        self._ami_cache[key] = found
        return found

    # --- S3 and SSM --------------------------------------------------------------------------
    def _s3(self) -> Any:
        return self._client("s3", self.settings.regions[0])

    def _s3_put(self, key: str, data: bytes) -> None:
        try:
            self._s3().put_object(Bucket=self.settings.s3_bucket, Key=key, Body=data)
        except Exception as exc:
            raise self._unreachable(exc, f"writing s3://{self.settings.s3_bucket}/{key}") from exc

    def _s3_delete(self, key: str) -> None:
        try:
            self._s3().delete_object(Bucket=self.settings.s3_bucket, Key=key)
        except Exception as exc:  # cleanup is best effort; the object holds no secret
            log.warning("Could not delete s3://%s/%s: %s", self.settings.s3_bucket, key, exc)

    def _put_secrets(self, region: str, job_name: str, secrets: Mapping[str, str]) -> None:
        """Each secret as a SecureString parameter, ``b64:<base64>`` (any bytes, even none)."""
        if not secrets:
            return
        ssm = self._client("ssm", region)
        for key in sorted(secrets):
            value = "b64:" + base64.b64encode(str(secrets[key]).encode()).decode()
            try:
                ssm.put_parameter(
                    Name=f"{self._ssm_path(job_name)}/{key}", Value=value, Type="SecureString",
                    Overwrite=True, Tier="Standard" if len(value) <= 4096 else "Advanced",
                    Description=f"airflow-skypilot secret of job {job_name}; deleted when the "
                                "job ends")
            except Exception as exc:
                code, message = _client_error(exc)  # never the value: only the name
                raise SubmissionError(f"storing secret {key} in SSM ({region}) failed: "
                                      f"{code}: {message}", retry_elsewhere=True) from exc

    def _delete_secrets(self, region: str, job_name: str) -> int:
        """Delete every parameter under the job's SSM path; returns how many."""
        ssm = self._client("ssm", region)
        try:
            names = [p["Name"] for page in ssm.get_paginator("get_parameters_by_path").paginate(
                Path=self._ssm_path(job_name), Recursive=True, WithDecryption=False)
                for p in page["Parameters"]]
            for chunk in _chunks(names, 10):
                ssm.delete_parameters(Names=chunk)
        except Exception as exc:
            raise self._unreachable(exc, f"deleting the SSM parameters of {job_name}") from exc
        return len(names)

    # --- cancel / cleanup --------------------------------------------------------------------
    def _terminate(self, handle: JobHandle, cancelled: bool) -> list[str]:
        region = self._region_of(handle)
        found = self._describe(region, [{"Name": f"tag:{TAG_JOB}", "Values": [handle.job_name]}])
        alive = sorted({i["InstanceId"] for i in found
                        if (i.get("State") or {}).get("Name") not in ("terminated",
                                                                     "shutting-down")})
        known = {i["InstanceId"] for i in found}
        alive += [i for i in handle.extra.get("instance_ids", []) if i not in known]
        if not alive:
            return []
        ec2 = self._client("ec2", region)
        if cancelled:
            try:
                ec2.create_tags(Resources=alive, Tags=[{"Key": TAG_CANCELLED, "Value": "1"}])
            except Exception as exc:  # the tag only makes the status say "cancelled"
                log.debug("Could not tag %s cancelled: %s", alive, exc)
        try:
            ec2.terminate_instances(InstanceIds=alive)
        except Exception as exc:
            code, _ = _client_error(exc)
            if not code.startswith("InvalidInstanceID"):
                raise self._unreachable(exc, f"terminating {', '.join(alive)}") from exc
            for iid in alive:  # one unknown id fails the call: terminate the rest one by one
                try:
                    ec2.terminate_instances(InstanceIds=[iid])
                except Exception as one:
                    if not _client_error(one)[0].startswith("InvalidInstanceID"):
                        raise self._unreachable(one, f"terminating {iid}") from one
        return alive

    def cancel(self, handle: JobHandle) -> None:
        ids = self._terminate(handle, cancelled=True)
        self._forget(handle)
        log.info("Cancelled AWS job %s on %s%s", handle.job_name, self.conn_id,
                 f": terminated {', '.join(ids)}" if ids else " (no instance was left)")

    def cleanup(self, handle: JobHandle) -> None:
        ids = self._terminate(handle, cancelled=False)
        if ids:
            log.info("Terminated instances left by %s: %s", handle.job_name, ", ".join(ids))
        self._forget(handle)

    def _forget(self, handle: JobHandle) -> None:
        self._delete_secrets(self._region_of(handle), handle.job_name)
        if handle.extra.get("payload_staged") and self.settings.s3_bucket:
            self._s3_delete(self._job_prefix(handle.job_name) + "payload.tgz")

    # --- status ------------------------------------------------------------------------------
    @staticmethod
    def _group(handles: list[JobHandle], region_of: Callable[[JobHandle], str],
               ) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for h in handles:
            groups.setdefault(region_of(h), []).append(h.job_name)
        return groups

    @staticmethod
    def _by_job(raw: Iterable[dict]) -> dict[str, list[InstanceView]]:
        out: dict[str, list[InstanceView]] = {}
        for inst in raw:
            view = InstanceView.from_api(inst, inst.get("_reservation", ""))
            name = view.tags.get(TAG_JOB)
            if name:
                out.setdefault(name, []).append(view)
        return out

    @staticmethod
    def _needs_markers(handle: JobHandle, insts: list[InstanceView]) -> bool:
        return not insts or any(i.state != "pending" for i in insts)

    def _judge(self, handle: JobHandle, insts: list[InstanceView], markers: Markers) -> JobStatus:
        res = handle.extra.get("reservation_id")
        mine = [i for i in insts if i.reservation_id == res] if res else []
        return judge(handle.num_nodes, bool(handle.extra.get("spot")),
                     mine or newest_reservation(insts), markers)

    def _bucket_of(self, handle: JobHandle) -> tuple[str, str]:
        return (handle.extra.get("bucket") or self.settings.s3_bucket or "",
                handle.extra.get("prefix") or self._job_prefix(handle.job_name))

    async def poll(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """One DescribeInstances per region for all ``handles``, then the S3 markers of the
        jobs with a started instance (one listing each, concurrently)."""
        if not handles:
            return {}
        groups = self._group(handles, self._region_of)
        try:
            pages = await asyncio.gather(*(self._adescribe(region, names)
                                           for region, names in groups.items()))
            instances = self._by_job(i for page in pages for i in page)
            sem = asyncio.Semaphore(16)

            async def markers_of(h: JobHandle) -> Markers:
                if not self._needs_markers(h, instances.get(h.job_name, [])):
                    return Markers()
                async with sem:
                    return await self._amarkers(h)

            found = await asyncio.gather(*(markers_of(h) for h in handles))
        except BackendError:
            raise
        except Exception as exc:
            raise self._unreachable(exc, "status poll") from exc
        return {h.job_id: self._judge(h, instances.get(h.job_name, []), m)
                for h, m in zip(handles, found, strict=True)}

    def status(self, handles: list[JobHandle]) -> dict[str, JobStatus]:
        """The same as :meth:`poll`, with boto3 from the worker."""
        if not handles:
            return {}
        raw = []
        for region, names in self._group(handles, self._region_of).items():
            for chunk in _chunks(sorted(set(names)), 200):
                raw += self._describe(region, [{"Name": f"tag:{TAG_JOB}", "Values": chunk}])
        instances = self._by_job(raw)
        out = {}
        for h in handles:
            insts = instances.get(h.job_name, [])
            markers = self._markers(h) if self._needs_markers(h, insts) else Markers()
            out[h.job_id] = self._judge(h, insts, markers)
        return out

    async def _adescribe(self, region: str, names: list[str]) -> list[dict]:
        ec2 = await self._aclient("ec2", region)
        out = []
        for chunk in _chunks(sorted(set(names)), 200):
            paginator = ec2.get_paginator("describe_instances")
            async for page in paginator.paginate(
                    Filters=[{"Name": f"tag:{TAG_JOB}", "Values": chunk}]):
                for res in page.get("Reservations", []):
                    for inst in res.get("Instances", []):
                        out.append({**inst, "_reservation": res.get("ReservationId", "")})
        return out

    async def _amarkers(self, handle: JobHandle) -> Markers:
        bucket, prefix = self._bucket_of(handle)
        if not bucket:
            return Markers()
        s3 = await self._aclient("s3", self.settings.regions[0])
        objects: dict[str, str] = {}
        async for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                       Prefix=prefix):
            _add_listing(objects, page, prefix)
        found, wanted = self._content_markers(bucket, prefix, objects)
        for key, cache_key in wanted.items():
            if cache_key not in self._marker_cache:
                resp = await s3.get_object(Bucket=bucket, Key=prefix + key)
                async with resp["Body"] as stream:
                    self._marker_cache[cache_key] = (await stream.read()).decode("utf-8",
                                                                                  "replace")
        return build_markers(found, {k: self._marker_cache[c] for k, c in wanted.items()})

    def _markers(self, handle: JobHandle) -> Markers:
        bucket, prefix = self._bucket_of(handle)
        if not bucket:
            return Markers()
        s3 = self._s3()
        objects: dict[str, str] = {}
        try:
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                     Prefix=prefix):
                _add_listing(objects, page, prefix)
            found, wanted = self._content_markers(bucket, prefix, objects)
            for key, cache_key in wanted.items():
                if cache_key not in self._marker_cache:
                    body = s3.get_object(Bucket=bucket, Key=prefix + key)["Body"].read()
                    self._marker_cache[cache_key] = body.decode("utf-8", "replace")
        except Exception as exc:
            raise self._unreachable(exc, f"listing s3://{bucket}/{prefix}") from exc
        return build_markers(found, {k: self._marker_cache[c] for k, c in wanted.items()})

    @staticmethod
    def _content_markers(bucket: str, prefix: str, objects: Mapping[str, str]
                         ) -> tuple[list[tuple[str, int, str]], dict[str, tuple[str, str]]]:
        """The markers among ``objects`` (relative key -> ETag), and the cache key of each one
        whose content matters (object and ETag: each version is read once), for the sync and
        async readers alike."""
        found = marker_keys(objects)
        wanted = {key: (f"{bucket}/{prefix}{key}", objects[key])
                  for key, _, name in found if name in CONTENT_MARKERS}
        return found, wanted

    # --- logs --------------------------------------------------------------------------------
    def _log_key(self, handle: JobHandle) -> tuple[str, str]:
        bucket, prefix = self._bucket_of(handle)
        return bucket, f"{prefix}rank-0/log"

    def read_log(self, handle: JobHandle, offset: int = 0,
                 limit: int = 1 << 20) -> tuple[str, int]:
        """Rank 0's log from byte ``offset`` (an S3 range read)."""
        bucket, key = self._log_key(handle)
        if not bucket:
            return "", offset
        try:
            resp = self._s3().get_object(Bucket=bucket, Key=key,
                                         Range=f"bytes={offset}-{offset + limit - 1}")
            data = resp["Body"].read()
        except Exception as exc:
            if _client_error(exc)[0] in ("NoSuchKey", "InvalidRange", "416", "404"):
                return "", offset
            raise self._unreachable(exc, f"reading s3://{bucket}/{key}") from exc
        text, used = _decode_log(data)
        return text, offset + used

    async def read_log_async(self, handle: JobHandle, offset: int = 0,
                             limit: int = 1 << 20) -> tuple[str, int]:
        bucket, key = self._log_key(handle)
        if not bucket:
            return "", offset
        s3 = await self._aclient("s3", self.settings.regions[0])
        try:
            resp = await s3.get_object(Bucket=bucket, Key=key,
                                       Range=f"bytes={offset}-{offset + limit - 1}")
            async with resp["Body"] as stream:
                data = await stream.read()
        except Exception as exc:
            if _client_error(exc)[0] in ("NoSuchKey", "InvalidRange", "416", "404"):
                return "", offset
            raise self._unreachable(exc, f"reading s3://{bucket}/{key}") from exc
        text, used = _decode_log(data)
        return text, offset + used


__all__ = ["AwsBackend", "AwsSettings", "InstanceTypeInfo", "Markers", "QuotaView", "judge",
           "parse_instance_types", "price_catalog", "quota_class", "suitable_types"]
