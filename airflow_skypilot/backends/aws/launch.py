"""Launching a job's instances and taking them down again.

One ``RunInstances`` of ``num_nodes`` instances (so EC2 numbers them 0..N-1: the rank) in the
offer's AZ, then the region's other AZs that offer the type and that the offer's request
allows (its ``infra``; for spot, a price within its ``max_hourly_cost``) while EC2 answers
with a capacity error; a quota or configuration error stops at once (no other AZ helps). AZs
that refused a type are skipped for :data:`REFUSED_TTL` seconds. Tags name the job (and its
connection and ``meta``), so it is found, adopted and cleaned up by its name; an idempotency
token per (job, AZ) makes a resent request one launch: a request whose answer was lost is
resent with it a few times before the launch is called in doubt (:class:`LaunchInDoubt`).
The AMI is the task's ``ami-...``, the connection's, or the newest matching
``ami_name_pattern`` for the type's architecture.

Secrets go to SSM Parameter Store as SecureString parameters under ``<ssm_prefix>/<job>/``
(values ``b64:<base64>``, so any bytes survive), never into user-data; they and a staged
payload are deleted when the job is cancelled or cleaned up. Nothing here logs: what happened
is returned (refusals, errors of best-effort steps) for the backend to log.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any

from airflow_skypilot.backends.aws import userdata
from airflow_skypilot.backends.aws.catalog import InstanceTypeInfo
from airflow_skypilot.backends.aws.clients import (
    CAPACITY_ERRORS,
    AwsClients,
    chunks,
    client_error,
    is_unreachable,
)
from airflow_skypilot.backends.aws.ec2 import (
    TAG_CANCELLED,
    TAG_CONN,
    TAG_JOB,
    TAG_META,
    cancelled_tag_value,
    describe_by_ids,
    describe_instances,
    offerings,
    spot_prices,
    subnet_azs,
    tags_of,
)
from airflow_skypilot.backends.aws.quotas import Quotas, quota_class
from airflow_skypilot.backends.aws.settings import AwsSettings
from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError
from airflow_skypilot.spec import fields
from airflow_skypilot.spec.task import ResourceRequest, Task

REFUSED_TTL = 120.0
#: the job's files in S3 when they hold the user's files or do not fit in the user-data
#: (deleted by cleanup)
PAYLOAD_OBJECT = "payload.tgz"


class RefusedAzs:
    """The AZs that refused a type lately for lack of capacity (skipped for a while)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, str, bool], tuple[float, str]] = {}

    def note(self, region: str, az: str, itype: str, spot: bool, why: str) -> None:
        self._seen[(region, az, itype, spot)] = (time.time(), why)

    def recent(self, region: str, az: str, itype: str, spot: bool) -> bool:
        seen = self._seen.get((region, az, itype, spot))
        return seen is not None and time.time() - seen[0] < REFUSED_TTL

    def why(self, region: str, az: str, itype: str, spot: bool) -> str:
        return self._seen[(region, az, itype, spot)][1]


def check_quota(quotas: Quotas, settings: AwsSettings, region: str, info: InstanceTypeInfo,
                spot: bool, n: int, catalog: Mapping[str, InstanceTypeInfo]) -> None:
    """Refuse a launch the account's vCPU quota cannot hold now (EC2 would refuse it too,
    with VcpuLimitExceeded; checking first keeps the answer the same everywhere)."""
    cls = quota_class(info.name)
    if cls is None:
        return
    quota = quotas.views(region, catalog, {(cls, spot)}, settings.cpu_families)[(cls, spot)]
    need = info.vcpus * n
    if quota.limit is not None and (quota.room or 0) < need:
        raise SubmissionError(f"{region}: {quota.describe(need)}", retry_elsewhere=True)


def launch_azs(clients: AwsClients, settings: AwsSettings, region: str, itype: str,
               first: str, req: ResourceRequest) -> list[str]:
    """``first``, then the region's other AZs that offer ``itype`` (in the subnets' AZs), as
    far as the request allows them: its ``infra`` (a task pinned to one zone stays there)
    and, for spot, a spot market there within its ``max_hourly_cost``."""
    azs = sorted(offerings(clients, region, [itype]).get(itype, set()))
    subnets = subnet_azs(clients, settings, region)
    if subnets is not None:
        azs = [az for az in azs if az in subnets]
    azs = [az for az in [first] + [az for az in azs if az != first]
           if fields.infra_matches(req.infra, f"aws/{region}/{az}")]
    if req.use_spot and azs[1:]:
        try:
            prices = spot_prices(clients, region, [itype])
        except BackendError:  # the offer's own AZ was priced by the probe: it alone
            return azs[:1]
        cap = req.max_hourly_cost
        azs = azs[:1] + [az for az in azs[1:] if (price := prices.get((itype, az))) is not None
                         and (cap is None or price <= cap)]  # an instance's, as SkyPilot
    return azs


