"""The job data the pages show, read from the metadata DB: task instances and their XComs.

Job data comes from the XComs the operator writes (``skypilot_handle``, ``skypilot_placement``,
``return_value``) and, while a task is deferred, from the run state it handed its trigger
(``next_kwargs``) and what the trigger saw since (``skypilot_watch``: the job's start, the looks
at it while it waits); env values and secrets are never in them, and handle extras that look like
credentials are not returned. The attempt record and the XCom keys are the operator's own
(:mod:`airflow_skypilot.runstate`, which stays cheap to import).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from airflow.sdk import BaseXCom

from airflow_skypilot import zones
from airflow_skypilot.plugins.auth import can_read_job, readable_dag_ids, team_names
from airflow_skypilot.plugins.formatting import as_datetime
from airflow_skypilot.runstate import XCOM_HANDLE, XCOM_PLACEMENT, XCOM_WATCH, Attempt, RunState

XCOM_RESULT = BaseXCom.XCOM_RETURN_KEY
_SECRETISH = re.compile(r"env|secret|token|password|passwd|credential|key", re.IGNORECASE)


def unwrap(value: Any) -> Any:
    """Undo Airflow's wrappers in ``next_kwargs`` (serde's ``__classname__/__data__``, older
    ``__type/__var``); plain JSON passes through."""
    if isinstance(value, Mapping):
        if "__var" in value and "__type" in value:
            return unwrap(value["__var"])
        if "__data__" in value and "__classname__" in value:
            return unwrap(value["__data__"])
        return {k: unwrap(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unwrap(v) for v in value]
    return value


def xcom_value(row: Any) -> Any:
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


_HANDLE_FIELDS = ("backend", "connection", "location", "infra", "job_id", "job_name",
                  "num_nodes", "accelerator", "gpus_per_node", "price_per_hour", "submitted_at",
                  "adopted")


def attempts_of(result: Any, handle: Any, next_kwargs: Any
                ) -> tuple[list[dict[str, Any]], str]:
    """The attempt history and where it came from.

    The result (on success) has every attempt; while a deferred task waits, the run state the
    operator handed to its trigger does; otherwise only the current handle is known.
    """
    if isinstance(result, Mapping) and isinstance(result.get("attempts"), list):
        source, items = "result", result["attempts"]
    else:
        state = deferred_state(next_kwargs)
        running = RunState.from_dict(state).attempts if isinstance(state, Mapping) else []
        if running:
            source, items = "running", [a.to_dict() for a in running]
        elif isinstance(handle, Mapping) and handle.get("job_id"):
            source, items = "handle", [handle]
        else:
            return [], "none"
    return [Attempt.ui_view(a) for a in items if isinstance(a, Mapping)], source


def deferred_state(next_kwargs: Any) -> Mapping[str, Any] | None:
    """The run state a deferred task handed its trigger (None when there is none)."""
    if not isinstance(next_kwargs, Mapping):
        return None
    state = unwrap(next_kwargs).get("state")
    return state if isinstance(state, Mapping) else None


def watch_view(attempts: list[dict[str, Any]], source: str, watch: Any,
               next_kwargs: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The attempts with what the watch saw since the deferral (the current job's start), and
    the looks at the job while it waited: ``{"looks", "looks_total", "seen"}``."""
    state = deferred_state(next_kwargs) or {}
    watch = watch if isinstance(watch, Mapping) else {}
    looks = watch.get("looks") if isinstance(watch.get("looks"), list) else state.get("looks")
    total = watch.get("looks_total") if looks is watch.get("looks") else \
        state.get("looks_total")
    looks = [dict(x) for x in looks or [] if isinstance(x, Mapping)]
    current = attempts[-1] if attempts else None
    seen = None
    if current and watch and str(watch.get("job_id")) == str(current.get("job_id")) \
            and watch.get("connection") == current.get("connection"):
        seen = {k: watch.get(k) for k in ("state", "seen_at", "started_at", "est_start")}
        if source == "running" and watch.get("state") == "running" \
                and current.get("state") in (None, "pending"):
            attempts = [*attempts[:-1], {**current, "state": "running", "started_at":
                                         current.get("started_at") or watch.get("started_at")
                                         or watch.get("seen_at")}]
    return attempts, {"looks": looks, "looks_total": int(total or len(looks)), "seen": seen}


