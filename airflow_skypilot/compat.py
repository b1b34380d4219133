"""The few Airflow entry points we use, imported in one place (Airflow 3.1+ task SDK)."""

from __future__ import annotations

from typing import Any


def get_connection(conn_id: str) -> Any:
    """An Airflow connection, from the task SDK when running in a task, else from the DB/env."""
    from airflow.sdk import BaseHook

    return BaseHook.get_connection(conn_id)
