"""The pages and their JSON forms: a FastAPI app the plugin mounts under ``/skypilot``.

``/skypilot/jobs``                                    recent SkyPilot task instances, newest first
``/skypilot/jobs/{dag_id}/{run_id}/{task_id}[/{map_index}]``  one task instance: placement table,
                                                      job handle, attempts
``/skypilot/sweeps/{dag_id}/{run_id}/{task_id}[?start=N]``  a sweep's jobs side by side, a page
                                                      of them from map index N
``/skypilot/capacity[?conn=ID...]``                    live GPUs per connection/location/accelerator
``/skypilot/usage[?days=7]``                           GPU-hours and cost per DAG and connection
``/skypilot/api/...``                                  the JSON forms of each

Pages are server-rendered (no build step) with a strict CSP; their pictures are inline SVG
drawn on the server (``charts``). Anonymous callers get 401 (JSON)
or a redirect to Airflow's login (HTML).
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from markupsafe import Markup
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_skypilot import zones
from airflow_skypilot.links.skypilot import PLUGIN_PREFIX, job_path
from airflow_skypilot.plugins import charts
from airflow_skypilot.plugins.auth import UserDep, can_read_job, team_names, user_name
from airflow_skypilot.plugins.capacity import capacity_for, requested_connections
from airflow_skypilot.plugins.formatting import TEMPLATES
from airflow_skypilot.plugins.jobs import MAX_DEFERRED, list_jobs, load_job, placement_groups
from airflow_skypilot.plugins.sweep_views import (
    SWEEP_PAGE,
    group_sweeps,
    load_sweep,
    whole_sweeps,
)
from airflow_skypilot.plugins.usage import PERIODS, usage_for
from airflow_skypilot.runstate import MAX_LOOKS


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


def _sweep_path(request: Request, dag_id: str, run_id: str, task_id: str,
                start: int | None = None) -> str:
    ids = [quote(str(x), safe="") for x in (dag_id, run_id, task_id)]
    path = f"{_prefix(request)}/sweeps/{ids[0]}/{ids[1]}/{ids[2]}"
    return path if not start else f"{path}?start={start}"


def parse_map_index(value: str | int | None) -> int:
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


TEMPLATES.globals.update(
    chart_style=Markup(charts.STYLE), max_looks=MAX_LOOKS,
    timeline_legend=charts.legend((*charts.LEGEND, ("look", "a look while it waited"))),
    capacity_legend=charts.legend((("used", "in use"), ("free", "free"),
                                   ("quota", "startable now under a quota (no fixed total)"),
                                   ("pending", "jobs pending"))))

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
    sweeps = [e["sweep"] for e in group_sweeps(jobs, whole_sweeps(jobs)) if e["sweep"]]
    return JSONResponse({"jobs": jobs, "total_entries": len(jobs), "sweeps": sweeps})


@app.get("/jobs", response_class=HTMLResponse)
def jobs_page(request: Request, user: UserDep,
              limit: Annotated[int, Query(ge=1, le=500)] = 100,
              dag_id: str | None = None) -> HTMLResponse:
    jobs = [_with_links(request, j) for j in list_jobs(user, limit, dag_id)]
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job["state"]] = counts.get(job["state"], 0) + 1
    # a sweep's figures are the whole sweep's (its page's), not those of its listed instances
    entries = group_sweeps(jobs, whole_sweeps(jobs))
    for entry in entries:
        if entry["sweep"]:
            sw = entry["sweep"]
            sw["url"] = _sweep_path(request, sw["dag_id"], sw["run_id"], sw["task_id"])
    waiting = [j for j in jobs if j.get("waiting")]
    return _render(request, "jobs.html", title="SkyPilot jobs", page="jobs", jobs=jobs,
                   entries=entries, counts=sorted(counts.items()), limit=limit,
                   dag_id=dag_id, waiting=waiting, user_name=user_name(user),
                   max_deferred=MAX_DEFERRED if counts.get("deferred", 0) >= MAX_DEFERRED
                   else None)


def _job_or_error(user: Any, dag_id: str, run_id: str, task_id: str, map_index: int
                  ) -> dict[str, Any]:
    teams = team_names([dag_id])
    if not can_read_job(user, dag_id, teams.get(dag_id)):
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
    job = _job_or_error(user, dag_id, run_id, task_id, parse_map_index(map_index))
    job["task_instance"] = _with_links(request, job["task_instance"])
    return JSONResponse(job)


@app.get("/jobs/{dag_id}/{run_id}/{task_id}", response_class=HTMLResponse)
@app.get("/jobs/{dag_id}/{run_id}/{task_id}/{map_index}", response_class=HTMLResponse)
def job_page(request: Request, user: UserDep, dag_id: str, run_id: str, task_id: str,
             map_index: str = "-1") -> HTMLResponse:
    index_ = parse_map_index(map_index)
    job = _job_or_error(user, dag_id, run_id, task_id, index_)
    ti = _with_links(request, job["task_instance"])
    for sibling in job.get("sweep") or []:
        sibling["url"] = _job_path(request, dag_id, run_id, task_id, sibling["map_index"])
    groups = placement_groups(job["placement"]["rows"]) if job.get("placement") else []
    return _render(request, "job.html", title=f"{task_id} · {dag_id}", page="job", job=job,
                   ti=ti, user_name=user_name(user), groups=groups,
                   timeline=charts.timeline(attempt_lanes(job["attempts"], job["looks"])),
                   sweep_url=_sweep_path(request, dag_id, run_id, task_id,
                                         index_ - index_ % SWEEP_PAGE if index_ >= 0 else None),
                   json_url=f"{_prefix(request)}/api"
                            + job_path(dag_id, run_id, task_id, index_)[len(PLUGIN_PREFIX):])


@app.get("/api/capacity")
async def api_capacity(user: UserDep, conn: Annotated[list[str] | None, Query()] = None,
                       refresh: bool = False) -> JSONResponse:
    return JSONResponse(await capacity_for(user, requested_connections(conn), refresh))


@app.get("/capacity", response_class=HTMLResponse)
async def capacity_page(request: Request, user: UserDep,
                        conn: Annotated[list[str] | None, Query()] = None,
                        refresh: bool = False) -> HTMLResponse:
    conns = requested_connections(conn)
    data = await capacity_for(user, conns, refresh) if conns else None
    groups = capacity_groups((data or {}).get("rows", []))
    query = urlencode([("conn", c) for c in conn or []])
    return _render(request, "capacity.html", title="SkyPilot capacity", page="capacity",
                   data=data, groups=groups, conns=conns, explicit=bool(conn),
                   chart=charts.capacity(capacity_bars(groups)), query=query,
                   user_name=user_name(user))


def capacity_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The capacity rows per connection, the zones of one region with the same numbers in one
    row (``zones.group``), each with its member rows. A group's ``total`` counts each GPU once
    (a Slurm node in two partitions is in two rows); ``free`` counts the GPUs whose free count
    is known, ``unknown`` the GPUs whose is not (Kubernetes when pods may not be listed)."""
    groups: list[dict[str, Any]] = []
    for row in rows:
        if not groups or groups[-1]["connection"] != row.get("connection"):
            groups.append({"connection": row.get("connection"), "raw": [], "free": 0,
                           "total": 0, "unknown": 0, "errors": 0, "quota": False,
                           "counted": {}})
        group = groups[-1]
        group["raw"].append(row)
        if row.get("accelerator") and row.get("total") is not None:
            # keyed by node where the row names its nodes: the union, not the sum, of rows
            group["counted"].update(_counted_gpus(row, len(group["raw"])))
        group["quota"] |= bool(row.get("accelerator") and row.get("total") is None
                               and not row.get("error"))
        group["errors"] += 1 if row.get("error") else 0
    for group in groups:
        counted = group.pop("counted").values()
        group["total"] = sum(total for total, _ in counted)
        group["free"] = sum(free for _, free in counted if free is not None)
        group["unknown"] = sum(total for total, free in counted if free is None)
        rows = [{**g.first, "location": g.location, "members": g.rows, "zones": g.zones,
                 "grouped": g.grouped}
                for g in zones.group(group.pop("raw"), zones.capacity_key)]
        # as the CLI: by accelerator, then where (the regions of one accelerator together)
        group["rows"] = sorted(rows, key=lambda r: (bool(r.get("error")),
                                                    r.get("accelerator") or "",
                                                    r.get("location") or ""))
    return groups


