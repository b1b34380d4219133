"""What EC2 can offer: instance types, their GPUs and prices, and which suit a candidate.

The "clouds" side of the backend, as SkyPilot's AWS catalog. A region's instance types come
from ``DescribeInstanceTypes`` (the GPU families, the CPU-only families of the connection and
any type a task names), cached for an hour per connection and region; GpuInfo names become
SkyPilot's accelerator names (the GPU memory tells A100 from A100-80GB). On-demand prices are
the connection's ``prices`` extra, else the list prices shipped in ``data/aws_prices.json``
(source and date inside), else an estimate from the same GPU's per-GPU list price (said so).
:func:`suitable_types` picks the types that can run one node of a candidate, best first.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from airflow_skypilot.backends.aws.clients import AwsClients, client_error
from airflow_skypilot.spec import accelerators as acc
from airflow_skypilot.spec import fields, instance_types
from airflow_skypilot.spec.task import ResourceRequest

CATALOG_TTL = 3600.0
#: SkyPilot's default for a task that names neither cpus nor memory (m6i.2xlarge on AWS)
DEFAULT_CPUS = "8+"


# --- prices ----------------------------------------------------------------------------------


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
    raw = resources.files("airflow_skypilot.backends.aws").joinpath("data/aws_prices.json")
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


def count_text(n: float) -> str:
    """A GPU or CPU count as text: ``2``, ``0.5``."""
    return str(int(n)) if float(n).is_integer() else f"{n:g}"


def _shape_problem(info: InstanceTypeInfo, req: ResourceRequest, default_cpus: bool) -> str:
    """Why ``info`` does not have the candidate's cpus/memory ("" when it does)."""
    cpus_text = req.cpus if req.cpus is not None or req.memory is not None or not default_cpus \
        else DEFAULT_CPUS
    cpus, cpus_plus = fields.split_at_least(cpus_text)
    mem, mem_plus = req.memory_needed_gb()
    if cpus is not None and (info.vcpus < cpus if cpus_plus else info.vcpus != cpus):
        return f"{'at least ' if cpus_plus else ''}{count_text(cpus)} vCPUs"
    if mem is not None and (info.memory_gb < mem - 1e-6 if mem_plus
                            else abs(info.memory_gb - mem) > 0.01):
        return f"{'at least ' if mem_plus else ''}{count_text(mem)} GB of memory"
    return ""


def gpu_matches(requested: str, info: InstanceTypeInfo) -> bool:
    if not info.gpu:
        return False
    try:
        return acc.same_accelerator(requested, info.gpu)
    except acc.AmbiguousAcceleratorError:
        return False


def is_exact(info: InstanceTypeInfo, req: ResourceRequest) -> bool:
    """Does ``info`` have exactly the GPUs the candidate asks for (SkyPilot's match)?"""
    return bool(req.accelerator) and abs(info.gpus - req.accelerator_count) < 1e-9


