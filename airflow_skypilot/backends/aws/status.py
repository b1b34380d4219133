"""A job's state, from its instances and the markers its nodes wrote to S3.

Each node writes under ``<job prefix>rank-<r>/``: ``exit_code`` (the program's), ``preempted``
(a spot interruption notice), ``bootstrap_error``, ``aborted`` (another node failed before run)
and ``setup_done`` (the setup barrier). :func:`judge` applies SkyPilot's rule: the program's
exit code decides when there is one; an allocation lost without one is the infrastructure's
fault.

A poll reads the markers of all its jobs with one paginated ``ListObjectsV2`` per bucket
(:class:`MarkerReader`): the jobs' prefixes share the connection's ``s3_prefix``, so one
listing of their common prefix, started just before the first job's prefix and stopped past the
last one's (S3 lists keys in order), covers them all, and each key goes to the job whose prefix
it has. The request count grows with the objects in that key range (a page is 1000 keys), not
with the number of jobs. The content of ``exit_code`` and ``bootstrap_error`` is read only for
the jobs where one appeared, once per object version (ETag), for the sync and async readers
alike.

A terminal status carries when the job ended as AWS recorded it, so every poll reports the same
``ended_at``: the deciding marker's ``LastModified``, the time of the cancel (its tag), or the
instance's state transition time; the job's newest object when nothing else says.
"""

from __future__ import annotations

import os
import re
import time
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from airflow_skypilot.backends.aws.clients import AwsClients
from airflow_skypilot.backends.aws.ec2 import (
    GONE,
    TAG_CANCELLED,
    InstanceView,
    cancelled_at,
    newest_reservation,
)
from airflow_skypilot.backends.aws.handles import job_objects, region_of
from airflow_skypilot.backends.aws.settings import AwsSettings
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus

_MARKER_RE = re.compile(r"^rank-(\d+)/(exit_code|bootstrap_error|preempted|aborted|setup_done)$")
#: markers whose content matters (the rest only need to exist)
CONTENT_MARKERS = ("exit_code", "bootstrap_error")


@dataclass
class S3Object:
    """One object of a job, as a listing shows it."""

    etag: str = ""
    size: int = 0
    modified: float | None = None


@dataclass
class Markers:
    """What a job's nodes wrote to S3."""

    exit_codes: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    preempted: dict[int, str] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    setup_done: set[int] = field(default_factory=set)
    #: (rank, marker name) -> the marker's LastModified
    written: dict[tuple[int, str], float] = field(default_factory=dict)
    #: rank -> the size of its ``rank-<r>/log`` as listed
    log_sizes: dict[int, int] = field(default_factory=dict)
    #: the newest LastModified of any of the job's objects
    last_write: float | None = None

    @property
    def any(self) -> bool:
        return bool(self.exit_codes or self.errors or self.preempted or self.aborted)

    def ended(self, rank: int) -> bool:
        """Has ``rank`` ended (an exit code, a bootstrap error or an abort)? Its node ships
        its log before the marker, so its log is complete then."""
        return rank in self.exit_codes or rank in self.errors or rank in self.aborted

    def when(self, rank: int, name: str) -> float | None:
        return self.written.get((rank, name))


def marker_keys(keys: Iterable[str]) -> list[tuple[str, int, str]]:
    """Relative S3 keys -> (key, rank, marker name) for the ones that are markers."""
    out = []
    for key in keys:
        match = _MARKER_RE.match(key)
        if match:
            out.append((key, int(match.group(1)), match.group(2)))
    return out


_LOG_RE = re.compile(r"^rank-(\d+)/log$")


