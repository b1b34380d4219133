"""The SkyPilot UI plugin: where jobs were placed, why, and what capacity there is now.

A FastAPI app mounted on the Airflow 3 API server under ``/skypilot`` serves plain
server-rendered pages (no build step) and the same data as JSON:

``/skypilot/jobs``                                    recent SkyPilot task instances, newest first
``/skypilot/jobs/{dag_id}/{run_id}/{task_id}[/{map_index}]``  one task instance: placement table,
                                                      job handle, attempts
``/skypilot/capacity[?conn=ID...]``                    live GPUs per connection/location/accelerator
``/skypilot/api/jobs``, ``/skypilot/api/jobs/...``, ``/skypilot/api/capacity``   the JSON forms

Auth: every route resolves the caller with the API server's own ``get_user`` (the ``_token``
cookie the Airflow UI sets, or an ``Authorization: Bearer`` JWT) and asks the configured auth
manager, so the pages show exactly what Airflow's REST API would: job rows only for DAGs the user
may read (and whose XComs and task instances they may read), capacity only for connections they
may read. Anonymous callers get 401 (JSON) or a redirect to Airflow's login (HTML).

The pages reach the UI as nav entries (Browse > SkyPilot jobs / SkyPilot capacity) and as a
"SkyPilot" tab on every task instance (Airflow 3.1+ ``external_views``); the operator's extra link
("SkyPilot job") points at the task instance page. Job data comes from the XComs the operator
writes (``skypilot_handle``, ``skypilot_placement``, ``return_value``); env values and secrets
are never in them, and handle extras that look like credentials are not rendered.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode

import anyio
import anyio.to_thread
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_skypilot.links.skypilot import PLUGIN_PREFIX, job_path

log = logging.getLogger(__name__)

# The operator's XCom keys (airflow_skypilot.operators.skypilot.XCOM_*); not imported from
# there so that loading the plugin in every Airflow process stays cheap. A test keeps them equal.
XCOM_HANDLE = "skypilot_handle"
XCOM_PLACEMENT = "skypilot_placement"
XCOM_RESULT = "return_value"

#: capacity answers are reused this long, so a page refresh storm cannot hammer login nodes
CAPACITY_TTL = 10.0
#: the longest a capacity page waits for a connection (the hook's timeout is the smaller one)
CAPACITY_MAX_TIMEOUT = 20.0
MAX_CONNECTIONS = 16
_CONN_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,250}$")
_SECRETISH = re.compile(r"env|secret|token|password|passwd|credential|key", re.IGNORECASE)

TEMPLATES = Environment(
    loader=FileSystemLoader(str(Path(__file__).parent / "templates")),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


# --- formatting (template filters) --------------------------------------------------------------
def _as_datetime(value: Any) -> datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(float(value), tz=timezone.utc)
    if isinstance(value, str):
        try:
            return _as_datetime(datetime.fromisoformat(value.replace("Z", "+00:00")))
        except ValueError:
            return None
    return None


def fmt_time(value: Any, short: bool = False) -> str:
    """UTC, like the Airflow UI's default; ``short`` drops the year for dense tables."""
    when = _as_datetime(value)
    if when is None:
        return ""
    return when.astimezone(timezone.utc).strftime("%m-%d %H:%M:%S" if short
                                                  else "%Y-%m-%d %H:%M:%S UTC")


