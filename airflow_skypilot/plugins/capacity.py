"""Live capacity for the pages: the connections' ``show-gpus`` rows, probed off the event loop,
bounded in time, and cached briefly so that a storm of page refreshes cannot hammer login nodes.

The connections are the ``?conn=`` ids (at most :data:`MAX_CONNECTIONS`), else
``[skypilot] connections``; any id Airflow accepts for a connection is one here.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
from airflow.utils.log.logging_mixin import LoggingMixin
from fastapi import HTTPException

from airflow_skypilot.plugins.auth import can_read_connection
from airflow_skypilot.settings import default_connections

#: capacity answers are reused this long, so a page refresh storm cannot hammer login nodes
CAPACITY_TTL = 10.0
#: the longest a capacity page waits for a connection (the hook's timeout is the smaller one)
CAPACITY_MAX_TIMEOUT = 20.0
#: the most connections one ``?conn=`` list may ask for ([skypilot] connections has no cap)
MAX_CONNECTIONS = 16


def probe_timeout() -> float:
    """``[skypilot] probe_timeout``, at most :data:`CAPACITY_MAX_TIMEOUT` for a page."""
    from airflow.configuration import conf

    try:
        configured = conf.getfloat("skypilot", "probe_timeout", fallback=60.0)
    except Exception:
        configured = 60.0
    return max(1.0, min(configured, CAPACITY_MAX_TIMEOUT))


#: a refresh this soon after an answer gets that answer: "probe again" clicked twice probes once
REFRESH_AFTER = 5.0


class _Probe:
    """A probe under way, which requests for the same connections wait for."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: tuple[list[dict[str, Any]], float, float] | None = None


class CapacityProbes(LoggingMixin):
    """``show-gpus`` rows per set of connections, cached for ``ttl`` seconds.

    Concurrent requests for the same connections share one probe, refreshes too: a refresh
    joins the probe under way, and one within ``refresh_after`` seconds of the last answer gets
    that answer (else each click of "probe again" would queue a probe of its own behind it).
    """

    def __init__(self, ttl: float = CAPACITY_TTL, refresh_after: float = REFRESH_AFTER):
        super().__init__()
        self.ttl = ttl
        self.refresh_after = refresh_after
        self._cache: dict[tuple[str, ...], tuple[float, list[dict[str, Any]], float]] = {}
        self._running: dict[tuple[str, ...], _Probe] = {}
        self._guard = threading.Lock()

    def probe(self, conn_ids: list[str], timeout: float, refresh: bool = False
              ) -> tuple[list[dict[str, Any]], float, float]:
        """Rows, when they were probed, and how long it took (blocking: run it in a thread)."""
        key = tuple(conn_ids)
        with self._guard:
            cached = self._cache.get(key)
            if cached and time.time() - cached[0] < (self.refresh_after if refresh else self.ttl):
                return cached[1], cached[0], cached[2]
            running = self._running.get(key)
            mine = running is None
            if mine:
                running = self._running[key] = _Probe()
        if not mine:
            # the hook bounds the probe by the timeout; this bound frees the thread regardless
            if running.done.wait(timeout + 10) and running.answer is not None:
                return running.answer
            return ([{"connection": c, "location": "", "accelerator": None,
                      "error": f"no answer within {timeout:g}s"} for c in conn_ids],
                    time.time(), 0.0)
        try:
            running.answer = self._probe(conn_ids, timeout)
            with self._guard:
                self._cache[key] = running.answer[1], running.answer[0], running.answer[2]
            return running.answer
        finally:
            with self._guard:
                self._running.pop(key, None)
            running.done.set()

    def _probe(self, conn_ids: list[str], timeout: float
               ) -> tuple[list[dict[str, Any]], float, float]:
        from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook

        start = time.monotonic()
        try:
            rows = [r.to_json() for r in SkyPilotCapacityHook(conn_ids, timeout=timeout)
                    .capacity()]
        except Exception as exc:  # the hook reports per connection; this is a last resort
            self.log.exception("Capacity probe failed")
            rows = [{"connection": c, "location": "", "accelerator": None,
                     "error": f"{type(exc).__name__}: {exc}"} for c in conn_ids]
        return rows, time.time(), time.monotonic() - start


#: the API server's shared cache
PROBES = CapacityProbes()


async def capacity_for(user: Any, conn_ids: list[str], refresh: bool) -> dict[str, Any]:
    """Probe the connections the user may read, off the event loop, with a deadline.

    The probe (SSH, HTTP) runs in the same worker threads as FastAPI's sync routes; the hook
    bounds each connection by the probe timeout, and this waits a little longer at most.
    """
    allowed = await anyio.to_thread.run_sync(
        lambda: [c for c in conn_ids if can_read_connection(user, c)])
    denied = [c for c in conn_ids if c not in allowed]
    timeout = probe_timeout()
    rows: list[dict[str, Any]] = []
    probed_at, seconds = time.time(), 0.0
    if allowed:
        answer = None
        with anyio.move_on_after(timeout + 10):
            answer = await anyio.to_thread.run_sync(PROBES.probe, allowed, timeout, refresh,
                                                    abandon_on_cancel=True)
        if answer is None:
            rows = [{"connection": c, "location": "", "accelerator": None,
                     "error": f"no answer within {timeout:g}s"} for c in allowed]
        else:
            rows, probed_at, seconds = answer
        answered = {r.get("connection") for r in rows}
        rows = rows + [{"connection": c, "location": "", "accelerator": None,
                        "note": "reported no locations"} for c in allowed if c not in answered]
    rows = rows + [{"connection": c, "location": "", "accelerator": None,
                    "error": "you are not allowed to read this connection"} for c in denied]
    order = {c: i for i, c in enumerate(conn_ids)}
    rows.sort(key=lambda r: (order.get(r.get("connection"), len(order)),
                             str(r.get("location") or ""), str(r.get("accelerator") or "")))
    return {"connections": conn_ids, "probed_at": probed_at, "seconds": round(seconds, 3),
            "timeout": timeout, "ttl": PROBES.ttl, "rows": rows}


def is_conn_id(conn_id: str) -> bool:
    """Airflow's own rule for a connection id (``airflow.models.connection.sanitize_conn_id``:
    word characters and ``#!()-.:/\\``, at most 250), matched whole: ``team/slurm`` and
    ``slurm:alpha`` are ids, ``<b>`` is not; nor is one with a ``.``/``..`` path segment or a
    leading slash. The pages escape the ids wherever they show them."""
    from airflow.models.connection import sanitize_conn_id

    if sanitize_conn_id(conn_id) != conn_id:  # its "$" would let a final newline through
        return False
    # a secrets backend may build a path from the id (Vault: connections/<id>): no id here
    # climbs out of it, as "../variables/x" would
    return conn_id[0] not in "/\\" and not {".", ".."} & set(re.split(r"[/\\]", conn_id))


def requested_connections(conn: list[str] | None) -> list[str]:
    """The ``?conn=`` ids (comma-separated too; at most :data:`MAX_CONNECTIONS`), else
    ``[skypilot] connections`` (the deployment's own list: not capped); 400 if bad."""
    given = [part.strip() for value in conn or [] for part in value.split(",")]
    asked = list(dict.fromkeys(c for c in given if c))
    conns = asked or default_connections()
    bad = [c for c in conns if not is_conn_id(c)]
    if bad:
        raise HTTPException(400, f"not a connection id: {bad[0][:80]!r}")
    if len(asked) > MAX_CONNECTIONS:
        raise HTTPException(400, f"at most {MAX_CONNECTIONS} connections at a time")
    return conns
