"""A job's handle: made at launch, stored in S3, rebuilt from the instances' tags.

Submit writes the handle to ``<job prefix>handle.json``, so a retried worker finds (and adopts)
the job even after EC2 has forgotten its instances; without that object, the instances tagged
with the job's name (and their ``meta`` tag: node count, accelerator, price, spot, time) give
the handle back. ``handle.extra`` holds where the job is (region, AZ, instances, reservation)
and where its objects are (bucket, prefix, rank 0's log, the SSM path of its secrets).
"""

from __future__ import annotations

import json
import time
from typing import Any

from airflow_skypilot.backends.aws.clients import AwsClients, client_error
from airflow_skypilot.backends.aws.ec2 import TAG_META, InstanceView
from airflow_skypilot.backends.aws.settings import BACKEND, AwsSettings
from airflow_skypilot.backends.base import JobHandle

HANDLE_OBJECT = "handle.json"
#: written before RunInstances: a launch whose answer was lost may have instances EC2 does not
#: list yet; until ``launch_grace`` has passed, "none listed" is not "none"
INTENT_OBJECT = "launching.json"


def region_of(handle: JobHandle) -> str:
    return handle.extra.get("region") or handle.location.split("/")[0]


def job_objects(settings: AwsSettings, handle: JobHandle) -> tuple[str, str]:
    """(bucket, prefix) of the job's S3 objects, as the handle recorded them."""
    return (handle.extra.get("bucket") or settings.s3_bucket or "",
            handle.extra.get("prefix") or settings.job_prefix(handle.job_name))


def job_extra(settings: AwsSettings, job_name: str, region: str, az: str, instance_type: str,
              instance_ids: list[str], reservation_id: str, spot: bool) -> dict[str, Any]:
    """``handle.extra``: where the job runs and where its objects and secrets are."""
    s = settings
    prefix = s.job_prefix(job_name)
    return {"region": region, "az": az, "instance_type": instance_type,
            "instance_ids": instance_ids, "reservation_id": reservation_id, "spot": spot,
            "bucket": s.s3_bucket, "prefix": prefix,
            "log": f"s3://{s.s3_bucket}/{prefix}rank-0/log",
            "ssm_path": s.ssm_path(job_name)}


def launched_handle(conn_id: str, settings: AwsSettings, job_name: str, region: str,
                    az: str, instance_type: str, reservation: dict, meta: dict[str, Any],
                    spot: bool) -> JobHandle:
    """The handle of a job whose RunInstances returned ``reservation`` (``meta`` as tagged)."""
    instances = sorted(reservation["Instances"], key=lambda i: i.get("AmiLaunchIndex", 0))
    location = f"{region}/{az}"
    return JobHandle(
        backend=BACKEND, connection=conn_id, job_id=job_name, job_name=job_name,
        location=location, infra=f"aws/{location}", num_nodes=meta["n"],
        accelerator=meta["acc"] or None, gpus_per_node=meta["gpn"],
        price_per_hour=meta["pph"], submitted_at=meta["t"],
        extra=job_extra(settings, job_name, region, az, instance_type,
                        [i["InstanceId"] for i in instances],
                        reservation.get("ReservationId", ""), spot))


def handle_from_instances(conn_id: str, settings: AwsSettings, job_name: str, region: str,
                          insts: list[InstanceView]) -> JobHandle:
    """The handle of a job EC2 still knows, from its instances (rank order) and their tags."""
    first = insts[0]
    try:
        meta = json.loads(first.tags.get(TAG_META) or "{}")
    except ValueError:
        meta = {}
    location = f"{region}/{first.az}"
    return JobHandle(
        backend=BACKEND, connection=conn_id, job_id=job_name, job_name=job_name,
        location=location, infra=f"aws/{location}", num_nodes=int(meta.get("n", len(insts))),
        accelerator=meta.get("acc") or None, gpus_per_node=float(meta.get("gpn", 0)),
        price_per_hour=float(meta.get("pph", 0.0)),
        submitted_at=float(meta.get("t", first.launch_time or time.time())), adopted=True,
        extra=job_extra(settings, job_name, region, first.az, first.instance_type,
                        [i.instance_id for i in insts], first.reservation_id,
                        bool(meta.get("spot", first.spot))))


def stored_handle(clients: AwsClients, settings: AwsSettings, job_name: str) -> JobHandle | None:
    """The handle submit stored in S3 (adopted), or None when there is none."""
    body = _job_object(clients, settings, job_name, HANDLE_OBJECT)
    if body is None:
        return None
    handle = JobHandle.from_dict(json.loads(body))
    handle.adopted = True
    return handle


def stored_job_names(clients: AwsClients, settings: AwsSettings, prefix: str) -> list[str]:
    """The names of the jobs whose S3 folder starts with ``prefix`` (one paginated listing)."""
    s = settings
    if not s.s3_bucket:
        return []
    names: list[str] = []
    try:
        pages = clients.client("s3", s.s3_region).get_paginator("list_objects_v2").paginate(
            Bucket=s.s3_bucket, Prefix=s.job_prefix(prefix).rstrip("/"), Delimiter="/")
        for page in pages:
            for common in page.get("CommonPrefixes") or []:
                names.append(common["Prefix"][len(s.s3_prefix):].rstrip("/"))
    except Exception as exc:
        raise clients.error(exc, f"listing s3://{s.s3_bucket}/{s.job_prefix(prefix)}") from exc
    return names


def launch_intent(clients: AwsClients, settings: AwsSettings, job_name: str
                  ) -> tuple[float, str | None] | None:
    """When a launch of ``job_name`` was begun and in which region (its intent object), None
    when none was."""
    body = _job_object(clients, settings, job_name, INTENT_OBJECT)
    if body is None:
        return None
    try:
        intent = json.loads(body)
        region = intent.get("region")
        return float(intent["at"]), region if isinstance(region, str) and region else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0.0, None  # unreadable: as old as can be, region unknown


def _job_object(clients: AwsClients, settings: AwsSettings, job_name: str,
                name: str) -> bytes | None:
    """An object of the job's S3 folder (None: there is none, or no bucket)."""
    s = settings
    if not s.s3_bucket:
        return None
    key = s.job_prefix(job_name) + name
    try:
        return clients.client("s3", s.s3_region).get_object(Bucket=s.s3_bucket,
                                                            Key=key)["Body"].read()
    except Exception as exc:
        code, _ = client_error(exc)
        if code in ("NoSuchKey", "404", "NotFound"):
            return None
        raise clients.error(exc, f"reading s3://{s.s3_bucket}/{key}") from exc
