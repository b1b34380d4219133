"""What EC2 says about a region, and the tags that mark a job's instances.

Read-only calls, each one paginated request (names in chunks where the API caps them):
instances by filter or by job name (``DescribeInstances``; the async twin is the triggerer's
one request per region per poll), which AZs offer which types
(``DescribeInstanceTypeOfferings``), the latest Linux spot price per type and AZ
(``DescribeSpotPriceHistory``) and the AZs of the configured subnets. Instances come back as
:class:`InstanceView`: a job's rank is its instance's ``AmiLaunchIndex`` (one RunInstances call
numbers its instances 0..N-1).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from airflow_skypilot.backends.aws.clients import AwsClients, chunks, client_error
from airflow_skypilot.backends.aws.settings import AwsSettings

TAG_JOB = "skypilot-airflow:job-name"
TAG_META = "skypilot-airflow:meta"
TAG_CONN = "skypilot-airflow:connection"
#: set by cancel before it terminates the instances; the value is when (ISO 8601, UTC)
TAG_CANCELLED = "skypilot-airflow:cancelled"

ALIVE = ("pending", "running")
GONE = ("shutting-down", "terminated", "stopping", "stopped")
#: EC2's StateTransitionReason carries the transition's time: "User initiated (2024-05-01
#: 12:00:00 GMT)"
_TRANSITION_TIME = re.compile(r"\((\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}) ?(?:GMT|UTC|Z)?\)")


def transition_time(reason: str) -> float | None:
    """The time in an instance's ``StateTransitionReason`` (epoch seconds), if it has one."""
    match = _TRANSITION_TIME.search(reason or "")
    if not match:
        return None
    try:
        when = datetime.fromisoformat(match.group(1).replace(" ", "T"))
    except ValueError:
        return None
    return when.replace(tzinfo=timezone.utc).timestamp()


def cancelled_tag_value(now: float) -> str:
    """The :data:`TAG_CANCELLED` value: when the job was cancelled."""
    return datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="milliseconds")


def cancelled_at(value: str | None) -> float | None:
    """When a :data:`TAG_CANCELLED` value says the job was cancelled (None: it does not say,
    as tags of earlier versions, "1", do not)."""
    try:
        when = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


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
    #: when it entered its current state (from StateTransitionReason; None: not said)
    transition_time: float | None = None
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
            launch_time=launch_time,
            transition_time=transition_time(inst.get("StateTransitionReason") or ""),
            private_ip=inst.get("PrivateIpAddress") or "",
            az=(inst.get("Placement") or {}).get("AvailabilityZone", ""),
            reservation_id=reservation_id, instance_type=inst.get("InstanceType", ""),
            tags=tags_of(inst))


def tags_of(inst: Mapping[str, Any]) -> dict[str, str]:
    """A described instance's tags as a dict."""
    return {t["Key"]: t["Value"] for t in inst.get("Tags") or []}


def newest_reservation(instances: list[InstanceView]) -> list[InstanceView]:
    """The instances of the latest launch (a job name is launched once; be safe anyway)."""
    if not instances:
        return []
    by_res: dict[str, list[InstanceView]] = {}
    for inst in instances:
        by_res.setdefault(inst.reservation_id, []).append(inst)
    latest = max(by_res.values(), key=lambda g: max(i.launch_time or 0 for i in g))
    return sorted(latest, key=lambda i: i.rank)


def by_job(raw: Iterable[dict]) -> dict[str, list[InstanceView]]:
    """Described instances (with ``_reservation``) grouped by their job-name tag."""
    out: dict[str, list[InstanceView]] = {}
    for inst in raw:
        view = InstanceView.from_api(inst, inst.get("_reservation", ""))
        name = view.tags.get(TAG_JOB)
        if name:
            out.setdefault(name, []).append(view)
    return out


def of_connection(raw: Iterable[dict], conn_id: str) -> list[dict]:
    """Described instances launched through connection ``conn_id`` (or untagged): two
    connections to one account and region each see their own jobs only."""
    return [i for i in raw if tags_of(i).get(TAG_CONN, conn_id) == conn_id]


def _add_page(out: list[dict], page: Mapping[str, Any]) -> None:
    """One DescribeInstances page into ``out``: each instance with its ``_reservation``."""
    for res in page.get("Reservations", []):
        for inst in res.get("Instances", []):
            out.append({**inst, "_reservation": res.get("ReservationId", "")})


