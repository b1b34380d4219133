"""A multi-node job's output as one text, the same on every backend that cannot interleave its
ranks live (Slurm can: ``srun --label`` prefixes each line with its rank as it comes).

While the job runs, its text is rank 0's output. Once every rank has ended, the other ranks
follow, each line prefixed ``(rank N) ``; rank 0's part is what it already was (plus a newline
when its last line had none), so the text only ever grows and a byte offset into it stays valid
from the first read to the last. Kubernetes (pod logs) and AWS (per-rank S3 objects) build it
with :func:`join_logs` and cut it with :func:`slice_log`.
"""

from __future__ import annotations

LOG_CHUNK = 1 << 20


def rank_prefix(rank: int) -> bytes:
    return f"(rank {rank}) ".encode()


def join_logs(logs: list[tuple[int, bytes]], final: bool) -> bytes:
    """Rank 0's log; when ``final``, the other ranks after it, each line prefixed."""
    if not logs:
        return b""
    data = logs[0][1]
    if final and len(logs) > 1:
        parts = [data if not data or data.endswith(b"\n") else data + b"\n"]
        for rank, text in logs[1:]:
            prefix = rank_prefix(rank)
            parts += [prefix + line for line in text.splitlines(keepends=True)]
            if parts[-1] and not parts[-1].endswith(b"\n"):
                parts[-1] += b"\n"
        data = b"".join(parts)
    return data


def slice_log(data: bytes, offset: int, final: bool, limit: int = LOG_CHUNK) -> tuple[str, int]:
    """Text from byte ``offset``: whole lines only until the log is final, at most ``limit``
    bytes (a line longer than that comes in pieces); never half a UTF-8 character."""
    if offset >= len(data):
        return "", offset
    end = min(len(data), offset + limit)
    if not final or end < len(data):
        cut = data.rfind(b"\n", offset, end)
        if cut >= 0:
            end = cut + 1
        elif end - offset < limit:
            end = offset  # a partial line: wait for its end
    while offset < end < len(data) and (data[end] & 0xC0) == 0x80:
        end -= 1
    return data[offset:end].decode("utf-8", "replace"), end