def build_markers(found: Iterable[tuple[str, int, str]], content: Mapping[str, str],
                  objects: Mapping[str, S3Object] | None = None) -> Markers:
    """The markers ``found`` (:func:`marker_keys`), with the text of those whose content
    matters, and what the listing said of each of the job's ``objects`` (relative key)."""
    markers = Markers()
    objects = objects or {}
    for key, obj in objects.items():
        if obj.modified is not None:
            markers.last_write = max(markers.last_write or obj.modified, obj.modified)
        if match := _LOG_RE.match(key):
            markers.log_sizes[int(match.group(1))] = obj.size
    for key, rank, name in found:
        if key in objects and objects[key].modified is not None:
            markers.written[(rank, name)] = objects[key].modified  # type: ignore[assignment]
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
          now: float | None = None, launched_at: float | None = None,
          grace: float = 0.0) -> JobStatus:
    """A job's state from its instances and its S3 markers (SkyPilot's rule: the program's
    exit code decides when there is one; an allocation lost without one is infra).

    Every rank's exit code 0 -> SUCCEEDED; then a spot notice or reclaim, or an instance that
    stopped or terminated without an end of its own -> PREEMPTED (spot) / INFRA_FAILED
    (on-demand), even beside another rank's non-zero exit code (it failed on the lost peer),
    unless we terminated it (``cancelled`` tag) -> CANCELLED when no exit code says more; any
    non-zero exit code -> FAILED with it (lowest rank first); a bootstrap error ->
    INFRA_FAILED; a rank EC2 no longer lists (it forgets terminated instances after about an
    hour) has ended when its markers say so, else it is lost like a terminated one (after
    ``grace``; before, PENDING: not listed yet); no instance at all -> LOST, except within
    ``grace`` seconds of the launch (``launched_at``): DescribeInstances is eventually
    consistent, so instances just launched may not be listed yet -> UNKNOWN; else
    PENDING/RUNNING.
    """
    now = time.time() if now is None else now
    spot = spot or any(i.spot for i in instances)
    started = min((i.launch_time for i in instances if i.launch_time), default=None)
    ips = [i.private_ip for i in instances if i.private_ip]
    raw = ",".join(f"{i.rank}:{i.state}" for i in instances) or "(no instances)"

    def status(state: JobState, reason: str = "", code: int | None = None,
               ended: float | None = None, codes: list[int] | None = None) -> JobStatus:
        """``ended``: when AWS recorded the end (else the job's newest object, else now)."""
        end = (ended or markers.last_write or now) if state.terminal else None
        up = state.terminal and any(i.state not in GONE for i in instances)
        return JobStatus(state, reason=reason, exit_code=code, started_at=started,
                         ended_at=end, nodes=ips, raw_state=raw, still_up=up,
                         exit_codes=list(codes or []))

    if markers.exit_codes and all(markers.exit_codes.get(r) == 0 for r in range(num_nodes)):
        ends = [markers.when(r, "exit_code") for r in range(num_nodes)]
        return status(JobState.SUCCEEDED, "", 0,
                      max(ends) if ends and None not in ends else None)  # type: ignore[type-var]
    cancelled = [i for i in instances if i.tags.get(TAG_CANCELLED)]
    lost_state = JobState.PREEMPTED if spot else JobState.INFRA_FAILED
    # the allocation lost decides before an exit code: a program killed by the reclaim's
    # shutdown (143), or a rank that failed because its peer's node went, did not fail itself
    # (SkyPilot checks the cluster before it calls a failure the user's)
    if markers.preempted:
        rank = min(markers.preempted)
        return status(lost_state, f"spot interruption notice on rank {rank}"
                      + (f": {markers.preempted[rank]}" if markers.preempted[rank] else ""),
                      ended=markers.when(rank, "preempted"))
    reclaimed = [i for i in instances if i.state in GONE
                 and i.reason_code == "Server.SpotInstanceTermination"]
    gone = [i for i in instances if i.state in GONE and not markers.ended(i.rank)]
    # EC2 stops listing a terminated instance after about an hour: a rank not listed beside
    # listed peers has ended if it said so (its markers), else its instance is gone, once the
    # launch is old enough for EC2 to list all of it (before that, it is not listed *yet*)
    since = launched_at if launched_at is not None else started
    young = since is not None and now - since < grace
    listed = {i.rank for i in instances}
    unlisted = [r for r in range(num_nodes) if r not in listed and not markers.ended(r)] \
        if instances else []
    if lost := reclaimed or ([] if cancelled else gone):
        first = lost[0]
        which = f"instance {first.instance_id} (rank {first.rank})"
        if reclaimed:
            why = f"{which}: spot instance reclaimed by EC2 ({first.reason_code})"
        else:
            why = (f"{which} is {first.state} without an exit code of its own: "
                   f"{first.reason or first.reason_code or first.state}")
        return status(lost_state, why, ended=first.transition_time)
    if unlisted and not young and not cancelled:
        return status(lost_state, f"the instance of rank {unlisted[0]} is no longer listed by "
                                  "EC2 (terminated) and it wrote no exit code of its own")
    failed = sorted((r, c) for r, c in markers.exit_codes.items() if c != 0)
    if failed:
        rank, code = failed[0]
        where = f" on rank {rank}" if num_nodes > 1 else ""
        return status(JobState.FAILED, f"exit code {code}{where}", code,
                      markers.when(rank, "exit_code"), codes=[c for _, c in failed])
    if markers.errors:
        rank, text = sorted(markers.errors.items())[0]
        return status(JobState.INFRA_FAILED, f"node bootstrap failed on rank {rank}: {text}",
                      ended=markers.when(rank, "bootstrap_error"))
    if not instances:
        age = now - launched_at if launched_at is not None else None
        if age is not None and age < grace:
            return status(JobState.UNKNOWN, f"launched {max(age, 0):.0f}s ago and not listed by "
                                            "EC2 yet (DescribeInstances is eventually "
                                            "consistent)")
        return status(JobState.LOST, "no instance of the job exists (never launched, or gone)")
    if gone:  # all of them ours: we terminated them (cancel)
        marks = [t for i in cancelled if (t := cancelled_at(i.tags[TAG_CANCELLED]))]
        return status(JobState.CANCELLED, "cancelled (instances terminated)",
                      ended=min(marks) if marks else gone[0].transition_time)
    if any(i.state == "pending" for i in instances) or (unlisted and young):
        return status(JobState.PENDING, f"{sum(i.state == 'running' for i in instances)} of "
                                        f"{num_nodes} instance(s) running")
    return status(JobState.RUNNING, "")


