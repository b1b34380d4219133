"""The pages' sweeps: a sweep is the mapped instances of one task in one DAG run (a
``@task.skypilot`` hyperparameter sweep, a mapped operator). The jobs list shows each as one
entry with the whole sweep's figures (:func:`whole_sweeps`, bounded so a list of huge sweeps
stays cheap); its own page (:func:`load_sweep`) shows its instances side by side, a page of
:data:`SWEEP_PAGE` at a time, with the whole sweep's summary.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from airflow_skypilot.plugins.formatting import as_datetime
from airflow_skypilot.plugins.jobs import (
    XCOM_CHUNK,
    XCOM_RESULT,
    attempts_and_looks,
    attempts_of,
    job_summary,
    load_xcoms,
    xcom_value,
)
from airflow_skypilot.runstate import XCOM_HANDLE

#: mapped instances on one page of a sweep, each a lane of its timeline
SWEEP_PAGE = 200


def _sweep_xcoms(session: Any, sweeps: Sequence[tuple[str, str, str]]
                 ) -> dict[tuple[str, str, str, int], dict[str, Any]]:
    """The small XComs of every instance of these sweeps: the result and the handle (not the
    placement, whose rows can be large)."""
    from airflow.models.xcom import XComModel
    from sqlalchemy import select, tuple_

    out: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    for i in range(0, len(sweeps), XCOM_CHUNK):
        stmt = select(XComModel.dag_id, XComModel.run_id, XComModel.task_id,
                      XComModel.map_index, XComModel.key, XComModel.value).where(
            tuple_(XComModel.dag_id, XComModel.run_id, XComModel.task_id)
            .in_(sweeps[i:i + XCOM_CHUNK]), XComModel.map_index >= 0,
            XComModel.key.in_((XCOM_HANDLE, XCOM_RESULT)))
        for row in session.execute(stmt):
            key = (row.dag_id, row.run_id, row.task_id, row.map_index)
            out.setdefault(key, {})[row.key] = xcom_value(row)
    return out


def _sweep_totals(session: Any, tis: Sequence[Any],
                  xcoms: Mapping[tuple[str, str, str, int], Mapping[str, Any]] | None = None
                  ) -> dict[str, Any]:
    """The summary of a whole sweep, from light rows of all its task instances and their small
    XComs (:func:`_sweep_xcoms`, read here unless given); where neither the result nor the
    handle says the connection, the job has no place in the counts yet."""
    first = tis[0]
    if xcoms is None:
        xcoms = _sweep_xcoms(session, [(first.dag_id, first.run_id, first.task_id)])
    members = []
    for ti in tis:
        values = xcoms.get((ti.dag_id, ti.run_id, ti.task_id, ti.map_index), {})
        handle = values.get(XCOM_HANDLE) if isinstance(values.get(XCOM_HANDLE), Mapping) else {}
        result = values.get(XCOM_RESULT)
        result = result if isinstance(result, Mapping) and "attempts" in result else {}
        attempts, _ = attempts_of(result, handle, ti.next_kwargs)
        members.append({
            "dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id,
            "map_index": ti.map_index, "attempts": len(attempts),
            "state": str(getattr(ti.state, "value", ti.state) or "none"),
            "start_date": ti.start_date.isoformat() if ti.start_date else None,
            "connection": result.get("connection") or handle.get("connection"),
            "gpu_hours": result.get("gpu_hours"), "cost": result.get("cost")})
    return sweep_summary(members)


def load_sweep(dag_id: str, run_id: str, task_id: str, start: int = 0,
               limit: int = SWEEP_PAGE) -> dict[str, Any] | None:
    """One page of the mapped instances of one task in one run (a sweep), side by side, from
    map index ``start``: each one's row of the jobs list with its attempts and looks; and the
    whole sweep's summary (a sweep may have thousands). None if it has none."""
    from bisect import bisect_left

    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session
    from sqlalchemy import select

    where = (TI.dag_id == dag_id, TI.run_id == run_id, TI.task_id == task_id, TI.map_index >= 0)
    with create_session() as session:
        light = session.execute(select(
            TI.dag_id, TI.run_id, TI.task_id, TI.map_index, TI.state, TI.start_date,
            TI.next_kwargs).where(*where).order_by(TI.map_index)).all()
        if not light:
            return None
        indexes = [ti.map_index for ti in light]
        pos = bisect_left(indexes, start)
        pos = pos if pos < len(indexes) else max(0, len(indexes) - limit)
        shown = indexes[pos:pos + limit]
        tis = list(session.scalars(select(TI).where(
            *where, TI.map_index.between(shown[0], shown[-1])).order_by(TI.map_index)))
        keys = [(t.dag_id, t.run_id, t.task_id, t.map_index) for t in tis]
        xcoms = load_xcoms(session, keys)
        members = []
        for ti, key in zip(tis, keys, strict=True):
            attempts, source, seen = attempts_and_looks(ti, xcoms[key])
            members.append({**job_summary(ti, xcoms[key]), "attempt_list": attempts,
                            "looks": seen["looks"]})
        page = {"start": shown[0], "limit": limit, "first": pos + 1, "last": pos + len(shown),
                "total": len(indexes),
                "previous": indexes[max(0, pos - limit)] if pos > 0 else None,
                "next": indexes[pos + limit] if pos + limit < len(indexes) else None}
        return {"members": members, "sweep": _sweep_totals(session, light), "page": page}