def prepare_user_data(settings: AwsSettings, task: Task, req: ResourceRequest,
                      info: InstanceTypeInfo, job_name: str, region: str, az: str,
                      env: Mapping[str, str]) -> tuple[userdata.Payload, userdata.Bootstrap]:
    """The job's payload (its files, with the SkyPilot env) and its bootstrap: the payload
    inline, or, when it carries files of the user's (:attr:`~.userdata.Payload.has_user_files`:
    they may hold credentials, and user-data can be read back), fetched from
    ``<job prefix>payload.tgz`` (``boot.payload_uri``; the caller stages it there, and also
    when the user-data would be too large)."""
    gpus_env = jobscript.gpus_per_node(req.accelerator_count) if req.accelerator \
        else int(info.gpus)
    node_env = jobscript.skypilot_env(
        task, task_id=env.get("SKYPILOT_TASK_ID", job_name), num_gpus_per_node=gpus_env,
        cluster_info={"cluster_name": job_name, "cloud": "AWS", "region": region,
                      "zone": az, "instance_type": info.name}, extra=env)
    payload = userdata.render_payload(task, node_env)
    boot = userdata.Bootstrap(
        job_name=job_name, region=region,
        s3_job_uri=f"s3://{settings.s3_bucket}/{settings.job_prefix(job_name)}",
        num_nodes=task.num_nodes, spot=req.use_spot, tag_key=TAG_JOB,
        secret_params=[f"{settings.ssm_path(job_name)}/{k}" for k in sorted(task.secrets)],
        payload_b64=payload.b64, log_interval=settings.log_interval,
        spot_interval=settings.spot_check_interval)
    if payload.has_user_files:
        boot.payload_b64 = None
        boot.payload_uri = (f"s3://{settings.s3_bucket}/{settings.job_prefix(job_name)}"
                            f"{PAYLOAD_OBJECT}")
    return payload, boot


def job_meta(task: Task, req: ResourceRequest, price_per_hour: float) -> dict[str, Any]:
    """The ``meta`` tag: what :func:`~.handles.handle_from_instances` needs back."""
    return {"n": task.num_nodes, "acc": req.accelerator or "",
            "gpn": req.accelerator_count if req.accelerator else 0,
            "pph": price_per_hour, "spot": int(req.use_spot), "t": round(time.time(), 3)}