def fmt_duration(start: Any, end: Any = None) -> str:
    a, b = _as_datetime(start), _as_datetime(end) or datetime.now(timezone.utc)
    if a is None:
        return ""
    seconds = max(0, int((b - a).total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def fmt_money(value: Any) -> str:
    if value is None or value == "":
        return ""
    value = float(value)
    if 0 < value < 0.01:
        return "<$0.01"
    return f"${value:,.2f}"


def fmt_hours(value: Any) -> str:
    if value is None or value == "":
        return ""
    value = float(value)
    return f"{value:.3f}" if 0 < value < 0.1 else f"{value:,.2f}"


def fmt_price(value: Any) -> str:
    if value is None or value == "":
        return ""
    return f"${float(value):.3g}/h" if float(value) else "$0/h"


TEMPLATES.filters.update(time=fmt_time, duration=fmt_duration, money=fmt_money,
                         hours=fmt_hours, price=fmt_price)


# --- auth ---------------------------------------------------------------------------------------
async def current_user(request: Request) -> Any:
    """The caller, as the API server's own routes see it (Bearer JWT first, then the cookie).

    The security module is imported here, not at the top: it pulls in most of Airflow's models,
    and every Airflow process that loads plugins imports this module.
    """
    from airflow.api_fastapi.core_api import security

    credentials = await security.bearer_scheme(request)
    return await security.get_user(request, None, credentials)


UserDep = Annotated[Any, Depends(current_user)]


def _auth_manager() -> Any:
    from airflow.api_fastapi.app import get_auth_manager

    return get_auth_manager()


def _team_names(dag_ids: list[str]) -> dict[str, str | None]:
    try:
        from airflow.models.dag import DagModel

        return DagModel.get_dag_id_to_team_name_mapping(dag_ids)
    except Exception:  # older Airflow without teams: no team scoping
        return {}


def _can_read_job(user: Any, dag_id: str, team_name: str | None = None) -> bool:
    """May read this DAG's task instances and XComs (what a job page shows)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        DagAccessEntity,
        DagDetails,
    )

    manager = _auth_manager()
    details = DagDetails(id=dag_id, team_name=team_name)
    return all(manager.is_authorized_dag(method="GET", access_entity=entity, details=details,
                                         user=user)
               for entity in (DagAccessEntity.TASK_INSTANCE, DagAccessEntity.XCOM))


def _readable_dag_ids(user: Any) -> set[str]:
    return set(_auth_manager().get_authorized_dag_ids(user=user, method="GET"))


def _can_read_connection(user: Any, conn_id: str) -> bool:
    from airflow.api_fastapi.auth.managers.models.resource_details import ConnectionDetails

    team_name = None
    try:
        from airflow.models.connection import Connection

        team_name = Connection.get_team_name(conn_id)
    except Exception:  # no such connection in the DB, or Airflow without teams
        team_name = None
    return bool(_auth_manager().is_authorized_connection(
        method="GET", details=ConnectionDetails(conn_id=conn_id, team_name=team_name), user=user))


def _user_name(user: Any) -> str:
    try:
        return str(user.get_name())
    except Exception:
        return ""


# --- request helpers ----------------------------------------------------------------------------
def _prefix(request: Request) -> str:
    """Where this app is mounted, as the browser sees it (``/skypilot`` or ``/base/skypilot``)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _ui_base(request: Request) -> str:
    """The Airflow UI's base path: the mount point without the plugin prefix."""
    prefix = _prefix(request)
    return prefix[: -len(PLUGIN_PREFIX)] if prefix.endswith(PLUGIN_PREFIX) else ""


def _ti_ui_path(base: str, dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
    ids = [quote(str(x), safe="") for x in (dag_id, run_id, task_id)]
    path = f"{base}/dags/{ids[0]}/runs/{ids[1]}/tasks/{ids[2]}"
    return path if map_index < 0 else f"{path}/mapped/{map_index}"


def _job_path(request: Request, dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
    return _ui_base(request) + job_path(dag_id, run_id, task_id, map_index)


def _parse_map_index(value: str | int | None) -> int:
    """``-1`` unless a non-negative integer: the UI leaves ``{MAP_INDEX}`` as-is when unmapped."""
    try:
        number = int(str(value))
    except (TypeError, ValueError):
        return -1
    return number if number >= 0 else -1


def _is_api(request: Request) -> bool:
    path = request.url.path
    prefix = _prefix(request)
    rel = path[len(prefix):] if prefix and path.startswith(prefix) else path
    return rel.startswith("/api/")


def _render(request: Request, template: str, status_code: int = 200, **context: Any
            ) -> HTMLResponse:
    """A page with a strict CSP: no script but the one nonce'd helper, framed only by Airflow."""
    context.setdefault("user_name", "")
    nonce = secrets.token_urlsafe(16)
    html = TEMPLATES.get_template(f"skypilot/{template}").render(
        prefix=_prefix(request), ui_base=_ui_base(request), nonce=nonce, **context)
    csp = (f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; "
           "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'self'")
    return HTMLResponse(html, status_code=status_code,
                        headers={"Cache-Control": "no-store", "Content-Security-Policy": csp,
                                 "X-Content-Type-Options": "nosniff",
                                 "Referrer-Policy": "same-origin"})


# --- XCom data ----------------------------------------------------------------------------------
def _unwrap(value: Any) -> Any:
    """Undo Airflow's wrappers in ``next_kwargs`` (serde's ``__classname__/__data__``, older
    ``__type/__var``); plain JSON passes through."""
    if isinstance(value, Mapping):
        if "__var" in value and "__type" in value:
            return _unwrap(value["__var"])
        if "__data__" in value and "__classname__" in value:
            return _unwrap(value["__data__"])
        return {k: _unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unwrap(v) for v in value]
    return value


def _xcom_value(row: Any) -> Any:
    try:
        from airflow.models.xcom import XComModel

        value = XComModel.deserialize_value(row)
    except Exception:
        value = getattr(row, "value", None)
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return value


_ATTEMPT_FIELDS = ("connection", "location", "job_id", "job_name", "state", "reason",
                   "exit_code", "submitted_at", "started_at", "ended_at", "adopted", "gpus",
                   "price_per_hour", "infra_failure")
_HANDLE_FIELDS = ("backend", "connection", "location", "infra", "job_id", "job_name",
                  "num_nodes", "accelerator", "gpus_per_node", "price_per_hour", "submitted_at",
                  "adopted")


def _attempts(result: Any, handle: Any, next_kwargs: Any) -> tuple[list[dict[str, Any]], str]:
    """The attempt history and where it came from.

    The result (on success) has every attempt; while a deferred task waits, the state the
    operator handed to its trigger does; otherwise only the current handle is known.
    """
    if isinstance(result, Mapping) and isinstance(result.get("attempts"), list):
        source, items = "result", result["attempts"]
    else:
        state = _unwrap(next_kwargs or {}).get("state") if isinstance(next_kwargs, Mapping) \
            else None
        if isinstance(state, Mapping) and isinstance(state.get("attempts"), list) \
                and state["attempts"]:
            source, items = "running", state["attempts"]
        elif isinstance(handle, Mapping) and handle.get("job_id"):
            source, items = "handle", [handle]
        else:
            return [], "none"
    attempts = [{k: a.get(k) for k in _ATTEMPT_FIELDS} for a in items if isinstance(a, Mapping)]
    return attempts, source


def _handle_extra(handle: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Backend details worth showing (namespace, instance ids, log path); never credentials."""
    extra = handle.get("extra")
    if not isinstance(extra, Mapping):
        return []
    out = []
    for key, value in sorted(extra.items()):
        if _SECRETISH.search(str(key)) or isinstance(value, Mapping):
            continue
        if isinstance(value, list):
            if not all(isinstance(v, (str, int, float, bool)) or v is None for v in value):
                continue
            value = ", ".join(str(v) for v in value)
        out.append((str(key), "" if value is None else str(value)))
    return out


def _job_summary(ti: Any, xcoms: Mapping[str, Any]) -> dict[str, Any]:
    """One row of the jobs list (also the JSON form)."""
    handle = xcoms.get(XCOM_HANDLE) if isinstance(xcoms.get(XCOM_HANDLE), Mapping) else {}
    placement = xcoms.get(XCOM_PLACEMENT) \
        if isinstance(xcoms.get(XCOM_PLACEMENT), Mapping) else {}
    result = xcoms.get(XCOM_RESULT)
    result = result if isinstance(result, Mapping) and "attempts" in result else {}
    attempts, source = _attempts(result, handle, getattr(ti, "next_kwargs", None))
    chosen = placement.get("chosen") if isinstance(placement.get("chosen"), Mapping) else {}
    return {
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": ti.task_id,
        "map_index": ti.map_index,
        "try_number": ti.try_number,
        "state": str(ti.state.value if hasattr(ti.state, "value") else ti.state or "none"),
        "operator": getattr(ti, "operator", None),
        "start_date": ti.start_date.isoformat() if ti.start_date else None,
        "end_date": ti.end_date.isoformat() if ti.end_date else None,
        "connection": result.get("connection") or handle.get("connection")
        or chosen.get("connection"),
        "location": result.get("location") or handle.get("location") or chosen.get("location"),
        "backend": result.get("backend") or handle.get("backend") or chosen.get("backend"),
        "accelerator": handle.get("accelerator") or chosen.get("accelerator"),
        "job_id": result.get("job_id") or handle.get("job_id"),
        "job_name": result.get("job_name") or handle.get("job_name"),
        "attempts": len(attempts),
        "attempts_source": source,
        "gpu_hours": result.get("gpu_hours"),
        "cost": result.get("cost"),
        "placement_summary": placement.get("summary"),
        "policy": placement.get("policy"),
    }


def _load_xcoms(session: Any, keys: Iterable[tuple[str, str, str, int]]
                ) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    wanted = set(keys)
    if not wanted:
        return {}
    dag_ids = {k[0] for k in wanted}
    run_ids = {k[1] for k in wanted}
    stmt = select(XComModel).where(
        XComModel.key.in_((XCOM_HANDLE, XCOM_PLACEMENT, XCOM_RESULT)),
        XComModel.dag_id.in_(dag_ids), XComModel.run_id.in_(run_ids))
    out: dict[tuple[str, str, str, int], dict[str, Any]] = {k: {} for k in wanted}
    for row in session.scalars(stmt):
        key = (row.dag_id, row.run_id, row.task_id, row.map_index)
        if key in out:
            out[key][row.key] = _xcom_value(row)
    return out


def list_jobs(user: Any, limit: int = 100, dag_id: str | None = None) -> list[dict[str, Any]]:
    """Recent task instances that wrote SkyPilot XComs, newest first, that ``user`` may read."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import and_, func, select

    readable = _readable_dag_ids(user)
    if dag_id is not None:
        readable &= {dag_id}
    if not readable:
        return []
    with create_session() as session:
        marks = (
            select(XComModel.dag_id, XComModel.run_id, XComModel.task_id, XComModel.map_index,
                   func.max(XComModel.timestamp).label("ts"))
            .where(XComModel.key.in_((XCOM_HANDLE, XCOM_PLACEMENT)),
                   XComModel.dag_id.in_(readable))
            .group_by(XComModel.dag_id, XComModel.run_id, XComModel.task_id,
                      XComModel.map_index)
            .subquery()
        )
        stmt = (
            select(TI, marks.c.ts)
            .join(marks, and_(TI.dag_id == marks.c.dag_id, TI.run_id == marks.c.run_id,
                              TI.task_id == marks.c.task_id,
                              TI.map_index == marks.c.map_index))
            .order_by(func.coalesce(TI.start_date, marks.c.ts).desc(), TI.dag_id, TI.task_id,
                      TI.map_index)
            .limit(limit)
        )
        tis = [row[0] for row in session.execute(stmt)]
        teams = _team_names(sorted({ti.dag_id for ti in tis}))
        allowed = {d: _can_read_job(user, d, teams.get(d)) for d in {ti.dag_id for ti in tis}}
        tis = [ti for ti in tis if allowed[ti.dag_id]]
        xcoms = _load_xcoms(session, [(t.dag_id, t.run_id, t.task_id, t.map_index) for t in tis])
        return [_job_summary(ti, xcoms[(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)])
                for ti in tis]


def load_job(dag_id: str, run_id: str, task_id: str, map_index: int) -> dict[str, Any] | None:
    """Everything the job page shows for one task instance; None if there is no such TI."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        ti = session.scalar(select(TI).where(TI.dag_id == dag_id, TI.run_id == run_id,
                                             TI.task_id == task_id, TI.map_index == map_index))
        if ti is None:
            return None
        key = (dag_id, run_id, task_id, map_index)
        xcoms = _load_xcoms(session, [key])[key]
        summary = _job_summary(ti, xcoms)
        handle = xcoms.get(XCOM_HANDLE) if isinstance(xcoms.get(XCOM_HANDLE), Mapping) else None
        placement = xcoms.get(XCOM_PLACEMENT) \
            if isinstance(xcoms.get(XCOM_PLACEMENT), Mapping) else None
        result = xcoms.get(XCOM_RESULT)
        result = result if isinstance(result, Mapping) and "attempts" in result else None
        attempts, source = _attempts(result, handle, ti.next_kwargs)
        return {
            "task_instance": summary,
            "handle": {k: handle.get(k) for k in _HANDLE_FIELDS} if handle else None,
            "handle_extra": dict(_handle_extra(handle)) if handle else {},
            "placement": _clean_placement(placement),
            "result": {k: v for k, v in result.items() if k != "attempts"} if result else None,
            "attempts": attempts,
            "attempts_source": source,
        }


_ROW_FIELDS = ("verdict", "connection", "location", "request", "free", "start", "price",
               "reason", "rank")


def _clean_placement(placement: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not placement:
        return None
    rows = placement.get("rows") if isinstance(placement.get("rows"), list) else []
    chosen = placement.get("chosen") if isinstance(placement.get("chosen"), Mapping) else None
    return {
        "policy": placement.get("policy"),
        "summary": placement.get("summary"),
        "chosen": {k: chosen.get(k) for k in ("connection", "backend", "location", "infra",
                                               "accelerator", "num_nodes", "price_per_hour",
                                               "spot", "instance_type")} if chosen else None,
        "rows": [{k: r.get(k) for k in _ROW_FIELDS} for r in rows if isinstance(r, Mapping)],
    }


# --- capacity -----------------------------------------------------------------------------------
_capacity_cache: dict[tuple[str, ...], tuple[float, list[dict[str, Any]], float]] = {}
_capacity_locks: dict[tuple[str, ...], threading.Lock] = {}
_capacity_guard = threading.Lock()


def default_connections() -> list[str]:
    """``[skypilot] connections`` (the operator's default)."""
    from airflow.configuration import conf

    raw = conf.get("skypilot", "connections", fallback="") or ""
    return [c.strip() for c in raw.split(",") if c.strip()]


def _probe_timeout() -> float:
    from airflow.configuration import conf

    try:
        configured = conf.getfloat("skypilot", "probe_timeout", fallback=60.0)
    except Exception:
        configured = 60.0
    return max(1.0, min(configured, CAPACITY_MAX_TIMEOUT))


def probe_capacity(conn_ids: list[str], timeout: float, refresh: bool = False
                   ) -> tuple[list[dict[str, Any]], float, float]:
    """``show-gpus`` rows for ``conn_ids`` (blocking; run it in a thread), cached briefly.

    Concurrent requests for the same connections share one probe.
    """
    key = tuple(conn_ids)
    with _capacity_guard:
        lock = _capacity_locks.setdefault(key, threading.Lock())
    with lock:
        cached = _capacity_cache.get(key)
        if cached and not refresh and time.time() - cached[0] < CAPACITY_TTL:
            return cached[1], cached[0], cached[2]
        from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook

        start = time.monotonic()
        try:
            rows = [r.to_json() for r in SkyPilotCapacityHook(conn_ids, timeout=timeout)
                    .capacity()]
        except Exception as exc:  # the hook reports per connection; this is a last resort
            log.exception("Capacity probe failed")
            rows = [{"connection": c, "location": "", "accelerator": None,
                     "error": f"{type(exc).__name__}: {exc}"} for c in conn_ids]
        seconds = time.monotonic() - start
        _capacity_cache[key] = (time.time(), rows, seconds)
        return rows, _capacity_cache[key][0], seconds


async def capacity_for(user: Any, conn_ids: list[str], refresh: bool) -> dict[str, Any]:
    """Probe the connections the user may read, off the event loop, with a deadline.

    The probe (SSH, HTTP) runs in the same worker threads as FastAPI's sync routes; the hook
    bounds each connection by the probe timeout, and this waits a little longer at most.
    """
    allowed = await anyio.to_thread.run_sync(
        lambda: [c for c in conn_ids if _can_read_connection(user, c)])
    denied = [c for c in conn_ids if c not in allowed]
    timeout = _probe_timeout()
    rows: list[dict[str, Any]] = []
    probed_at, seconds = time.time(), 0.0
    if allowed:
        answer = None
        with anyio.move_on_after(timeout + 10):
            answer = await anyio.to_thread.run_sync(probe_capacity, allowed, timeout, refresh,
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
            "timeout": timeout, "ttl": CAPACITY_TTL, "rows": rows}


def _requested_connections(conn: list[str] | None) -> list[str]:
    given = [part.strip() for value in conn or [] for part in value.split(",")]
    conns = list(dict.fromkeys(c for c in given if c)) or default_connections()
    bad = [c for c in conns if not _CONN_ID.match(c)]
    if bad:
        raise HTTPException(400, f"not a connection id: {bad[0][:80]!r}")
    if len(conns) > MAX_CONNECTIONS:
        raise HTTPException(400, f"at most {MAX_CONNECTIONS} connections at a time")
    return conns


# --- the app ------------------------------------------------------------------------------------
app = FastAPI(title="SkyPilot for Airflow", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """JSON for the API; for pages, Airflow's login on 401 and a readable page otherwise."""
    if _is_api(request):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
    if exc.status_code == 401:
        login = f"{_ui_base(request)}/api/v2/auth/login?{urlencode({'next': str(request.url)})}"
        return RedirectResponse(login, status_code=303)
    titles = {403: "Not allowed", 404: "Not found", 400: "Bad request"}
    return _render(request, "error.html", status_code=exc.status_code,
                   title=titles.get(exc.status_code, "Error"), detail=str(exc.detail))


@app.get("/", include_in_schema=False)
def index(request: Request) -> RedirectResponse:
    return RedirectResponse(f"{_prefix(request)}/jobs", status_code=303)


@app.get("/icon.svg", include_in_schema=False)
def icon() -> Response:
    """The nav icon (served here so no static files need packaging)."""
    return Response(ICON_SVG, media_type="image/svg+xml",
                    headers={"Cache-Control": "public, max-age=86400"})


def _with_links(request: Request, job: dict[str, Any]) -> dict[str, Any]:
    args = (job["dag_id"], job["run_id"], job["task_id"], job["map_index"])
    return {**job, "job_url": _job_path(request, *args),
            "ui_url": _ti_ui_path(_ui_base(request), *args)}


@app.get("/api/jobs")
def api_jobs(request: Request, user: UserDep,
             limit: Annotated[int, Query(ge=1, le=500)] = 100,
             dag_id: str | None = None) -> JSONResponse:
    jobs = [_with_links(request, j) for j in list_jobs(user, limit, dag_id)]
    return JSONResponse({"jobs": jobs, "total_entries": len(jobs)})


@app.get("/jobs", response_class=HTMLResponse)
def jobs_page(request: Request, user: UserDep,
              limit: Annotated[int, Query(ge=1, le=500)] = 100,
              dag_id: str | None = None) -> HTMLResponse:
    jobs = [_with_links(request, j) for j in list_jobs(user, limit, dag_id)]
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job["state"]] = counts.get(job["state"], 0) + 1
    return _render(request, "jobs.html", title="SkyPilot jobs", page="jobs", jobs=jobs,
                   counts=sorted(counts.items()), limit=limit, dag_id=dag_id,
                   user_name=_user_name(user))


def _job_or_error(user: Any, dag_id: str, run_id: str, task_id: str, map_index: int
                  ) -> dict[str, Any]:
    teams = _team_names([dag_id])
    if not _can_read_job(user, dag_id, teams.get(dag_id)):
        raise HTTPException(403, f"You may not read task instances and XComs of DAG {dag_id!r}.")
    job = load_job(dag_id, run_id, task_id, map_index)
    if job is None:
        where = f"{dag_id} / {run_id} / {task_id}" + (f" [{map_index}]" if map_index >= 0
                                                       else "")
        raise HTTPException(404, f"No task instance {where}.")
    return job


@app.get("/api/jobs/{dag_id}/{run_id}/{task_id}")
@app.get("/api/jobs/{dag_id}/{run_id}/{task_id}/{map_index}")
def api_job(request: Request, user: UserDep, dag_id: str, run_id: str, task_id: str,
            map_index: str = "-1") -> JSONResponse:
    job = _job_or_error(user, dag_id, run_id, task_id, _parse_map_index(map_index))
    job["task_instance"] = _with_links(request, job["task_instance"])
    return JSONResponse(job)


@app.get("/jobs/{dag_id}/{run_id}/{task_id}", response_class=HTMLResponse)
@app.get("/jobs/{dag_id}/{run_id}/{task_id}/{map_index}", response_class=HTMLResponse)
def job_page(request: Request, user: UserDep, dag_id: str, run_id: str, task_id: str,
             map_index: str = "-1") -> HTMLResponse:
    index_ = _parse_map_index(map_index)
    job = _job_or_error(user, dag_id, run_id, task_id, index_)
    ti = _with_links(request, job["task_instance"])
    return _render(request, "job.html", title=f"{task_id} · {dag_id}", page="job", job=job,
                   ti=ti, user_name=_user_name(user),
                   json_url=f"{_prefix(request)}/api"
                            + job_path(dag_id, run_id, task_id, index_)[len(PLUGIN_PREFIX):])


@app.get("/api/capacity")
async def api_capacity(user: UserDep, conn: Annotated[list[str] | None, Query()] = None,
                       refresh: bool = False) -> JSONResponse:
    return JSONResponse(await capacity_for(user, _requested_connections(conn), refresh))


@app.get("/capacity", response_class=HTMLResponse)
async def capacity_page(request: Request, user: UserDep,
                        conn: Annotated[list[str] | None, Query()] = None,
                        refresh: bool = False) -> HTMLResponse:
    conns = _requested_connections(conn)
    data = await capacity_for(user, conns, refresh) if conns else None
    groups: list[dict[str, Any]] = []
    for row in (data or {}).get("rows", []):
        if not groups or groups[-1]["connection"] != row.get("connection"):
            groups.append({"connection": row.get("connection"), "rows": [], "free": 0,
                           "total": 0, "errors": 0})
        group = groups[-1]
        group["rows"].append(row)
        group["free"] += int(row.get("free") or 0) if row.get("accelerator") else 0
        group["total"] += int(row.get("total") or 0) if row.get("accelerator") else 0
        group["errors"] += 1 if row.get("error") else 0
    query = urlencode([("conn", c) for c in conn or []])
    return _render(request, "capacity.html", title="SkyPilot capacity", page="capacity",
                   data=data, groups=groups, conns=conns, explicit=bool(conn),
                   query=query, user_name=_user_name(user))


ICON_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" '
    'stroke="#4f6bed" stroke-width="2" stroke-linecap="round" stroke-linejoin="round">'
    '<path d="M3 17l6-6 4 4 8-8"/><path d="M14 7h7v7"/></svg>'
)

NAV_JOBS = {
    "name": "SkyPilot jobs",
    "href": "skypilot/jobs",
    "url_route": "skypilot-jobs",
    "destination": "nav",
    "category": "browse",
    "icon": "skypilot/icon.svg",
}
NAV_CAPACITY = {
    "name": "SkyPilot capacity",
    "href": "skypilot/capacity",
    "url_route": "skypilot-capacity",
    "destination": "nav",
    "category": "browse",
    "icon": "skypilot/icon.svg",
}
TI_TAB = {
    "name": "SkyPilot",
    # the UI fills these in (URL-encoded); {MAP_INDEX} stays literal on unmapped tasks
    "href": "skypilot/jobs/{DAG_ID}/{RUN_ID}/{TASK_ID}/{MAP_INDEX}",
    "url_route": "skypilot",
    "destination": "task_instance",
    "icon": "skypilot/icon.svg",
}


class SkyPilotPlugin(AirflowPlugin):
    """Registers the SkyPilot pages on the API server and in the Airflow UI's navigation."""

    name = "skypilot"
    fastapi_apps = [{"app": app, "url_prefix": PLUGIN_PREFIX, "name": "SkyPilot"}]
    external_views = [NAV_JOBS, NAV_CAPACITY, TI_TAB]