def waiting_view(ti_state: str, attempts: list[dict[str, Any]], source: str,
                 looks: list[dict[str, Any]], placement: Mapping[str, Any] | None,
                 looks_total: int = 0) -> dict[str, Any] | None:
    """A deferred job still queued: where it waits, since when, its estimated start (from the
    last look there, else from its placement) and the last look; None for any other job."""
    if ti_state != "deferred" or source != "running" or not attempts:
        return None
    current = attempts[-1]
    if current.get("state") not in (None, "pending"):
        return None
    place = f"{current.get('connection')}/{current.get('location')}"
    here = [x for x in looks if x.get("place") == place]
    est = here[-1].get("est_start") if here else None
    if est is None:
        arrived = [x for x in looks if x.get("outcome") == "moved" and x.get("best") == place]
        est = arrived[-1].get("best_start") if arrived else None
    if est is None and placement:
        chosen = placement.get("chosen") if isinstance(placement.get("chosen"), Mapping) else {}
        if f"{chosen.get('connection')}/{chosen.get('location')}" == place:
            est = chosen.get("est_start")
    return {"place": place, "connection": current.get("connection"),
            "location": current.get("location"), "job_id": current.get("job_id"),
            "since": current.get("submitted_at"), "est_start": est,
            "looks_total": looks_total or sum(int(x.get("count") or 1) for x in looks),
            "last_look": looks[-1] if looks else None}


def handle_extra(handle: Mapping[str, Any]) -> list[tuple[str, str]]:
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


def job_summary(ti: Any, xcoms: Mapping[str, Any]) -> dict[str, Any]:
    """One row of the jobs list (also the JSON form)."""
    handle = xcoms.get(XCOM_HANDLE) if isinstance(xcoms.get(XCOM_HANDLE), Mapping) else {}
    placement = xcoms.get(XCOM_PLACEMENT) \
        if isinstance(xcoms.get(XCOM_PLACEMENT), Mapping) else {}
    result = xcoms.get(XCOM_RESULT)
    result = result if isinstance(result, Mapping) and "attempts" in result else {}
    next_kwargs = getattr(ti, "next_kwargs", None)
    attempts, source = attempts_of(result, handle, next_kwargs)
    attempts, seen = watch_view(attempts, source, xcoms.get(XCOM_WATCH), next_kwargs)
    chosen = placement.get("chosen") if isinstance(placement.get("chosen"), Mapping) else {}
    state = str(ti.state.value if hasattr(ti.state, "value") else ti.state or "none")
    return {
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": ti.task_id,
        "map_index": ti.map_index,
        "try_number": ti.try_number,
        "state": state,
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
        "waiting": waiting_view(state, attempts, source, seen["looks"], placement,
                                seen["looks_total"]),
        "job_state": attempts[-1].get("state") if attempts else None,
    }


#: task instances per XCom query: 4 bind parameters each, under SQLite's old limit of 999
XCOM_CHUNK = 200


def load_xcoms(session: Any, keys: Iterable[tuple[str, str, str, int]]
                ) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    """The SkyPilot XComs of exactly these task instances: matching on dag_id and run_id alone
    would read every task's ``return_value`` in those runs (any size, any operator) and every
    sibling's of a mapped one. A row-value IN works on SQLite, Postgres and MySQL alike."""
    from airflow.models.xcom import XComModel
    from sqlalchemy import select, tuple_

    wanted = sorted(set(keys))
    out: dict[tuple[str, str, str, int], dict[str, Any]] = {k: {} for k in wanted}
    ti_key = tuple_(XComModel.dag_id, XComModel.run_id, XComModel.task_id, XComModel.map_index)
    for i in range(0, len(wanted), XCOM_CHUNK):
        stmt = select(XComModel).where(
            XComModel.key.in_((XCOM_HANDLE, XCOM_PLACEMENT, XCOM_RESULT, XCOM_WATCH)),
            ti_key.in_(wanted[i:i + XCOM_CHUNK]))
        for row in session.scalars(stmt):
            key = (row.dag_id, row.run_id, row.task_id, row.map_index)
            if key in out:
                out[key][row.key] = xcom_value(row)
    return out


