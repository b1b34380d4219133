"""A job's state, from its instances and the markers its nodes wrote to S3.

Each node writes under ``<job prefix>rank-<r>/``: ``exit_code`` (the program's), ``preempted``
(a spot interruption notice), ``bootstrap_error``, ``aborted`` (another node failed before run)
and ``setup_done`` (the setup barrier). :func:`judge` applies SkyPilot's rule: the program's
exit code decides when there is one; an allocation lost without one is the infrastructure's
fault. The markers of a job are one S3 listing; the content of ``exit_code`` and
``bootstrap_error`` is read once per object version (ETag), for the sync and async readers
alike.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_skypilot.backends.aws.clients import AwsClients
from airflow_skypilot.backends.aws.ec2 import GONE, TAG_CANCELLED, InstanceView, newest_reservation
from airflow_skypilot.backends.aws.handles import job_objects, region_of
from airflow_skypilot.backends.aws.settings import AwsSettings
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus

_MARKER_RE = re.compile(r"^rank-(\d+)/(exit_code|bootstrap_error|preempted|aborted|setup_done)$")
#: markers whose content matters (the rest only need to exist)
CONTENT_MARKERS = ("exit_code", "bootstrap_error")


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


def marker_keys(keys: Iterable[str]) -> list[tuple[str, int, str]]:
    """Relative S3 keys -> (key, rank, marker name) for the ones that are markers."""
    out = []
    for key in keys:
        match = _MARKER_RE.match(key)
        if match:
            out.append((key, int(match.group(1)), match.group(2)))
    return out


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


def judge_handle(handle: JobHandle, insts: list[InstanceView], markers: Markers) -> JobStatus:
    """:func:`judge` for a handle: the instances of its own launch (its reservation), else the
    newest launch under its name."""
    res = handle.extra.get("reservation_id")
    mine = [i for i in insts if i.reservation_id == res] if res else []
    return judge(handle.num_nodes, bool(handle.extra.get("spot")),
                 mine or newest_reservation(insts), markers)


def needs_markers(insts: list[InstanceView]) -> bool:
    """Is there anything to read in S3 (no instance left, or one that has started)?"""
    return not insts or any(i.state != "pending" for i in insts)


def group_by_region(handles: Iterable[JobHandle]) -> dict[str, list[str]]:
    """Region -> the job names of ``handles`` there (one DescribeInstances each)."""
    groups: dict[str, list[str]] = {}
    for h in handles:
        groups.setdefault(region_of(h), []).append(h.job_name)
    return groups


def _add_listing(objects: dict[str, str], page: Mapping[str, Any], prefix: str) -> None:
    """One ``list_objects_v2`` page into ``objects``: key relative to ``prefix`` -> ETag."""
    for obj in page.get("Contents", []):
        objects[obj["Key"][len(prefix):]] = obj.get("ETag", "")


class MarkerReader:
    """Reads a job's markers from its S3 prefix; each marker's content once per version."""

    def __init__(self, clients: AwsClients):
        self._clients = clients
        self._cache: dict[tuple[str, str], str] = {}

    def _wanted(self, bucket: str, prefix: str, objects: Mapping[str, str],
                ) -> tuple[list[tuple[str, int, str]], dict[str, tuple[str, str]]]:
        """The markers among ``objects`` (relative key -> ETag), and the cache key of each one
        whose content matters (object and ETag: each version is read once)."""
        found = marker_keys(objects)
        wanted = {key: (f"{bucket}/{prefix}{key}", objects[key])
                  for key, _, name in found if name in CONTENT_MARKERS}
        return found, wanted

    def _markers(self, found: list[tuple[str, int, str]],
                 wanted: Mapping[str, tuple[str, str]]) -> Markers:
        return build_markers(found, {k: self._cache[c] for k, c in wanted.items()})

    def read(self, settings: AwsSettings, handle: JobHandle) -> Markers:
        """The markers of the job of ``handle`` (boto3, from the worker)."""
        bucket, prefix = job_objects(settings, handle)
        if not bucket:
            return Markers()
        s3 = self._clients.client("s3", settings.s3_region)
        objects: dict[str, str] = {}
        try:
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                     Prefix=prefix):
                _add_listing(objects, page, prefix)
            found, wanted = self._wanted(bucket, prefix, objects)
            for key, cache_key in wanted.items():
                if cache_key not in self._cache:
                    body = s3.get_object(Bucket=bucket, Key=prefix + key)["Body"].read()
                    self._cache[cache_key] = body.decode("utf-8", "replace")
        except Exception as exc:
            raise self._clients.error(exc, f"listing s3://{bucket}/{prefix}") from exc
        return self._markers(found, wanted)

    async def aread(self, settings: AwsSettings, handle: JobHandle) -> Markers:
        """The same as :meth:`read` with aiobotocore (errors are the caller's)."""
        bucket, prefix = job_objects(settings, handle)
        if not bucket:
            return Markers()
        s3 = await self._clients.aclient("s3", settings.s3_region)
        objects: dict[str, str] = {}
        async for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                       Prefix=prefix):
            _add_listing(objects, page, prefix)
        found, wanted = self._wanted(bucket, prefix, objects)
        for key, cache_key in wanted.items():
            if cache_key not in self._cache:
                resp = await s3.get_object(Bucket=bucket, Key=prefix + key)
                async with resp["Body"] as stream:
                    self._cache[cache_key] = (await stream.read()).decode("utf-8", "replace")
        return self._markers(found, wanted)