def suitable_types(catalog: Mapping[str, InstanceTypeInfo], req: ResourceRequest, *,
                   cpu_families: Iterable[str] = ("m6i",),
                   price_of: Callable[[str], float | None] = lambda _: None,
                   ) -> tuple[list[InstanceTypeInfo], str]:
    """The instance types that can run one node of ``req``, best first, or ([], why not).

    With ``instance_type``: exactly that type. With an accelerator: the types with exactly
    ``accelerator_count`` of it first (SkyPilot matches the count), then larger ones, fewest
    GPUs first (the offer takes a larger one only where no exact one is offered, and says
    how many GPUs it wastes); then the cheaper, then the smaller. CPU only: the
    general-purpose ``cpu_families`` (m6i by default, SkyPilot's choice; 8+ vCPUs when the
    task names neither cpus nor memory, as SkyPilot).
    """
    def order(info: InstanceTypeInfo) -> tuple[Any, ...]:
        price = price_of(info.name)
        return (not is_exact(info, req), info.gpus, math.inf if price is None else price,
                info.vcpus, info.memory_gb, info.name)

    if req.instance_type:
        info = catalog.get(req.instance_type)
        if info is None:
            return [], f"unknown EC2 instance type {req.instance_type}"
        # the accelerator the loader derived from this very type (SkyPilot's catalog: also
        # Inferentia/Trainium/FPGAs, which GpuInfo does not list) needs no second look
        carried = instance_types.accelerator_of("aws", req.instance_type)
        if req.accelerator and (req.accelerator, req.accelerator_count) != carried:
            if not gpu_matches(req.accelerator, info):
                have = f"{count_text(info.gpus)} x {info.gpu}" if info.gpu else "no GPU"
                return [], f"{info.name} has {have}, not {req.accelerator}"
            if info.gpus + 1e-9 < req.accelerator_count:
                return [], (f"{info.name} has {count_text(info.gpus)} x {info.gpu}; "
                            f"{count_text(req.accelerator_count)} requested")
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
            return [], (f"no EC2 instance type has {count_text(req.accelerator_count)} x "
                        f"{req.accelerator} (at most {count_text(most)})")
        shaped = [i for i in enough if not _shape_problem(i, req, default_cpus=False)]
        if not shaped:
            why = _shape_problem(enough[0], req, default_cpus=False)
            return [], (f"no EC2 instance type with {count_text(req.accelerator_count)} x "
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


def on_demand_price(prices: Mapping[str, float], region: str, info: InstanceTypeInfo,
                    catalog: Mapping[str, InstanceTypeInfo] | None = None,
                    ) -> tuple[float | None, str]:
    """(USD per instance-hour or None, its source): ``prices`` (the connection's extra), else
    the shipped catalog, else an estimate from the catalog's per-GPU price of the same GPU
    (said so), else None."""
    if info.name in prices:
        return prices[info.name], "connection extra 'prices'"
    price, source = price_catalog().price(region, info.name)
    if price is not None or not info.gpu or not catalog:
        return price, source
    per_gpu = [p / c.gpus for n, p in price_catalog().prices.items()
               if (c := catalog.get(n)) is not None and c.gpu == info.gpu and c.gpus >= 1]
    if per_gpu:
        return round(min(per_gpu) * info.gpus, 4), (
            f"estimated: {info.gpu} per-GPU list price x {count_text(info.gpus)} "
            f"({info.name} is not in the shipped catalog)")
    return None, source


# --- a region's catalog (DescribeInstanceTypes, cached) --------------------------------------

_CACHE: dict[tuple[str, str], tuple[float, dict[str, InstanceTypeInfo]]] = {}
_LOCK = threading.Lock()


def region_catalog(clients: AwsClients, region: str, cpu_families: Iterable[str],
                   extra_types: Iterable[str] = ()) -> dict[str, InstanceTypeInfo]:
    """GPU types, the CPU-only families and any named types of a region (cached 1 h per
    connection and region)."""
    families = list(cpu_families)
    key = (clients.conn_id, region)
    with _LOCK:
        cached = _CACHE.get(key)
    if cached is None or time.time() - cached[0] > CATALOG_TTL:
        ec2 = clients.client("ec2", region)
        patterns = ["g*", "p*", "vt*"] + [f"{f}.*" for f in families]
        raw: list[dict] = []
        try:
            for page in ec2.get_paginator("describe_instance_types").paginate(
                    Filters=[{"Name": "instance-type", "Values": patterns}]):
                raw += page["InstanceTypes"]
        except Exception as exc:
            raise clients.error(exc, f"DescribeInstanceTypes in {region}") from exc
        types = {n: i for n, i in parse_instance_types(raw).items()
                 if i.gpu or i.family in families}
        cached = (time.time(), types)
        with _LOCK:
            _CACHE[key] = cached
    catalog = dict(cached[1])
    missing = sorted({t for t in extra_types if t and t not in catalog})
    for name in missing:  # one by one: an unknown name must not hide the others
        try:
            raw = clients.client("ec2", region).describe_instance_types(
                InstanceTypes=[name])["InstanceTypes"]
        except Exception as exc:
            if client_error(exc)[0].startswith("InvalidInstanceType"):
                continue
            raise clients.error(exc, f"DescribeInstanceTypes {name} in {region}") from exc
        catalog.update(parse_instance_types(raw))
        with _LOCK:
            _CACHE[key][1].update(parse_instance_types(raw))
    return catalog