def _counted_gpus(row: dict[str, Any], index: int) -> dict[tuple, tuple[int, int | None]]:
    """A counted row's GPUs as ``{key: (total, free or None)}``: per node when the row names
    them (``details.gpus_by_node``, Slurm), else the row as one entry of its own."""
    by_node = (row.get("details") or {}).get("gpus_by_node")
    if by_node:
        kind = (row.get("details") or {}).get("gres") or row.get("accelerator")
        return {("node", name, kind): (int(n.get("total") or 0),
                                       None if n.get("free") is None else int(n["free"]))
                for name, n in by_node.items()}
    free = row.get("free")
    return {("row", index): (int(row.get("total") or 0), None if free is None else int(free))}


def capacity_bars(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One bar per place and accelerator where GPUs are counted (Slurm partitions, Kubernetes
    namespaces); per accelerator where a quota bounds them (an AWS region's quota is shared by
    its zones: the largest zone's number per region, summed over the regions). ``free`` is
    None where it is not known: the bar must not read as "none free"."""
    bars: list[dict[str, Any]] = []
    for group in groups:
        quota: dict[str, dict[str, int | None]] = {}
        for row in group["rows"]:
            acc = row.get("accelerator")
            if not acc or row.get("error"):
                continue
            if row.get("total") is not None:
                free = row.get("free")
                bars.append({"connection": group["connection"],
                             "label": f"{row.get('location') or '-'} · {acc}",
                             "total": int(row["total"]),
                             "free": None if free is None else int(free),
                             "pending": int(row.get("pending") or 0)})
                continue
            for member in row["members"]:
                region = (zones.split(member.get("location") or "") or (member.get("location"),
                                                                       ""))[0]
                per = quota.setdefault(acc, {})
                known = [v for v in (per.get(region), member.get("free")) if v is not None]
                per[region] = max(int(v) for v in known) if known else None
        for acc, regions in sorted(quota.items()):
            known = [v for v in regions.values() if v is not None]
            bars.append({"connection": group["connection"],
                         "label": f"{acc} · {len(regions)} region(s)", "total": None,
                         "free": sum(known) if known else None, "pending": 0})
    return bars


def attempt_lanes(attempts: list[dict[str, Any]], looks: list[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """The job page's timeline: one lane per attempt, the looks on the attempt that waited."""
    lanes = []
    for i, a in enumerate(attempts):
        lanes.append({"label": f"#{i + 1} {a.get('connection') or '?'}",
                      "sublabel": a.get("location") or "",
                      "attempts": [{**a, "number": i + 1}], "looks": []})
    for look in looks:
        place = look.get("place")
        fits = [lane for lane in lanes
                if f"{lane['attempts'][0].get('connection')}/"
                   f"{lane['attempts'][0].get('location')}" == place]
        if fits:
            fits[-1 if len(fits) == 1 else _closest(fits, look)]["looks"].append(look)
    return lanes


def _closest(lanes: list[dict[str, Any]], look: dict[str, Any]) -> int:
    at = float(look.get("last_at") or 0)
    for i, lane in enumerate(lanes):
        a = lane["attempts"][0]
        end = a.get("ended_at")
        if (a.get("submitted_at") or 0) <= at and (end is None or at <= float(end) + 60):
            return i
    return len(lanes) - 1


SweepStart = Annotated[int, Query(ge=0)]
SweepLimit = Annotated[int, Query(ge=1, le=500)]


@app.get("/api/sweeps/{dag_id}/{run_id}/{task_id}")
def api_sweep(request: Request, user: UserDep, dag_id: str, run_id: str, task_id: str,
              start: SweepStart = 0, limit: SweepLimit = SWEEP_PAGE) -> JSONResponse:
    sweep = _sweep_or_error(user, dag_id, run_id, task_id, start, limit)
    for member in sweep["members"]:
        member.update(_with_links(request, member))
    return JSONResponse(sweep)


@app.get("/sweeps/{dag_id}/{run_id}/{task_id}", response_class=HTMLResponse)
def sweep_page(request: Request, user: UserDep, dag_id: str, run_id: str, task_id: str,
               start: SweepStart = 0, limit: SweepLimit = SWEEP_PAGE) -> HTMLResponse:
    sweep = _sweep_or_error(user, dag_id, run_id, task_id, start, limit)
    lanes = []
    for member in sweep["members"]:
        member.update(_with_links(request, member))
        lanes.append({"label": f"[{member['map_index']}]", "url": member["job_url"],
                      "sublabel": f"{member['state']} · {member.get('connection') or '-'}",
                      "attempts": member["attempt_list"], "looks": member["looks"]})
    page = sweep["page"]
    more = "" if limit == SWEEP_PAGE else f"&limit={limit}"
    here = _sweep_path(request, dag_id, run_id, task_id)
    for way in ("previous", "next"):
        page[f"{way}_url"] = None if page[way] is None else f"{here}?start={page[way]}{more}"
    return _render(request, "sweep.html", title=f"{task_id} sweep · {dag_id}", page="jobs",
                   sweep=sweep, s=sweep["sweep"], timeline=charts.timeline(lanes),
                   user_name=user_name(user), pg=page,
                   json_url=f"{_prefix(request)}/api/sweeps/" + "/".join(
                       quote(x, safe="") for x in (dag_id, run_id, task_id))
                   + f"?start={page['start']}{more}")


def _sweep_or_error(user: Any, dag_id: str, run_id: str, task_id: str, start: int = 0,
                    limit: int = SWEEP_PAGE) -> dict[str, Any]:
    teams = team_names([dag_id])
    if not can_read_job(user, dag_id, teams.get(dag_id)):
        raise HTTPException(403, f"You may not read task instances and XComs of DAG {dag_id!r}.")
    sweep = load_sweep(dag_id, run_id, task_id, start, limit)
    if sweep is None:
        raise HTTPException(404, f"No mapped task instances of {dag_id} / {run_id} / {task_id}.")
    return sweep


def _period(days: int) -> int:
    if days not in PERIODS:
        raise HTTPException(400, f"days must be one of {', '.join(map(str, PERIODS))}")
    return days


@app.get("/api/usage")
def api_usage(user: UserDep, days: int = 7) -> JSONResponse:
    return JSONResponse(usage_for(user, _period(days)))


@app.get("/usage", response_class=HTMLResponse)
def usage_page(request: Request, user: UserDep, days: int = 7) -> HTMLResponse:
    data = usage_for(user, _period(days))
    names = list(data["series"])
    return _render(request, "usage.html", title="SkyPilot usage", page="usage", data=data,
                   periods=PERIODS, chart=charts.usage(data["days"], data["series"]),
                   usage_legend=charts.usage_legend(names), user_name=user_name(user))


ICON_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" '
    'stroke="#4f6bed" stroke-width="2" stroke-linecap="round" stroke-linejoin="round">'
    '<path d="M3 17l6-6 4 4 8-8"/><path d="M14 7h7v7"/></svg>'
)
