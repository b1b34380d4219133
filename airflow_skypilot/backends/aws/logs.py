"""A job's output: its ranks' logs in S3, read by byte range.

Each node uploads its whole log to ``<job prefix>rank-<r>/log`` every few seconds and once more
before its end marker (``exit_code``, ``bootstrap_error`` or ``aborted``), so a rank's log is
complete once its marker is there.

The text of a job, and what an offset counts, is the same on every backend without live
interleaving (:mod:`airflow_skypilot.backends.common.logs`, as on Kubernetes):

* while the job runs, the text is rank 0's log; a read asks for the bytes after the offset
  (one ranged ``GetObject``, a whole line or not), and a job of one node never needs more;
* once the job is final (every rank has its end marker, or every instance of the job has
  terminated or stopped, so nothing will be written any more), the other ranks follow rank 0,
  each line prefixed ``(rank N) ``, with a newline after rank 0 when its last line had none.

Offsets are bytes into that text. Rank 0's part of the final text is rank 0's log exactly, so an
offset read while the job ran stays valid in the final text, and the text only ever grows. When
the job is final, rank 0's length is the size its listing shows (nothing writes any more);
an offset within rank 0 is a ranged read of it, an offset past it reads rank 0's last byte (for
the newline) and the other ranks' logs, which are then joined and cut at the offset.

Whether a job is final comes from a :class:`JobView`: what the status poll just before saw (the
triggerer's case: no extra request), else, for a job of several nodes, its instances and then
its listing (instances first: a job whose instances are gone has written everything it will
before its listing is read). A read that ends inside a UTF-8 character leaves that character's
bytes for the next read. No object yet (or nothing after the offset) is no new output, not an
error. A failure's tail is the end of that text, read with suffix ranges (``bytes=-N``) of the
ranks' logs, however long they are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from airflow_skypilot.backends.aws.clients import AwsClients, client_error
from airflow_skypilot.backends.aws.ec2 import InstanceView, newest_reservation
from airflow_skypilot.backends.aws.handles import job_objects
from airflow_skypilot.backends.aws.settings import AwsSettings
from airflow_skypilot.backends.aws.status import Markers
from airflow_skypilot.backends.base import TAIL_BYTES, JobHandle, tail_text
from airflow_skypilot.backends.common.logs import join_logs, slice_log

LOG_LIMIT = 1 << 20
#: S3 answers for "no log yet" / "nothing after this offset"
_NOTHING_NEW = ("NoSuchKey", "InvalidRange", "416", "404")
#: instance states after which a node writes nothing more
_ENDED = ("terminated", "stopped")


@dataclass
class JobView:
    """What a listing (and DescribeInstances) said of a job: enough to tell its log is final."""

    markers: Markers
    #: every instance of the job has terminated or stopped (none listed: not known)
    gone: bool = False

    def final(self, num_nodes: int) -> bool:
        return self.gone or all(self.markers.ended(r) for r in range(num_nodes))


def instances_gone(handle: JobHandle, insts: list[InstanceView]) -> bool:
    """Have all the instances of the handle's launch terminated or stopped? (No instance
    listed is not known: EC2 may not list a launch yet.)"""
    res = handle.extra.get("reservation_id")
    mine = [i for i in insts if i.reservation_id == res] if res else []
    mine = mine or newest_reservation(insts)
    return bool(mine) and all(i.state in _ENDED for i in mine)


def decode_log(data: bytes) -> tuple[str, int]:
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


def _key(prefix: str, rank: int) -> str:
    return f"{prefix}rank-{rank}/log"


def _range(start: int, end: int | None = None) -> str:
    """An HTTP byte range from ``start`` to ``end`` (exclusive; None: to the object's end)."""
    return f"bytes={start}-" + ("" if end is None else str(end - 1))


def _failed(clients: AwsClients, exc: Exception, bucket: str, key: str) -> bytes:
    if client_error(exc)[0] in _NOTHING_NEW:
        return b""
    raise clients.error(exc, f"reading s3://{bucket}/{key}") from exc


def _getter(clients: AwsClients, settings: AwsSettings, bucket: str
            ) -> Callable[..., bytes]:
    """``get(key, byte_range=None)``: an object's bytes (b"" for none yet, or none there)."""
    s3 = clients.client("s3", settings.s3_region)

    def get(key: str, byte_range: str | None = None) -> bytes:
        call: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if byte_range:
            call["Range"] = byte_range
        try:
            return s3.get_object(**call)["Body"].read()
        except Exception as exc:
            return _failed(clients, exc, bucket, key)

    return get


async def _agetter(clients: AwsClients, settings: AwsSettings, bucket: str
                   ) -> Callable[..., Awaitable[bytes]]:
    """:func:`_getter` with aiobotocore (the triggerer's)."""
    s3 = await clients.aclient("s3", settings.s3_region)

    async def get(key: str, byte_range: str | None = None) -> bytes:
        call: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if byte_range:
            call["Range"] = byte_range
        try:
            resp = await s3.get_object(**call)
            async with resp["Body"] as stream:
                return await stream.read()
        except Exception as exc:
            return _failed(clients, exc, bucket, key)

    return get


class _Plan:
    """The reads of one call and how their bytes become (text, next offset)."""

    def __init__(self, handle: JobHandle, prefix: str, offset: int, limit: int,
                 view: JobView | None):
        self.offset, self.limit, self.prefix = offset, limit, prefix
        self.ranks = handle.num_nodes
        self.final = self.ranks > 1 and view is not None and view.final(self.ranks)
        self.size0 = view.markers.log_sizes.get(0, 0) if view is not None else 0

    def first(self) -> tuple[str, str] | None:
        """The first read: (key, range), None for nothing to read."""
        if not self.final:  # rank 0, from the offset
            return _key(self.prefix, 0), _range(self.offset, self.offset + self.limit)
        if self.offset < self.size0:  # rank 0 up to its end, within the limit
            return _key(self.prefix, 0), _range(self.offset,
                                                min(self.size0, self.offset + self.limit))
        if self.size0:  # past rank 0: its last byte says whether a newline follows it
            return _key(self.prefix, 0), _range(self.size0 - 1, self.size0)
        return None

    def done(self, data: bytes) -> tuple[str, int] | None:
        """The answer when the first read is all there is to it."""
        if not self.final or self.offset + len(data) < self.size0:
            # still running (rank 0 only), or the limit ends inside rank 0
            text, used = decode_log(data)
            return text, self.offset + used
        return None

    def others(self) -> list[tuple[int, str]]:
        return [(r, _key(self.prefix, r)) for r in range(1, self.ranks)]

    def join(self, data: bytes, others: list[tuple[int, bytes]]) -> tuple[str, int]:
        """Rank 0's bytes read first (from the offset, or its last byte) and the other
        ranks' logs: the final text from the offset."""
        if self.offset < self.size0:
            head, last, start = data[:-1], data[-1:], self.offset
        else:
            head, last, start = b"", data[-1:], self.size0 - len(data[-1:])
        text, end = slice_log(head + join_logs([(0, last), *others], True),
                              self.offset - start, True, self.limit)
        return text, start + end


def read_log(clients: AwsClients, settings: AwsSettings, handle: JobHandle, offset: int = 0,
             limit: int = LOG_LIMIT, view: JobView | None = None) -> tuple[str, int]:
    """The job's text from byte ``offset``: (text, next offset). ``view``: what the caller
    knows of the job (None: not final)."""
    bucket, prefix = job_objects(settings, handle)
    if not bucket:
        return "", offset
    get = _getter(clients, settings, bucket)
    plan = _Plan(handle, prefix, offset, limit, view)
    first = plan.first()
    data = get(*first) if first else b""
    answer = plan.done(data)
    if answer is not None:
        return answer
    return plan.join(data, [(r, get(key)) for r, key in plan.others()])


async def aread_log(clients: AwsClients, settings: AwsSettings, handle: JobHandle,
                    offset: int = 0, limit: int = LOG_LIMIT, view: JobView | None = None,
                    ) -> tuple[str, int]:
    """The same as :func:`read_log` with aiobotocore (the triggerer's)."""
    bucket, prefix = job_objects(settings, handle)
    if not bucket:
        return "", offset
    get = await _agetter(clients, settings, bucket)
    plan = _Plan(handle, prefix, offset, limit, view)
    first = plan.first()
    data = await get(*first) if first else b""
    answer = plan.done(data)
    if answer is not None:
        return answer
    return plan.join(data, [(r, await get(key)) for r, key in plan.others()])


def _tail_reads(handle: JobHandle, prefix: str, max_bytes: int,
                view: JobView | None) -> list[tuple[int, str, str]]:
    """(rank, key, range) of the ends to read: rank 0's, and every rank's once the job is
    final (its text then ends with the other ranks); one byte more than ``max_bytes`` says
    whether a rank's start was cut."""
    final = handle.num_nodes > 1 and view is not None and view.final(handle.num_nodes)
    return [(r, _key(prefix, r), f"bytes=-{int(max_bytes) + 1}")
            for r in range(handle.num_nodes if final else 1)]


def read_tail(clients: AwsClients, settings: AwsSettings, handle: JobHandle,
              max_bytes: int = TAIL_BYTES, view: JobView | None = None) -> str:
    """The end of the job's text (what :func:`read_log` would give last): a suffix range of
    each rank's log, never the whole object."""
    bucket, prefix = job_objects(settings, handle)
    if not bucket:
        return ""
    get = _getter(clients, settings, bucket)
    ends = [(r, get(key, rng)) for r, key, rng in _tail_reads(handle, prefix, max_bytes, view)]
    return tail_text([(r, data, len(data) <= max_bytes) for r, data in ends], max_bytes)


async def aread_tail(clients: AwsClients, settings: AwsSettings, handle: JobHandle,
                     max_bytes: int = TAIL_BYTES, view: JobView | None = None) -> str:
    """The same as :func:`read_tail` with aiobotocore."""
    bucket, prefix = job_objects(settings, handle)
    if not bucket:
        return ""
    get = await _agetter(clients, settings, bucket)
    ends = [(r, await get(key, rng))
            for r, key, rng in _tail_reads(handle, prefix, max_bytes, view)]
    return tail_text([(r, data, len(data) <= max_bytes) for r, data in ends], max_bytes)
