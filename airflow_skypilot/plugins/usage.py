"""GPU-hours and cost per DAG and per connection over a period, from the results in XCom.

A task's result (``execute_complete``'s return value) has its GPU-hours and cost and every
attempt; an attempt's share is its hours times its GPUs (and price), as the result's totals are
computed. Results written before attempts carried ``gpus`` and ``price_per_hour`` are split over
their attempts by hours. A task counts in the period its result was written in; the chart puts
an attempt's GPU-hours on the day it ended.

Only a try that succeeded leaves its attempts in XCom: the operator keeps them in its run state
(the deferral's ``next_kwargs``, cleared by Airflow when the task ends) and writes them only in
its result. A try that failed, after any number of failovers, leaves only its last job's handle,
and a retry starts with no XComs of the tries before it; a job submitted without waiting
(``wait_for_completion=False``) returns its handle, and its sensor's result has no GPUs. None of
these count: the page says how many tasks of the period failed, and how many results had no
attempts, so the totals read as a lower bound (``not_counted``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_skypilot.plugins.formatting import as_datetime

#: the periods the page offers, in days
PERIODS = (1, 7, 30, 90)
#: results read at most for one page (the newest first)
MAX_RESULTS = 5000


def _hours(a: Mapping[str, Any]) -> float:
    start = as_datetime(a.get("started_at")) or as_datetime(a.get("submitted_at"))
    end = as_datetime(a.get("ended_at"))
    if start is None or end is None:
        return 0.0
    return max(0.0, (end - start).total_seconds() / 3600)


def _day(a: Mapping[str, Any], fallback: datetime) -> str:
    when = as_datetime(a.get("ended_at")) or as_datetime(a.get("submitted_at")) or fallback
    return when.astimezone(timezone.utc).strftime("%Y-%m-%d")


def attempt_shares(result: Mapping[str, Any], when: datetime
                   ) -> list[tuple[str, float, float, str]]:
    """``(connection, gpu_hours, cost, day)`` per attempt of one result."""
    attempts = [a for a in result.get("attempts") or [] if isinstance(a, Mapping)]
    if not attempts:
        conn = str(result.get("connection") or "?")
        return [(conn, float(result.get("gpu_hours") or 0), float(result.get("cost") or 0),
                 when.strftime("%Y-%m-%d"))]
    hours = [_hours(a) for a in attempts]
    if all(a.get("gpus") is not None for a in attempts):
        gh = [h * float(a.get("gpus") or 0) for h, a in zip(hours, attempts, strict=True)]
        cost = [h * float(a.get("price_per_hour") or 0)
                for h, a in zip(hours, attempts, strict=True)]
    else:  # an older result: its totals split by hours (all on the last one without hours)
        total_h = sum(hours)
        weights = [h / total_h for h in hours] if total_h else \
            [0.0] * (len(attempts) - 1) + [1.0]
        gh = [w * float(result.get("gpu_hours") or 0) for w in weights]
        cost = [w * float(result.get("cost") or 0) for w in weights]
    return [(str(a.get("connection") or "?"), g, c, _day(a, when))
            for a, g, c in zip(attempts, gh, cost, strict=True)]


def summarize(results: Iterable[tuple[str, Mapping[str, Any], datetime]], since: datetime,
              until: datetime) -> dict[str, Any]:
    """Totals per DAG and per connection, and GPU-hours per day and connection.

    ``results``: ``(dag_id, result, written_at)`` of the tasks that ended in the period.
    """
    days, day = [], since.astimezone(timezone.utc).date()
    while day <= until.astimezone(timezone.utc).date():
        days.append(day.isoformat())
        day += timedelta(days=1)
    per_dag: dict[str, dict[str, float]] = {}
    per_conn: dict[str, dict[str, float]] = {}
    series: dict[str, dict[str, float]] = {}
    jobs = 0
    for dag_id, result, when in results:
        jobs += 1
        d = per_dag.setdefault(dag_id, {"jobs": 0, "attempts": 0, "gpu_hours": 0.0,
                                        "cost": 0.0})
        d["jobs"] += 1
        d["gpu_hours"] += float(result.get("gpu_hours") or 0)
        d["cost"] += float(result.get("cost") or 0)
        for conn, gh, cost, on in attempt_shares(result, when):
            d["attempts"] += 1
            c = per_conn.setdefault(conn, {"attempts": 0, "gpu_hours": 0.0, "cost": 0.0})
            c["attempts"] += 1
            c["gpu_hours"] += gh
            c["cost"] += cost
            on = max(on, days[0]) if days else on
            series.setdefault(conn, {})
            series[conn][on] = series[conn].get(on, 0.0) + gh

    def ordered(table: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
        return [{"name": k, **{n: round(v, 6) if isinstance(v, float) else v
                               for n, v in row.items()}}
                for k, row in sorted(table.items(), key=lambda kv: (-kv[1]["gpu_hours"],
                                                                    kv[0]))]

    by_conn = ordered(per_conn)
    return {
        "since": since.isoformat(), "until": until.isoformat(), "days": days, "jobs": jobs,
        "gpu_hours": round(sum(r["gpu_hours"] for r in per_dag.values()), 6),
        "cost": round(sum(r["cost"] for r in per_dag.values()), 6),
        "per_dag": ordered(per_dag), "per_connection": by_conn,
        "series": {r["name"]: {k: round(v, 6) for k, v in series.get(r["name"], {}).items()}
                   for r in by_conn},
    }


def usage_for(user: Any, days: int, now: datetime | None = None) -> dict[str, Any]:
    """The results of the SkyPilot tasks that ended in the last ``days`` days, of the DAGs
    ``user`` may read (as the jobs list), summarized."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import and_, select

    from airflow_skypilot.plugins.auth import can_read_job, readable_dag_ids, team_names
    from airflow_skypilot.plugins.jobs import XCOM_RESULT, xcom_value
    from airflow_skypilot.runstate import XCOM_HANDLE

    until = now or datetime.now(timezone.utc)
    since = (until - timedelta(days=days)).replace(hour=0, minute=0, second=0, microsecond=0) \
        if days > 1 else until - timedelta(days=1)
    readable = readable_dag_ids(user)
    rows: list[tuple[str, Mapping[str, Any], datetime]] = []
    truncated = False
    not_counted = {"failed": 0, "no_attempts": 0}
    if readable:
        with create_session() as session:
            handles = (select(XComModel.dag_id, XComModel.run_id, XComModel.task_id,
                              XComModel.map_index)
                       .where(XComModel.key == XCOM_HANDLE, XComModel.dag_id.in_(readable))
                       .subquery())
            stmt = (select(XComModel)
                    .join(handles, and_(XComModel.dag_id == handles.c.dag_id,
                                        XComModel.run_id == handles.c.run_id,
                                        XComModel.task_id == handles.c.task_id,
                                        XComModel.map_index == handles.c.map_index))
                    .where(XComModel.key == XCOM_RESULT, XComModel.timestamp >= since,
                           XComModel.dag_id.in_(readable))
                    .order_by(XComModel.timestamp.desc())
                    .limit(MAX_RESULTS + 1))
            found = list(session.scalars(stmt))
            truncated = len(found) > MAX_RESULTS
            dag_ids = sorted({x.dag_id for x in found})
            teams = team_names(dag_ids)
            allowed = {d: can_read_job(user, d, teams.get(d)) for d in dag_ids}
            for x in found[:MAX_RESULTS]:
                value = xcom_value(x)
                if not allowed.get(x.dag_id):
                    continue
                if isinstance(value, Mapping) and isinstance(value.get("attempts"), list):
                    when = as_datetime(x.timestamp) or until
                    rows.append((x.dag_id, value, when))
                else:  # a handle returned without waiting: no attempts, no GPUs
                    not_counted["no_attempts"] += 1
            not_counted["failed"] = _failed_tasks(session, user, readable, since)
    data = summarize(rows, since, until)
    data.update(period_days=days, truncated=truncated, not_counted=not_counted)
    return data


def _failed_tasks(session: Any, user: Any, readable: set[str], since: datetime) -> int:
    """SkyPilot tasks (a job handle in XCom) that failed in the period, of the DAGs ``user``
    may read: their GPU-hours are not in XCom. By state (indexed), counted per DAG in SQL."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.models.xcom import XComModel
    from airflow.utils.state import TaskInstanceState
    from sqlalchemy import exists, func, select

    from airflow_skypilot.plugins.auth import can_read_job, team_names
    from airflow_skypilot.runstate import XCOM_HANDLE

    handle = exists().where(XComModel.dag_id == TI.dag_id, XComModel.task_id == TI.task_id,
                            XComModel.run_id == TI.run_id, XComModel.map_index == TI.map_index,
                            XComModel.key == XCOM_HANDLE)
    per_dag = dict(session.execute(
        select(TI.dag_id, func.count()).where(
            TI.state == TaskInstanceState.FAILED, TI.dag_id.in_(readable),
            TI.end_date >= since, handle).group_by(TI.dag_id)).all())
    teams = team_names(sorted(per_dag))
    return sum(n for d, n in per_dag.items() if can_read_job(user, d, teams.get(d)))
