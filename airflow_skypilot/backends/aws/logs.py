"""A job's output: rank 0's log in S3, read by byte range.

The node uploads its whole log to ``<job prefix>rank-0/log`` every few seconds and once more
before its ``exit_code`` marker, so a reader asks for the bytes after its offset (one ranged
``GetObject``). A read that ends inside a UTF-8 character leaves that character's bytes for
the next read. No object yet (or nothing after the offset) is no new output, not an error.
"""

from __future__ import annotations

from typing import Any

from airflow_skypilot.backends.aws.clients import AwsClients, client_error
from airflow_skypilot.backends.aws.handles import job_objects
from airflow_skypilot.backends.aws.settings import AwsSettings
from airflow_skypilot.backends.base import JobHandle

LOG_LIMIT = 1 << 20
#: S3 answers for "no log yet" / "nothing after this offset"
_NOTHING_NEW = ("NoSuchKey", "InvalidRange", "416", "404")


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


def _request(settings: AwsSettings, handle: JobHandle, offset: int,
             limit: int) -> dict[str, Any] | None:
    """The ranged GetObject of the handle's log (None: the job has no bucket)."""
    bucket, prefix = job_objects(settings, handle)
    if not bucket:
        return None
    return {"Bucket": bucket, "Key": f"{prefix}rank-0/log",
            "Range": f"bytes={offset}-{offset + limit - 1}"}


def _failed(clients: AwsClients, exc: Exception, call: dict[str, Any],
            offset: int) -> tuple[str, int]:
    if client_error(exc)[0] in _NOTHING_NEW:
        return "", offset
    raise clients.error(exc, f"reading s3://{call['Bucket']}/{call['Key']}") from exc


def read_log(clients: AwsClients, settings: AwsSettings, handle: JobHandle, offset: int = 0,
             limit: int = LOG_LIMIT) -> tuple[str, int]:
    """Rank 0's log from byte ``offset``: (text, next offset)."""
    call = _request(settings, handle, offset, limit)
    if call is None:
        return "", offset
    s3 = clients.client("s3", settings.s3_region)
    try:
        data = s3.get_object(**call)["Body"].read()
    except Exception as exc:
        return _failed(clients, exc, call, offset)
    text, used = decode_log(data)
    return text, offset + used


async def aread_log(clients: AwsClients, settings: AwsSettings, handle: JobHandle,
                    offset: int = 0, limit: int = LOG_LIMIT) -> tuple[str, int]:
    """The same as :func:`read_log` with aiobotocore (the triggerer's)."""
    call = _request(settings, handle, offset, limit)
    if call is None:
        return "", offset
    s3 = await clients.aclient("s3", settings.s3_region)
    try:
        resp = await s3.get_object(**call)
        async with resp["Body"] as stream:
            data = await stream.read()
    except Exception as exc:
        return _failed(clients, exc, call, offset)
    text, used = decode_log(data)
    return text, offset + used
