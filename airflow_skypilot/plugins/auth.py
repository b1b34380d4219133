"""Who is asking, and what they may read: the API server's own user and auth manager.

Every route resolves the caller with the API server's ``get_user`` (the ``_token`` cookie the
Airflow UI sets, or an ``Authorization: Bearer`` JWT) and asks the configured auth manager, so
the pages show exactly what Airflow's REST API would. Airflow's modules are imported inside the
functions: they pull in most of Airflow's models, and every process that loads plugins imports
the plugin.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request


async def current_user(request: Request) -> Any:
    """The caller, as the API server's own routes see it (Bearer JWT first, then the cookie)."""
    from airflow.api_fastapi.core_api import security

    credentials = await security.bearer_scheme(request)
    return await security.get_user(request, None, credentials)


UserDep = Annotated[Any, Depends(current_user)]


def _auth_manager() -> Any:
    from airflow.api_fastapi.app import get_auth_manager

    return get_auth_manager()


def team_names(dag_ids: list[str]) -> dict[str, str | None]:
    try:
        from airflow.models.dag import DagModel

        return DagModel.get_dag_id_to_team_name_mapping(dag_ids)
    except Exception:  # older Airflow without teams: no team scoping
        return {}


def can_read_job(user: Any, dag_id: str, team_name: str | None = None) -> bool:
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


def readable_dag_ids(user: Any) -> set[str]:
    return set(_auth_manager().get_authorized_dag_ids(user=user, method="GET"))


def can_read_connection(user: Any, conn_id: str) -> bool:
    from airflow.api_fastapi.auth.managers.models.resource_details import ConnectionDetails

    team_name = None
    try:
        from airflow.models.connection import Connection

        team_name = Connection.get_team_name(conn_id)
    except Exception:  # no such connection in the DB, or Airflow without teams
        team_name = None
    return bool(_auth_manager().is_authorized_connection(
        method="GET", details=ConnectionDetails(conn_id=conn_id, team_name=team_name), user=user))


def user_name(user: Any) -> str:
    try:
        return str(user.get_name())
    except Exception:
        return ""