def judge_handle(handle: JobHandle, insts: list[InstanceView], markers: Markers,
                 grace: float = 0.0, now: float | None = None) -> JobStatus:
    """:func:`judge` for a handle: the instances of its own launch (its reservation; none of
    them listed is none, never another launch's), else the newest launch under its name.
    ``grace``: seconds after the launch during which unlisted instances are not yet gone."""
    res = handle.extra.get("reservation_id")
    mine = [i for i in insts if i.reservation_id == res] if res else newest_reservation(insts)
    return judge(handle.num_nodes, bool(handle.extra.get("spot")), mine, markers, now=now,
                 launched_at=handle.submitted_at or None, grace=grace)


def needs_markers(insts: list[InstanceView]) -> bool:
    """Is there anything to read in S3 (no instance left, or one that has started)?"""
    return not insts or any(i.state != "pending" for i in insts)


def group_by_region(handles: Iterable[JobHandle]) -> dict[str, list[str]]:
    """Region -> the job names of ``handles`` there (one DescribeInstances each)."""
    groups: dict[str, list[str]] = {}
    for h in handles:
        groups.setdefault(region_of(h), []).append(h.job_name)
    return groups


def listing_call(prefixes: Iterable[str]) -> tuple[dict[str, str], str]:
    """The one ``ListObjectsV2`` (its ``Prefix`` and ``StartAfter``) that covers every prefix,
    and the last prefix (past it, the listing can stop: S3 lists keys in order)."""
    ordered = sorted(set(prefixes))
    common = os.path.commonprefix(ordered)
    call = {"Prefix": common}
    first = ordered[0]
    if first != common:  # skip the keys before the first job's (StartAfter is exclusive)
        call["StartAfter"] = first[:-1]
    return call, ordered[-1]


def past(page: Mapping[str, Any], last: str) -> bool:
    """Is the page's last key beyond every key under ``last`` (no later page is needed)?"""
    contents = page.get("Contents") or []
    if not contents:
        return False
    key = contents[-1]["Key"]
    return key > last and not key.startswith(last)


def _stamp(value: Any) -> float | None:
    return value.timestamp() if isinstance(value, datetime) else None


class _Listing:
    """A listing's keys shared out to the jobs (no job prefix is a prefix of another's: job
    names have no "/")."""

    def __init__(self, prefixes: Iterable[str]):
        self.prefixes = sorted(set(prefixes))
        self.objects: dict[str, dict[str, S3Object]] = {p: {} for p in self.prefixes}

    def add(self, page: Mapping[str, Any]) -> None:
        for obj in page.get("Contents", []):
            key = obj["Key"]
            i = bisect_right(self.prefixes, key) - 1
            if i >= 0 and key.startswith(self.prefixes[i]):
                self.objects[self.prefixes[i]][key[len(self.prefixes[i]):]] = S3Object(
                    obj.get("ETag", ""), int(obj.get("Size") or 0),
                    _stamp(obj.get("LastModified")))


