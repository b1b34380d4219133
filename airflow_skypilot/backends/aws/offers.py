"""Offers and ``show-gpus`` rows: what one region can run now, from one probe's view of it.

A probe of a region reads, once for all of a task's candidates: the catalog, which AZs offer
the suitable types, spot prices (for spot candidates), the vCPU quotas of the classes involved
and the configured subnets' AZs (:class:`RegionState`). From that, with no further call, each
candidate gets one offer per AZ that can take it: the first suitable type with a price, with
exactly the GPUs asked for (SkyPilot matches the count; with the connection's
``larger_instances``, a larger instance where no exact one is offered, its price the whole
instance's, billed, and ``details["gpus_wasted"]``: measured in benchmarks/README.md, the
larger instances cost a burst both wait and money, since they take the quota 8-GPU jobs need);
``nodes_free`` is how many such instances the quota still allows
(instances still launching count against it: ``details["reserved_by_pending"]``), so
``free_now`` means "the quota lets all ``num_nodes`` start now". A candidate that can never
run here gets one offer with ``fits=False`` and the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from airflow_skypilot.backends.aws import ec2
from airflow_skypilot.backends.aws.catalog import (
    InstanceTypeInfo,
    count_text,
    is_exact,
    on_demand_price,
    region_catalog,
    suitable_types,
)
from airflow_skypilot.backends.aws.clients import AwsClients
from airflow_skypilot.backends.aws.quotas import Quotas, QuotaView, quota_class
from airflow_skypilot.backends.aws.settings import BACKEND, AwsSettings
from airflow_skypilot.backends.base import CapacityRow, Offer
from airflow_skypilot.spec import fields
from airflow_skypilot.spec.task import ResourceRequest, Task


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


def regions_for(settings: AwsSettings, req: ResourceRequest) -> list[str]:
    """The connection's regions the candidate's infra allows (its zone is checked later)."""
    wanted = "/".join(req.infra.split("/")[:2]) if req.infra else None
    return [r for r in settings.regions if fields.infra_matches(wanted, f"aws/{r}")]


def no_fit(conn_id: str, settings: AwsSettings, task: Task, req: ResourceRequest,
           location: str, reason: str, now: float) -> Offer:
    """The offer that says candidate ``req`` cannot run at ``location``, and why."""
    region = location.split("/")[0]
    return Offer(connection=conn_id, backend=BACKEND, location=location,
                 infra=f"aws/{location}" if region in settings.regions else "aws",
                 request=req, num_nodes=task.num_nodes, fits=False, reason=reason,
                 accelerator=req.accelerator, gpus_per_node=req.gpus_per_node(),
                 spot=req.use_spot, probed_at=now)


def probe_region(clients: AwsClients, quotas: Quotas, settings: AwsSettings, task: Task,
                 region: str, reqs: list[ResourceRequest], now: float) -> list[Offer]:
    """The offers of candidates ``reqs`` in ``region``: one read of the region, then
    :func:`offers_for` each."""
    catalog = region_catalog(clients, region, settings.cpu_families,
                             [r.instance_type for r in reqs if r.instance_type])
    choices: dict[int, tuple[list[InstanceTypeInfo], str]] = {}
    for req in reqs:
        choices[req.index] = suitable_types(
            catalog, req, cpu_families=settings.cpu_families,
            price_of=lambda n: on_demand_price(settings.prices, region, catalog[n], catalog)[0])
    types = {i.name for lst, _ in choices.values() for i in lst}
    offered = ec2.offerings(clients, region, types) if types else {}
    spot_types = {i.name for r in reqs if r.use_spot for i in choices[r.index][0]}
    spot_prices = ec2.spot_prices(clients, region, spot_types) if spot_types else {}
    classes = {(c, r.use_spot) for r in reqs for i in choices[r.index][0]
               if (c := quota_class(i.name)) is not None}
    state = RegionState(
        region=region, catalog=catalog, offered=offered, spot_prices=spot_prices,
        quotas=quotas.views(region, catalog, classes, settings.cpu_families),
        subnet_azs=ec2.subnet_azs(clients, settings, region), now=now)
    offers = []
    for req in reqs:
        offers.extend(offers_for(clients.conn_id, settings, task, req, state,
                                 *choices[req.index]))
    return share_quotas(offers)


def share_quotas(offers: list[Offer]) -> list[Offer]:
    """An AZ's room is the region's vCPU quota, which its other AZs draw on too: each offer
    names the places of the same quota (code, spot or not) in ``shares_capacity_with``, so a
    launch decided moments ago in one AZ holds room in the others (``ledger.hold``)."""
    groups: dict[tuple[str, bool], set[str]] = {}
    for o in offers:
        if o.details.get("quota_code"):
            groups.setdefault((o.details["quota_code"], o.spot), set()).add(o.place_key)
    for o in offers:
        if o.details.get("quota_code"):
            same = groups[(o.details["quota_code"], o.spot)] - {o.place_key}
            o.shares_capacity_with = sorted(set(o.shares_capacity_with) | same)
    return offers


def offers_for(conn_id: str, settings: AwsSettings, task: Task, req: ResourceRequest,
               st: RegionState, types: list[InstanceTypeInfo], why: str) -> list[Offer]:
    """The offers of one candidate in one region: one per AZ that can take it."""
    region = st.region

    def nope(location: str, reason: str) -> list[Offer]:
        return [no_fit(conn_id, settings, task, req, location, reason, st.now)]

    if why:
        return nope(region, why)
    image = req.image_id
    if isinstance(image, dict) and region not in image:
        return nope(region, f"image_id names no AMI for {region}")
    def where(kinds: list[InstanceTypeInfo]) -> list[str]:
        """The AZs this candidate may use that offer one of ``kinds``."""
        return [az for az in sorted({az for t in kinds for az in st.offered.get(t.name, ())})
                if (st.subnet_azs is None or az in st.subnet_azs)
                and fields.infra_matches(req.infra, f"aws/{region}/{az}")]

    # exactly the GPUs asked for (SkyPilot's match); a larger instance only when the
    # connection allows it and no exact one is offered
    exact = [t for t in types if is_exact(t, req)]
    if req.accelerator and not req.instance_type:
        if exact and where(exact):
            types = exact
        elif not settings.larger_instances and where(types):
            return nope(region, f"no instance type with exactly {count_text(req.accelerator_count)}"
                                f" {req.accelerator} is offered in {region} (the connection's "
                                "extra larger_instances: true takes a larger one, billed whole)")
    azs = sorted({az for t in types for az in st.offered.get(t.name, ())})
    names = ", ".join(t.name for t in types[:3]) + (" ..." if len(types) > 3 else "")
    if not azs:
        return nope(region, f"{names} not offered in {region}")
    if st.subnet_azs is not None:
        azs = [az for az in azs if az in st.subnet_azs]
        if not azs:
            return nope(region, f"{names} not offered in the AZs of the configured subnets "
                                f"({', '.join(sorted(st.subnet_azs))})")
    zoned = [az for az in azs if fields.infra_matches(req.infra, f"aws/{region}/{az}")]
    if not zoned:
        zone = req.infra.split("/")[-1]
        return nope(f"{region}/{zone}", f"{names} not offered in {zone}")
    return [offer_in(conn_id, settings, task, req, st, az, types) for az in zoned]


def offer_in(conn_id: str, settings: AwsSettings, task: Task, req: ResourceRequest,
             st: RegionState, az: str, types: list[InstanceTypeInfo]) -> Offer:
    """The offer of one candidate in one AZ: its type, price, quota room and start."""
    s = settings
    region, n = st.region, task.num_nodes
    location = f"{region}/{az}"
    here = [t for t in types if az in st.offered.get(t.name, ())]
    chosen = None
    od_price: float | None = None
    source = ""
    spot_price: float | None = None
    problems = []
    for info in here:
        od_price, source = on_demand_price(s.prices, region, info, st.catalog)
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
        return no_fit(conn_id, s, task, req, location,
                      "; ".join(problems) or "no instance type", st.now)
    each = spot_price if req.use_spot else od_price
    assert each is not None
    offer = Offer(
        connection=conn_id, backend=BACKEND, location=location,
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
    if req.accelerator and chosen.gpus > req.accelerator_count + 1e-9:
        # no type with exactly the count here: the whole instance is billed, the rest idles
        idle = chosen.gpus - req.accelerator_count
        offer.details["gpus_wasted"] = round(idle * n, 3)
        offer.notes.append(
            f"{chosen.name}: {count_text(chosen.gpus)} {chosen.gpu} for "
            f"{count_text(req.accelerator_count)} asked ({count_text(idle)} idle), "
            f"${offer.price_per_hour:.3g}/h" + (f" for {n}" if n > 1 else ""))
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
    if quota.pending_instances:
        # counted in the quota's use already: the room left is what the next launch may take
        offer.details.update({"reserved_by_pending": quota.pending,
                              "pending_ours": quota.pending_ours})
        ours = f", {quota.pending_ours} of them ours" if quota.pending_ours else ""
        offer.notes.append(f"{quota.pending:g} vCPUs of the quota taken by "
                           f"{quota.pending_instances} instance(s) still launching{ours}")
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
        offer.details["estimate"] = "unknown"
        offer.notes.append(f"start unknown: {offer.reason}")
    return offer


def capacity_rows(clients: AwsClients, quotas: Quotas, settings: AwsSettings,
                  region: str) -> list[CapacityRow]:
    """``show-gpus`` rows of a region, per (AZ, accelerator): GPUs startable under the
    region's vCPU quota now (the most GPU-dense offered type decides), on-demand price of the
    smallest type."""
    catalog = region_catalog(clients, region, settings.cpu_families)
    gpu_types = {n: i for n, i in catalog.items() if i.gpu}
    offered = ec2.offerings(clients, region, gpu_types)
    spot = ec2.spot_prices(clients, region, gpu_types)
    classes = {(c, s) for n in gpu_types if (c := quota_class(n)) for s in (False, True)}
    views = quotas.views(region, catalog, classes, settings.cpu_families)
    subnet_azs = ec2.subnet_azs(clients, settings, region)
    by_az: dict[tuple[str, str], list[InstanceTypeInfo]] = {}
    for name, azs in offered.items():
        for az in azs:
            if subnet_azs is None or az in subnet_azs:
                by_az.setdefault((az, gpu_types[name].gpu or ""), []).append(gpu_types[name])

    def price(info: InstanceTypeInfo) -> tuple[float | None, str]:
        return on_demand_price(settings.prices, region, info, catalog)

    def startable(spot_kind: bool, infos: list[InstanceTypeInfo]) -> int | None:
        best: int | None = None
        for info in infos:
            cls = quota_class(info.name)
            quota = views.get((cls, spot_kind)) if cls else None
            free, _ = quota.nodes(info.vcpus) if quota else (None, None)
            if free is not None:
                best = max(best or 0, int(free * info.gpus))
        return best

    rows = []
    for (az, gpu), infos in sorted(by_az.items()):
        priced = sorted(infos, key=lambda i: (i.gpus < 1, i.gpus, price(i)[0] or math.inf))
        small = priced[0]
        small_price, source = price(small)
        rows.append(CapacityRow(
            connection=clients.conn_id, location=f"{region}/{az}", accelerator=gpu,
            total=None, free=startable(False, infos), pending=None, price_per_hour=small_price,
            details={
                "price_basis": f"on-demand, per instance-hour of {small.name} "
                               f"({count_text(small.gpus)} x {gpu}); {source}",
                "instance_type": small.name, "gpus_per_instance": small.gpus,
                "spot_price_per_hour": spot.get((small.name, az)),
                "free_spot": startable(True, infos),
                "free_basis": "GPUs startable now under the region's vCPU quotas (shared "
                              "by its AZs), on the most GPU-dense offered type",
                "instance_types": sorted(i.name for i in infos),
            }))
    return rows
