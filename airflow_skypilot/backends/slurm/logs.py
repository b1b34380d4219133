"""A job's output: ``slurm.log`` in its job dir, read from a byte offset.

The bytes come back base64-encoded after an ``@@log`` line, so the offset counts bytes (not
decoded characters) and a multi-byte character cut at the read limit is not lost. The triggerer
reads every streamed job of a connection in one command, one ``@@log <job id>`` frame each.
A failure's tail is read from the file's end (``tail -c``), however long the log: every rank
writes into that one file (``srun --label``), so its end is the job's end.
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Sequence

from airflow_skypilot.backends.base import TAIL_BYTES, JobHandle, tail_text

#: what one read returns at most: one job (worker side), each job of a batch (triggerer side)
READ_LIMIT = 1 << 20
BATCH_READ_LIMIT = 1 << 18


def _read(handle: JobHandle, offset: int, limit: int) -> str:
    path = shlex.quote(handle.extra.get("log", ""))
    return (f"tail -c +{int(offset) + 1} {path} 2>/dev/null | head -c {int(limit)} "
            f"| base64 -w0; echo")


def log_script(handle: JobHandle, offset: int, limit: int = READ_LIMIT) -> str:
    """Read one job's log from ``offset``."""
    return f"echo @@log; {_read(handle, offset, limit)}"


def tail_script(handle: JobHandle, max_bytes: int = TAIL_BYTES) -> str:
    """Read the last ``max_bytes`` bytes of one job's log, and one more: whether its start
    was cut (:func:`split_tail`)."""
    path = shlex.quote(handle.extra.get("log", ""))
    return f"echo @@log; tail -c {int(max_bytes) + 1} {path} 2>/dev/null | base64 -w0; echo"


def split_tail(out: str, max_bytes: int = TAIL_BYTES) -> str:
    """:func:`tail_script`'s output -> the end of the job's text ("" when nothing was read)."""
    head, _, body = out.partition("\n")
    if head.strip() != "@@log":
        return ""
    data = base64.b64decode(body.strip() or b"")
    return tail_text([(0, data, len(data) <= max_bytes)], max_bytes)


def split_log(out: str, offset: int) -> tuple[str, int]:
    """:func:`log_script`'s output -> (text, next offset); nothing read keeps ``offset``."""
    head, _, body = out.partition("\n")
    if head.strip() != "@@log":
        return "", offset
    data = _whole_characters(base64.b64decode(body.strip() or b""))
    return data.decode("utf-8", "replace"), offset + len(data)


def _whole_characters(data: bytes) -> bytes:
    """``data`` less a UTF-8 character cut at its end (read whole from there next time)."""
    i = len(data) - 1
    while i >= 0 and len(data) - i < 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0 or data[i] < 0xC0:
        return data
    need = 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4
    return data[:i] if len(data) - i < need else data


def logs_script(requests: Sequence[tuple[JobHandle, int]],
                limit: int = BATCH_READ_LIMIT) -> str:
    """Read many jobs' logs, each from its own offset, in one script."""
    return "\n".join(f"printf '@@log %s\\n' {shlex.quote(handle.job_id)}; "
                     f"{_read(handle, offset, limit)}" for handle, offset in requests)


def split_logs(out: str, requests: Sequence[tuple[JobHandle, int]]
               ) -> dict[str, tuple[str, int]]:
    """:func:`logs_script`'s output -> (text, next offset) per job id."""
    texts: dict[str, tuple[str, int]] = {}
    offsets = {h.job_id: o for h, o in requests}
    current = None
    for line in out.splitlines():
        if line.startswith("@@log "):
            current = line[6:].strip()
        elif current is not None:
            data = _whole_characters(base64.b64decode(line.strip() or b""))
            texts[current] = (data.decode("utf-8", "replace"), offsets[current] + len(data))
            current = None
    return {h.job_id: texts.get(h.job_id, ("", o)) for h, o in requests}