def by_bucket(settings: AwsSettings, handles: Iterable[JobHandle]
              ) -> dict[str, dict[str, list[JobHandle]]]:
    """Bucket -> job prefix -> the handles with objects there (a job without a bucket has no
    markers)."""
    out: dict[str, dict[str, list[JobHandle]]] = {}
    for h in handles:
        bucket, prefix = job_objects(settings, h)
        if bucket:
            out.setdefault(bucket, {}).setdefault(prefix, []).append(h)
    return out


class MarkerReader:
    """Reads the markers of many jobs with one S3 listing per bucket; each marker's content
    once per version."""

    def __init__(self, clients: AwsClients):
        self._clients = clients
        self._cache: dict[tuple[str, str], str] = {}

    def _wanted(self, bucket: str, prefix: str, objects: Mapping[str, S3Object],
                ) -> tuple[list[tuple[str, int, str]], dict[str, tuple[str, str]]]:
        """The markers among ``objects`` (relative key -> what the listing said), and the
        cache key of each one whose content matters (object and ETag: each version is read
        once)."""
        found = marker_keys(objects)
        wanted = {key: (f"{bucket}/{prefix}{key}", objects[key].etag)
                  for key, _, name in found if name in CONTENT_MARKERS}
        return found, wanted

    def _markers(self, found: list[tuple[str, int, str]],
                 wanted: Mapping[str, tuple[str, str]],
                 objects: Mapping[str, S3Object]) -> Markers:
        return build_markers(found, {k: self._cache[c] for k, c in wanted.items()}, objects)

    def read_many(self, settings: AwsSettings, handles: Iterable[JobHandle]
                  ) -> dict[str, Markers]:
        """The markers of the jobs of ``handles``, by job name (boto3, from the worker)."""
        out: dict[str, Markers] = {h.job_name: Markers() for h in handles}
        s3 = None
        for bucket, jobs in by_bucket(settings, handles).items():
            s3 = s3 or self._clients.client("s3", settings.s3_region)
            call, last = listing_call(jobs)
            listing = _Listing(jobs)
            try:
                for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, **call):
                    listing.add(page)
                    if past(page, last):
                        break
                for prefix, objects in listing.objects.items():
                    found, wanted = self._wanted(bucket, prefix, objects)
                    for key, cache_key in wanted.items():
                        if cache_key not in self._cache:
                            body = s3.get_object(Bucket=bucket, Key=prefix + key)["Body"].read()
                            self._cache[cache_key] = body.decode("utf-8", "replace")
                    for h in jobs[prefix]:
                        out[h.job_name] = self._markers(found, wanted, objects)
            except Exception as exc:
                raise self._clients.error(exc, f"listing s3://{bucket}/{call['Prefix']}") \
                    from exc
        return out

    async def aread_many(self, settings: AwsSettings, handles: Iterable[JobHandle]
                         ) -> dict[str, Markers]:
        """The same as :meth:`read_many` with aiobotocore (errors are the caller's)."""
        out: dict[str, Markers] = {h.job_name: Markers() for h in handles}
        s3 = None
        for bucket, jobs in by_bucket(settings, handles).items():
            s3 = s3 or await self._clients.aclient("s3", settings.s3_region)
            call, last = listing_call(jobs)
            listing = _Listing(jobs)
            async for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                           **call):
                listing.add(page)
                if past(page, last):
                    break
            for prefix, objects in listing.objects.items():
                found, wanted = self._wanted(bucket, prefix, objects)
                for key, cache_key in wanted.items():
                    if cache_key not in self._cache:
                        resp = await s3.get_object(Bucket=bucket, Key=prefix + key)
                        async with resp["Body"] as stream:
                            self._cache[cache_key] = (await stream.read()).decode(
                                "utf-8", "replace")
                for h in jobs[prefix]:
                    out[h.job_name] = self._markers(found, wanted, objects)
        return out
