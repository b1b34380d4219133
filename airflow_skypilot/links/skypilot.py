"""``SkyPilotJobLink``: the "SkyPilot job" button on a task instance.

It points at the plugin's page for that task instance (placement table, handle, attempts), which
the plugin serves under ``/skypilot`` on the API server. Airflow 3 calls ``get_link`` in the
worker when the task finishes or defers and keeps the URL in XCom, so the URL must be absolute:
it starts at ``[api] base_url`` like the task log URLs Airflow itself builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

#: where the plugin's FastAPI app is mounted on the API server
PLUGIN_PREFIX = "/skypilot"


def job_path(dag_id: str, run_id: str, task_id: str, map_index: int | None = -1) -> str:
    """The plugin path of one task instance's job page (each id quoted as one path segment)."""
    ids = "/".join(quote(str(part), safe="") for part in (dag_id, run_id, task_id))
    path = f"{PLUGIN_PREFIX}/jobs/{ids}"
    return path if map_index is None or int(map_index) < 0 else f"{path}/{int(map_index)}"


def api_base_url() -> str:
    """``[api] base_url`` without its trailing slash (Airflow's own default when unset)."""
    from airflow.sdk.configuration import conf

    base = conf.get("api", "base_url", fallback=None) or "http://localhost:8080/"
    return base.rstrip("/")


def job_url(dag_id: str, run_id: str, task_id: str, map_index: int | None = -1,
            base_url: str | None = None) -> str:
    """The absolute URL of a task instance's job page."""
    base = api_base_url() if base_url is None else base_url.rstrip("/")
    return base + job_path(dag_id, run_id, task_id, map_index)


class SkyPilotJobLink(BaseOperatorLink):
    """Links a SkyPilot task instance to its job, placement and attempts page."""

    name = "SkyPilot job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return job_url(ti_key.dag_id, ti_key.run_id, ti_key.task_id,
                       getattr(ti_key, "map_index", -1))