def launch_params(settings: AwsSettings, conn_id: str, task: Task, req: ResourceRequest,
                  job_name: str, info: InstanceTypeInfo, ami: str, root_device: str,
                  script: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    """RunInstances parameters that are the same in every AZ."""
    s = settings
    tags = {**s.tags, **{str(k): str(v) for k, v in req.labels.items()},
            "Name": job_name, TAG_JOB: job_name, TAG_CONN: conn_id,
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


def region_params(settings: AwsSettings, region: str, az: str,
                  subnets: dict[str, str] | None) -> dict:
    """RunInstances parameters of one AZ: its subnet (or placement), groups, profile."""
    s = settings
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


def run_instances(clients: AwsClients, settings: AwsSettings, refused: RefusedAzs, region: str,
                  itype: str, spot: bool, azs: list[str], params: dict[str, Any],
                  ) -> tuple[dict | None, str, list[str]]:
    """RunInstances in each AZ in turn until one has capacity: (the reservation or None, its
    AZ, the refusals as ``"<az>: <code>: <message>"``). Capacity refusals are noted in
    ``refused``; any other refusal ends the walk (no other AZ of the region helps)."""
    ec2 = clients.client("ec2", region, attempts=1)
    subnets = subnet_azs(clients, settings, region)
    job = next(t["Value"] for t in params["TagSpecifications"][0]["Tags"]
               if t["Key"] == TAG_JOB)
    attempts: list[str] = []
    for az in azs:
        # Idempotency token per (job, AZ): a request resent by the client is one launch.
        token = hashlib.sha256(f"{job}\0{az}".encode()).hexdigest()[:64]
        call = {**params, **region_params(settings, region, az, subnets), "ClientToken": token}
        try:
            return _run_resent(clients, ec2, settings, az, call), az, attempts
        except LaunchInDoubt:
            raise
        except Exception as exc:
            code, message = client_error(exc)
            attempts.append(f"{az}: {code}: {message}")
            if code not in CAPACITY_ERRORS:
                break  # quota or a configuration error: no other AZ of the region helps
            refused.note(region, az, itype, spot, attempts[-1])
    return None, "", attempts


class LaunchInDoubt(BackendUnreachable):
    """RunInstances was sent and no answer came back, to any resend of it either: its
    instances may run all the same (the job's secrets and objects are kept for them)."""


#: how many times a RunInstances whose answer was lost is resent (same ClientToken), at most
RESENDS = 3


def _run_resent(clients: AwsClients, ec2: Any, settings: AwsSettings, az: str,
                call: dict[str, Any]) -> dict:
    """RunInstances; a request that got no answer (network, timeout, throttling, 5xx) is
    resent as it was, ClientToken and all, up to :data:`RESENDS` times within the
    connection's ``request_timeout``: EC2 answers a resent token with the first request's
    reservation, so a launch acted on is found again, never made twice. Raises what EC2
    refused with, or :class:`LaunchInDoubt` when no request got an answer."""
    deadline = time.monotonic() + settings.request_timeout
    pause = 0.5
    for resend in range(RESENDS + 1):
        try:
            return ec2.run_instances(**call)
        except Exception as exc:
            if not is_unreachable(exc):
                raise  # an answer: a refusal (of a request that launched nothing)
            left = deadline - time.monotonic()
            if resend == RESENDS or left <= 0:
                error = clients.error(exc, f"RunInstances in {az} got no answer, "
                                           f"{resend + 1} time(s) (the instances may have "
                                           "been launched all the same)")
                raise LaunchInDoubt(str(error)) from exc
            time.sleep(min(pause, left))
            pause *= 2
    raise AssertionError("unreachable")  # pragma: no cover


class Amis:
    """The AMI of a launch, cached per (region, AMI id or name pattern, architecture)."""

    def __init__(self, clients: AwsClients):
        self._clients = clients
        self._cache: dict[tuple[str, str, str], tuple[str, str]] = {}

    def choose(self, settings: AwsSettings, region: str, info: InstanceTypeInfo,
               req: ResourceRequest) -> tuple[str, str]:
        """(AMI id, root device name): the task's ami-..., the connection's, or the newest
        AMI matching ``ami_name_pattern`` for the type's architecture."""
        s = settings
        image = req.image_id
        if isinstance(image, dict):
            image = image.get(region)
        if isinstance(image, str) and image.startswith("ami-"):
            wanted: str | None = image
        else:
            wanted = s.pick(s.ami_id, region)
        key = (region, wanted or s.ami_name_pattern, info.arch)
        if key in self._cache:
            return self._cache[key]
        ec2 = self._clients.client("ec2", region)
        try:
            if wanted:
                images = ec2.describe_images(ImageIds=[wanted])["Images"]
            else:
                images = ec2.describe_images(Owners=s.ami_owners, Filters=[
                    {"Name": "name", "Values": [s.ami_name_pattern]},
                    {"Name": "state", "Values": ["available"]},
                    {"Name": "architecture", "Values": [info.arch]}])["Images"]
        except Exception as exc:
            if is_unreachable(exc):
                raise self._clients.error(exc, f"DescribeImages in {region}") from exc
            code, message = client_error(exc)
            raise SubmissionError(f"AMI {wanted or s.ami_name_pattern} in {region}: {code}: "
                                  f"{message}", retry_elsewhere=True) from exc
        if not images:
            raise SubmissionError(
                f"no AMI {wanted or repr(s.ami_name_pattern)} ({info.arch}) in {region}",
                retry_elsewhere=True)
        best = max(images, key=lambda i: i.get("CreationDate") or "")
        found = (best["ImageId"], best.get("RootDeviceName") or "/dev/sda1")
        self._cache[key] = found
        return found


# --- S3 objects and SSM secrets --------------------------------------------------------------


def s3_put(clients: AwsClients, settings: AwsSettings, key: str, data: bytes) -> None:
    try:
        clients.client("s3", settings.s3_region).put_object(Bucket=settings.s3_bucket, Key=key,
                                                            Body=data)
    except Exception as exc:
        raise clients.error(exc, f"writing s3://{settings.s3_bucket}/{key}") from exc


def s3_delete(clients: AwsClients, settings: AwsSettings, key: str) -> str:
    """Delete one object; best effort (it holds no secret): the error, "" when deleted."""
    try:
        clients.client("s3", settings.s3_region).delete_object(Bucket=settings.s3_bucket,
                                                               Key=key)
    except Exception as exc:
        return f"could not delete s3://{settings.s3_bucket}/{key}: {exc}"
    return ""


def put_secrets(clients: AwsClients, settings: AwsSettings, region: str, job_name: str,
                secrets: Mapping[str, str]) -> None:
    """Each secret as a SecureString parameter, ``b64:<base64>`` (any bytes, even none)."""
    if not secrets:
        return
    ssm = clients.client("ssm", region)
    for key in sorted(secrets):
        value = "b64:" + base64.b64encode(str(secrets[key]).encode()).decode()
        try:
            ssm.put_parameter(
                Name=f"{settings.ssm_path(job_name)}/{key}", Value=value, Type="SecureString",
                Overwrite=True, Tier="Standard" if len(value) <= 4096 else "Advanced",
                Description=f"airflow-skypilot secret of job {job_name}; deleted when the "
                            "job ends")
        except Exception as exc:
            code, message = client_error(exc)  # never the value: only the name
            raise SubmissionError(f"storing secret {key} in SSM ({region}) failed: "
                                  f"{code}: {message}", retry_elsewhere=True) from exc


def delete_secrets(clients: AwsClients, settings: AwsSettings, region: str,
                   job_name: str) -> int:
    """Delete every parameter under the job's SSM path; returns how many."""
    ssm = clients.client("ssm", region)
    try:
        names = [p["Name"] for page in ssm.get_paginator("get_parameters_by_path").paginate(
            Path=settings.ssm_path(job_name), Recursive=True, WithDecryption=False)
            for p in page["Parameters"]]
        for chunk in chunks(names, 10):
            ssm.delete_parameters(Names=chunk)
    except Exception as exc:
        raise clients.error(exc, f"deleting the SSM parameters of {job_name}") from exc
    return len(names)


# --- taking instances down -------------------------------------------------------------------


def _owned(inst: dict, job_name: str, conn_id: str) -> bool:
    """Do the instance's tags say it is ``job_name``'s of connection ``conn_id``?"""
    tags = tags_of(inst)
    return tags.get(TAG_JOB) == job_name and tags.get(TAG_CONN) == conn_id


def terminate(clients: AwsClients, region: str, job_name: str, conn_id: str,
              known_ids: list[str], cancelled: bool
              ) -> tuple[list[str], str, list[str], list[str], list[str]]:
    """Terminate the job's instances that are not going already: those tagged with its name
    and connection, plus ``known_ids`` (the handle's, which came from XCom or a trigger's
    kwargs) that the name filter did not list yet, once EC2 shows they carry the same tags.
    Returns (the ids terminated, why they could not be tagged cancelled or "", what was
    refused: ids whose tags are another job's or that EC2 does not show, with why; the ids
    EC2 does not show, among them; the ids of ``known_ids`` that are still up and tagged with
    the job's name but another connection: the handle's job, which this one must not touch).
    ``cancelled`` tags them first, so their status says "cancelled"."""
    found = describe_instances(clients, region, [{"Name": f"tag:{TAG_JOB}",
                                                  "Values": [job_name]}])
    listed = {i["InstanceId"] for i in found}
    refused: list[str] = []
    others = sorted(set(known_ids) - listed)
    unseen: list[str] = []
    shown: dict[str, dict] = {}
    if others:  # the handle names them: check them by id before anything is done to them
        shown = describe_by_ids(clients, region, others)
        for iid in others:
            if iid not in shown:
                unseen.append(iid)
                refused.append(f"{iid}: not shown by EC2 (yet)")
            elif not _owned(shown[iid], job_name, conn_id):
                refused.append(f"{iid}: its tags are not job {job_name}'s on {conn_id}")
            else:
                found.append(shown[iid])
    alive = sorted({i["InstanceId"] for i in found if _owned(i, job_name, conn_id)
                    and (i.get("State") or {}).get("Name") not in ("terminated",
                                                                   "shutting-down")})
    refused += [f"{i['InstanceId']}: tagged {job_name} but of another connection"
                for i in found if i["InstanceId"] in listed and not _owned(i, job_name, conn_id)]
    described = found + [shown[iid] for iid in others if iid in shown]
    foreign = sorted(
        {i["InstanceId"] for i in described if i["InstanceId"] in known_ids
        and tags_of(i).get(TAG_JOB) == job_name
        and not _owned(i, job_name, conn_id)
        and (i.get("State") or {}).get("Name") not in ("terminated", "shutting-down")})
    if not alive:
        return [], "", refused, unseen, foreign
    ec2 = clients.client("ec2", region)
    untagged = ""
    if cancelled:
        try:
            ec2.create_tags(Resources=alive, Tags=[{"Key": TAG_CANCELLED,
                                                    "Value": cancelled_tag_value(time.time())}])
        except Exception as exc:  # the tag only makes the status say "cancelled"
            untagged = str(exc)
    try:
        ec2.terminate_instances(InstanceIds=alive)
    except Exception as exc:
        code, _ = client_error(exc)
        if not code.startswith("InvalidInstanceID"):
            raise clients.error(exc, f"terminating {', '.join(alive)}") from exc
        for iid in alive:  # one unknown id fails the call: terminate the rest one by one
            try:
                ec2.terminate_instances(InstanceIds=[iid])
            except Exception as one:
                if not client_error(one)[0].startswith("InvalidInstanceID"):
                    raise clients.error(one, f"terminating {iid}") from one
    return alive, untagged, refused, unseen, foreign
