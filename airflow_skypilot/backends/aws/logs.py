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

A rank other than 0 may end long before rank 0 does: it failed, and the job with it, while
rank 0 runs on until the job's cleanup terminates it. Its output, the failure's cause, must not
wait for that. So once ranks 1..k have all ended (their logs are complete) and the job is not
final, a read gives rank 0's new whole lines and then the new part of the other ranks' text
(ranks 1..k, each line prefixed, as it will be in the final text), and from then on an offset
counts two positions, rank 0's log and the other ranks' text (:class:`_Split`), paired by
:func:`split_offset` (``SPLIT`` plus Cantor's pairing: it grows with each of them, and stays
under 2**63 for logs of gigabytes; an offset is an integer in the trigger's msgpack events,
where one past 2**64 stops the triggerer). Both only grow, so the offset does too, and a read
goes on with each from where the last one stopped: nothing is repeated or lost, rank 0's
lines written after the failed rank's are shown after its output, and a rank that ends later
follows when every rank before it has ended too (or the job is final; before, it is in the
failure's tail). Once the job is final, such an offset goes
on the same way, with the newline after rank 0 when its last line had none. An offset below
``SPLIT`` is one into the text above.

Whether a job is final comes from a :class:`JobView`: what the status poll just before saw (the
triggerer's case: no extra request), else, for a job of several nodes, its instances and then
its listing (instances first: a job whose instances are gone has written everything it will
before its listing is read). A read that ends inside a UTF-8 character leaves that character's
bytes for the next read. No object yet (or nothing after the offset) is no new output, not an
error. A failure's tail is the end of that text, read with suffix ranges (``bytes=-N``) of the
ranks' logs, however long they are: rank 0's and those of every rank that has ended (all of them
once the job is final), so a failed rank's last lines are in it while rank 0 still runs.
"""

from __future__ import annotations

import math
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
#: offsets at and past this count two positions (:func:`split_offset`); below, one
SPLIT = 1 << 40


def split_offset(at0: int, at_others: int) -> int:
    """The offset of positions ``at0`` (rank 0's log) and ``at_others`` (the other ranks'
    text): it grows when either does, and is under 2**63 while they sum to under 4 GiB."""
    total = at0 + at_others
    return SPLIT + total * (total + 1) // 2 + at_others


def split_positions(offset: int) -> tuple[int, int]:
    """``(at0, at_others)`` of an offset from :func:`split_offset`."""
    z = offset - SPLIT
    total = (math.isqrt(8 * z + 1) - 1) // 2
    at_others = z - total * (total + 1) // 2
    return total - at_others, at_others
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

    def ended_after_0(self, num_nodes: int) -> int:
        """k: ranks 1..k have all ended (their logs are complete; rank k+1 has not)."""
        k = 0
        while k + 1 < num_nodes and self.markers.ended(k + 1):
            k += 1
        return k


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


class _Split:
    """A read that counts two positions (:func:`split_positions`: in rank 0's log, in the
    other ranks' text): once ranks 1..k have ended before the job is final, or
    from such an offset on. Rank 0's new whole lines (all of it, and the newline it may need,
    once the job is final), then the other ranks' new text, within the limit."""

    def __init__(self, handle: JobHandle, prefix: str, offset: int, limit: int,
                 view: JobView | None):
        self.prefix, self.limit = prefix, limit
        self.at0, self.at_others = split_positions(offset) if offset >= SPLIT else (offset, 0)
        ranks = handle.num_nodes
        self.final = view is not None and view.final(ranks)
        self.others = ranks - 1 if self.final else \
            view.ended_after_0(ranks) if view is not None else 0
        self.size0 = view.markers.log_sizes.get(0, 0) if view is not None else 0

    @classmethod
    def of(cls, handle: JobHandle, prefix: str, offset: int, limit: int,
           view: JobView | None) -> _Split | None:
        """The plan when the offset counts two positions, or should from now on; None: the
        one-position text (:class:`_Plan`)."""
        plan = cls(handle, prefix, offset, limit, view)
        # an offset past rank 0's log is one into a final text already read (a job whose
        # instances EC2 no longer lists, an hour on, no longer reads as final): not split
        if handle.num_nodes < 2 or (offset < SPLIT and (plan.final or not plan.others
                                                        or offset > plan.size0 > 0)):
            return None
        return plan

    def reads(self) -> list[tuple[str, str | None] | None]:
        """(key, range) of rank 0 (None: nothing to read), then the whole logs of ranks 1..k
        (complete: they have ended)."""
        key0 = _key(self.prefix, 0)
        if not self.final:  # rank 0 runs: from the position, its whole lines
            first = (key0, _range(self.at0, self.at0 + self.limit))
        elif self.at0 < self.size0:  # up to its end
            first = (key0, _range(self.at0, min(self.size0, self.at0 + self.limit)))
        elif self.at0 == self.size0 and self.size0:  # its last byte: is a newline owed?
            first = (key0, _range(self.size0 - 1, self.size0))
        else:
            first = None
        return [first, *((_key(self.prefix, r), None) for r in range(1, self.others + 1))]

    def _rank0(self, data: bytes) -> tuple[bytes, int]:
        """Rank 0's bytes to give and its next position."""
        if not self.final:
            cut = data.rfind(b"\n") + 1
            if not cut and len(data) >= self.limit:  # a line longer than a read: in pieces
                cut = decode_log(data)[1]
            return data[:cut], self.at0 + cut
        if self.at0 >= self.size0:  # ``data`` is its last byte, if anything
            owed = self.at0 == self.size0 and data not in (b"", b"\n")
            return (b"\n", self.at0 + 1) if owed else (b"", self.at0)
        end = self.at0 + len(data)
        if end < self.size0:  # the limit ends inside rank 0
            used = decode_log(data)[1]
            return data[:used], self.at0 + used
        owed = bool(data) and not data.endswith(b"\n")
        return data + b"\n" * owed, end + owed

    def answer(self, data: list[bytes]) -> tuple[str, int]:
        mine, at0 = self._rank0(data[0])
        others = join_logs([(0, b""), *enumerate(data[1:], 1)], True)
        text, at_others = "", self.at_others
        room = self.limit - len(mine)
        if room > 0 and self.at_others < len(others):
            text, at_others = slice_log(others, self.at_others, True, room)
        return mine.decode("utf-8", "replace") + text, split_offset(at0, at_others)


def read_log(clients: AwsClients, settings: AwsSettings, handle: JobHandle, offset: int = 0,
             limit: int = LOG_LIMIT, view: JobView | None = None) -> tuple[str, int]:
    """The job's text from byte ``offset``: (text, next offset). ``view``: what the caller
    knows of the job (None: not final)."""
    bucket, prefix = job_objects(settings, handle)
    if not bucket:
        return "", offset
    get = _getter(clients, settings, bucket)
    if split := _Split.of(handle, prefix, offset, limit, view):
        return split.answer([get(*r) if r else b"" for r in split.reads()])
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
    if split := _Split.of(handle, prefix, offset, limit, view):
        return split.answer([await get(*r) if r else b"" for r in split.reads()])
    plan = _Plan(handle, prefix, offset, limit, view)
    first = plan.first()
    data = await get(*first) if first else b""
    answer = plan.done(data)
    if answer is not None:
        return answer
    return plan.join(data, [(r, await get(key)) for r, key in plan.others()])


def _tail_reads(handle: JobHandle, prefix: str, max_bytes: int,
                view: JobView | None) -> list[tuple[int, str, str]]:
    """(rank, key, range) of the ends to read: rank 0's, and every rank's that has ended
    (all of them once the job is final: its text then ends with the other ranks; before,
    a rank that failed while rank 0 runs on holds the failure's cause); one byte more than
    ``max_bytes`` says whether a rank's start was cut."""
    final = view is not None and view.final(handle.num_nodes)
    ranks = [r for r in range(handle.num_nodes) if r == 0 or final or (
        view is not None and view.markers.ended(r))]
    return [(r, _key(prefix, r), f"bytes=-{int(max_bytes) + 1}") for r in ranks]


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