#: deferred SkyPilot task instances (waiting in a queue, or running) listed at most, the most
#: recently started first: they are listed whatever ran since, not only among the newest
MAX_DEFERRED = 500


def list_jobs(user: Any, limit: int = 100, dag_id: str | None = None) -> list[dict[str, Any]]:
    """The task instances that wrote SkyPilot XComs that ``user`` may read, newest first: every
    deferred one (up to :data:`MAX_DEFERRED`), however long ago it started, and the ``limit``
    newest of the others.

    A job queued for a day is still waiting: taking the waiting ones from the newest ``limit``
    would drop it once ``limit`` newer ones ran. Deferred task instances are few (each is a
    trigger) and found by state (indexed), each checked for a SkyPilot XCom by the XCom's
    task-instance index; the others exclude them, so no job is listed twice."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import and_, exists, func, or_, select

    readable = readable_dag_ids(user)
    if dag_id is not None:
        readable &= {dag_id}
    if not readable:
        return []
    deferred = TaskInstanceState.DEFERRED
    with create_session() as session:
        skypilot = exists().where(
            XComModel.dag_id == TI.dag_id, XComModel.task_id == TI.task_id,
            XComModel.run_id == TI.run_id, XComModel.map_index == TI.map_index,
            XComModel.key.in_((XCOM_HANDLE, XCOM_PLACEMENT)))
        waiting = session.scalars(
            select(TI).where(TI.state == deferred, TI.dag_id.in_(readable), skypilot)
            .order_by(TI.start_date.desc(), TI.dag_id, TI.task_id, TI.map_index)
            .limit(MAX_DEFERRED)).all()
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
            .where(or_(TI.state.is_(None), TI.state != deferred))
            .order_by(func.coalesce(TI.start_date, marks.c.ts).desc(), TI.dag_id, TI.task_id,
                      TI.map_index)
            .limit(limit)
        )
        rows = [(ti, ti.start_date) for ti in waiting] + [
            (ti, ti.start_date or ts) for ti, ts in session.execute(stmt)]
        # two statements, two snapshots (Postgres' READ COMMITTED): a task that left
        # "deferred" between them is in both
        seen: set[tuple[str, str, str, int]] = set()
        tis = [ti for ti, _ in sorted(rows, key=_newest_first)
               if (key := (ti.dag_id, ti.run_id, ti.task_id, ti.map_index)) not in seen
               and not seen.add(key)]
        teams = team_names(sorted({ti.dag_id for ti in tis}))
        allowed = {d: can_read_job(user, d, teams.get(d)) for d in {ti.dag_id for ti in tis}}
        tis = [ti for ti in tis if allowed[ti.dag_id]]
        xcoms = load_xcoms(session, [(t.dag_id, t.run_id, t.task_id, t.map_index) for t in tis])
        return [job_summary(ti, xcoms[(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)])
                for ti in tis]


def _newest_first(row: tuple[Any, Any]) -> tuple[Any, ...]:
    """The others' query's order (start, else last SkyPilot XCom, newest first), in Python:
    the deferred ones join them there."""
    ti, when = row[0], as_datetime(row[1])
    return (when is None, -when.timestamp() if when else 0.0, ti.dag_id, ti.task_id,
            ti.map_index)


#: map indexes either side of a mapped job that its page links (a sweep may have thousands)
SIBLINGS_NEAR = 10


def _siblings(session: Any, ti: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The instances of a mapped task in its run (its sweep) near this one, in map-index
    order, and the whole sweep's size, states and first and last map index (counted in SQL)."""
    from airflow.models.taskinstance import TaskInstance as TI
    from sqlalchemy import func, select

    if ti.map_index is None or ti.map_index < 0:
        return [], None
    where = (TI.dag_id == ti.dag_id, TI.run_id == ti.run_id, TI.task_id == ti.task_id,
             TI.map_index >= 0)
    counts = session.execute(select(TI.state, func.count(), func.min(TI.map_index),
                                    func.max(TI.map_index)).where(*where).group_by(TI.state))
    states: Counter[str] = Counter()
    ends: list[int] = []
    for state, n, low, high in counts:
        states[str(getattr(state, "value", state) or "none")] += n
        ends += [low, high]
    rows = session.execute(select(TI.map_index, TI.state).where(
        *where, TI.map_index.between(ti.map_index - SIBLINGS_NEAR, ti.map_index + SIBLINGS_NEAR))
        .order_by(TI.map_index))
    near = [{"map_index": index, "state": str(getattr(state, "value", state) or "none")}
            for index, state in rows]
    return near, {"size": sum(states.values()), "states": sorted(states.items()),
                  "first": min(ends, default=None), "last": max(ends, default=None)}