def _job_filters(names: list[str]) -> Iterable[list[dict]]:
    for chunk in chunks(sorted(set(names)), 200):
        yield [{"Name": f"tag:{TAG_JOB}", "Values": chunk}]


def describe_instances(clients: AwsClients, region: str, filters: list[dict]) -> list[dict]:
    """Instances matching ``filters`` (each with ``_reservation``)."""
    out: list[dict] = []
    try:
        pages = clients.client("ec2", region).get_paginator("describe_instances").paginate(
            Filters=filters)
        for page in pages:
            _add_page(out, page)
    except Exception as exc:
        raise clients.error(exc, f"DescribeInstances in {region}") from exc
    return out


def describe_by_ids(clients: AwsClients, region: str, ids: list[str]) -> dict[str, dict]:
    """Instance id -> the instance, for the ids of ``ids`` EC2 shows (an id it does not know,
    or not yet, is left out; any other error is raised)."""
    ec2 = clients.client("ec2", region)

    def one_call(chunk: list[str]) -> list[dict]:
        out: list[dict] = []
        for page in ec2.get_paginator("describe_instances").paginate(InstanceIds=chunk):
            _add_page(out, page)
        return out

    found: list[dict] = []
    for chunk in chunks(sorted(set(ids)), 200):
        try:
            try:
                found += one_call(chunk)
            except Exception as exc:
                if not client_error(exc)[0].startswith("InvalidInstanceID") or len(chunk) == 1:
                    raise
                for iid in chunk:  # one unknown id fails the call: ask for each alone
                    try:
                        found += one_call([iid])
                    except Exception as one:
                        if not client_error(one)[0].startswith("InvalidInstanceID"):
                            raise
        except Exception as exc:
            if client_error(exc)[0].startswith("InvalidInstanceID"):
                continue
            raise clients.error(exc, f"DescribeInstances of {', '.join(chunk)} in {region}") \
                from exc
    return {i["InstanceId"]: i for i in found}


def describe_jobs(clients: AwsClients, region: str, names: list[str]) -> list[dict]:
    """The instances of the jobs ``names`` in one region (boto3, from the worker)."""
    out: list[dict] = []
    for filters in _job_filters(names):
        out += describe_instances(clients, region, filters)
    return out


async def adescribe_jobs(clients: AwsClients, region: str, names: list[str]) -> list[dict]:
    """The same as :func:`describe_jobs` with aiobotocore (errors are the caller's)."""
    ec2 = await clients.aclient("ec2", region)
    out: list[dict] = []
    for filters in _job_filters(names):
        async for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
            _add_page(out, page)
    return out


def offerings(clients: AwsClients, region: str, types: Iterable[str]) -> dict[str, set[str]]:
    """Instance type -> the AZs of ``region`` that offer it."""
    names = sorted(set(types))
    offered: dict[str, set[str]] = {}
    ec2 = clients.client("ec2", region)
    try:
        for chunk in chunks(names, 100):
            for page in ec2.get_paginator("describe_instance_type_offerings").paginate(
                    LocationType="availability-zone",
                    Filters=[{"Name": "instance-type", "Values": chunk}]):
                for item in page["InstanceTypeOfferings"]:
                    offered.setdefault(item["InstanceType"], set()).add(item["Location"])
    except Exception as exc:
        raise clients.error(exc, f"DescribeInstanceTypeOfferings in {region}") from exc
    return offered


def spot_prices(clients: AwsClients, region: str, types: Iterable[str],
                ) -> dict[tuple[str, str], float]:
    """(instance type, AZ) -> the latest Linux/UNIX spot price (USD/h)."""
    names = sorted(set(types))
    latest: dict[tuple[str, str], tuple[datetime, float]] = {}
    ec2 = clients.client("ec2", region)
    try:
        for chunk in chunks(names, 100):
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
        raise clients.error(exc, f"DescribeSpotPriceHistory in {region}") from exc
    return {k: v[1] for k, v in latest.items()}


def subnet_azs(clients: AwsClients, settings: AwsSettings, region: str) -> dict[str, str] | None:
    """AZ -> subnet of the connection's subnets in ``region`` (None: default VPC, any AZ)."""
    subnets = settings.pick(settings.subnet_id, region)
    if not subnets:
        return None
    try:
        found = clients.client("ec2", region).describe_subnets(SubnetIds=list(subnets))
    except Exception as exc:
        raise clients.error(exc, f"DescribeSubnets in {region}") from exc
    return {s["AvailabilityZone"]: s["SubnetId"] for s in found["Subnets"]}