def group_sweeps(jobs: Sequence[Mapping[str, Any]],
                 totals: Mapping[tuple[str, str, str], Mapping[str, Any]] | None = None
                 ) -> list[dict[str, Any]]:
    """The jobs list as the page shows it: a sweep (several mapped instances of one task in one
    DAG run) is one entry, where its newest instance comes, with its instances in map-index
    order and a summary; every other job is an entry of its own (``sweep`` None).

    ``totals`` (:func:`whole_sweeps`) are the whole sweeps' summaries, each with ``shown``, its
    instances on the list: the list has only the newest of a large sweep's instances, and a
    sum of those would be a smaller sweep than its own page shows. Without them, a summary is
    of the listed instances."""
    entries: list[dict[str, Any]] = []
    mapped: dict[tuple[Any, ...], dict[str, Any]] = {}
    for job in jobs:
        index = job.get("map_index")
        if index is None or index < 0:
            entries.append({"sweep": None, "jobs": [job]})
            continue
        key = (job["dag_id"], job["run_id"], job["task_id"])
        if key not in mapped:
            mapped[key] = {"sweep": None, "jobs": []}
            entries.append(mapped[key])
        mapped[key]["jobs"].append(job)
    for key, entry in mapped.items():
        entry["jobs"].sort(key=lambda j: j["map_index"])
        whole = (totals or {}).get(key)
        if whole is not None and whole["size"] > 1:
            entry["sweep"] = {**whole, "shown": len(entry["jobs"])}
        elif whole is None and len(entry["jobs"]) > 1:
            entry["sweep"] = sweep_summary(entry["jobs"])
    return entries


#: task instances whose XComs one jobs list reads for its sweeps' whole figures (ten sweep
#: pages' worth); sweeps past it show their size and states, counted in SQL, and leave
#: places, GPU-hours and cost to their own page
WHOLE_SWEEPS_BUDGET = 10 * SWEEP_PAGE


def whole_sweeps(jobs: Iterable[Mapping[str, Any]]
                 ) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The whole summary (:func:`_sweep_totals`, as the sweep page's) of the sweep of each mapped
    job on the list, keyed by ``(dag_id, run_id, task_id)``, newest on the list first while
    their sizes fit :data:`WHOLE_SWEEPS_BUDGET`; the rest ``partial``: size, states and first
    start only. Queries per :data:`XCOM_CHUNK` sweeps (row-value IN, as :func:`load_xcoms`)."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session
    from sqlalchemy import func, select, tuple_

    keys = list(dict.fromkeys((j["dag_id"], j["run_id"], j["task_id"]) for j in jobs
                              if j.get("map_index") is not None and j["map_index"] >= 0))
    if not keys:
        return {}
    counts: dict[tuple[str, str, str], Counter] = {}
    first: dict[tuple[str, str, str], Any] = {}
    light: dict[tuple[str, str, str], list[Any]] = {}
    with create_session() as session:
        for i in range(0, len(keys), XCOM_CHUNK):
            for row in session.execute(
                    select(TI.dag_id, TI.run_id, TI.task_id, TI.state, func.count(),
                           func.min(TI.start_date))
                    .where(tuple_(TI.dag_id, TI.run_id, TI.task_id).in_(keys[i:i + XCOM_CHUNK]),
                           TI.map_index >= 0)
                    .group_by(TI.dag_id, TI.run_id, TI.task_id, TI.state)):
                key = (row[0], row[1], row[2])
                counts.setdefault(key, Counter())[
                    str(getattr(row[3], "value", row[3]) or "none")] += row[4]
                if row[5] is not None and (first.get(key) is None or row[5] < first[key]):
                    first[key] = row[5]
        whole, spent = [], 0
        for key in keys:
            size = sum(counts.get(key, Counter()).values())
            if size and spent + size <= WHOLE_SWEEPS_BUDGET:
                whole.append(key)
                spent += size
        for i in range(0, len(whole), XCOM_CHUNK):
            for row in session.execute(select(
                    TI.dag_id, TI.run_id, TI.task_id, TI.map_index, TI.state, TI.start_date,
                    TI.next_kwargs).where(tuple_(TI.dag_id, TI.run_id, TI.task_id)
                                          .in_(whole[i:i + XCOM_CHUNK]), TI.map_index >= 0)
                    .order_by(TI.map_index)):
                light.setdefault((row.dag_id, row.run_id, row.task_id), []).append(row)
        xcoms = _sweep_xcoms(session, list(light))
        out = {key: _sweep_totals(session, tis, xcoms) for key, tis in light.items()}
    for key, states in counts.items():
        if key not in out:
            when = as_datetime(first.get(key))
            out[key] = {"dag_id": key[0], "run_id": key[1], "task_id": key[2],
                        "size": sum(states.values()), "states": sorted(states.items()),
                        "places": [], "attempts": None, "gpu_hours": None, "cost": None,
                        "start_date": when.isoformat() if when else None, "partial": True}
    for summary in out.values():
        summary.pop("map_indexes", None)  # the whole sweep's are its page's, not the list's
    return out


def sweep_summary(members: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One line for a sweep: its size, states, where its jobs run, and the totals."""
    first = members[0]
    places = Counter(j["connection"] for j in members if j.get("connection"))
    starts = [j["start_date"] for j in members if j.get("start_date")]
    known = [j for j in members if j.get("gpu_hours") is not None]
    return {
        "dag_id": first["dag_id"], "run_id": first["run_id"], "task_id": first["task_id"],
        "size": len(members), "map_indexes": [j["map_index"] for j in members],
        "states": sorted(Counter(j["state"] for j in members).items()),
        "places": sorted(places.items(), key=lambda p: (-p[1], p[0])),
        "attempts": sum(j.get("attempts") or 0 for j in members),
        "gpu_hours": round(sum(j["gpu_hours"] for j in known), 6) if known else None,
        "cost": round(sum(j.get("cost") or 0 for j in known), 6) if known else None,
        "start_date": min(starts) if starts else None,
    }