def attempts_and_looks(ti: Any, xcoms: Mapping[str, Any]
                        ) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    handle = xcoms.get(XCOM_HANDLE) if isinstance(xcoms.get(XCOM_HANDLE), Mapping) else None
    result = xcoms.get(XCOM_RESULT)
    result = result if isinstance(result, Mapping) and "attempts" in result else None
    attempts, source = attempts_of(result, handle, ti.next_kwargs)
    attempts, seen = watch_view(attempts, source, xcoms.get(XCOM_WATCH), ti.next_kwargs)
    return attempts, source, seen


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
        xcoms = load_xcoms(session, [key])[key]
        summary = job_summary(ti, xcoms)
        handle = xcoms.get(XCOM_HANDLE) if isinstance(xcoms.get(XCOM_HANDLE), Mapping) else None
        placement = xcoms.get(XCOM_PLACEMENT) \
            if isinstance(xcoms.get(XCOM_PLACEMENT), Mapping) else None
        result = xcoms.get(XCOM_RESULT)
        result = result if isinstance(result, Mapping) and "attempts" in result else None
        attempts, source = attempts_of(result, handle, ti.next_kwargs)
        attempts, seen = watch_view(attempts, source, xcoms.get(XCOM_WATCH), ti.next_kwargs)
        near, counts = _siblings(session, ti)
        return {
            "task_instance": summary,
            "handle": {k: handle.get(k) for k in _HANDLE_FIELDS} if handle else None,
            "handle_extra": dict(handle_extra(handle)) if handle else {},
            "placement": _clean_placement(placement),
            "result": {k: v for k, v in result.items() if k != "attempts"} if result else None,
            "attempts": attempts,
            "attempts_source": source,
            "looks": seen["looks"],
            "looks_total": seen["looks_total"],
            "watch": seen["seen"],
            "waiting": summary["waiting"],
            "sweep": near,
            "sweep_counts": counts,
        }


ROW_FIELDS = ("verdict", "connection", "location", "request", "free", "start", "price",
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
                                               "spot", "instance_type", "est_start")}
        if chosen else None,
        "rows": [{k: r.get(k) for k in ROW_FIELDS} for r in rows if isinstance(r, Mapping)],
    }


def placement_groups(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The placement table as the page shows it: the zones of one region that say the same
    (verdict, request, free, start, price, why) share a row (``zones.group``), which keeps its
    rows (``members``) and says its ranks (``4-9``)."""
    out = []
    for g in zones.group(list(rows), zones.placement_key):
        first = dict(g.first)
        if g.grouped:
            first["location"] = g.location
            first["rank_text"] = zones.ranks_text(r.get("rank") for r in g.rows)
            first["reason"] = zones.without_zone(first.get("reason") or "", g.first) \
                .replace("{zone}", "each zone")
        else:
            first["rank_text"] = "" if first.get("rank") is None else str(first["rank"])
        out.append({"row": first, "members": list(g.rows), "zones": g.zones,
                    "grouped": g.grouped})
    return out
