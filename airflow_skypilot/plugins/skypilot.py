"""The SkyPilot UI plugin: where jobs were placed, why, and what capacity there is now.

Airflow loads :class:`SkyPilotPlugin` through the ``airflow.plugins`` entry point. It mounts
the pages (:mod:`~airflow_skypilot.plugins.routes`, a FastAPI app) on the Airflow 3 API server
under ``/skypilot`` and adds them to the UI as nav entries (Browse > SkyPilot jobs / SkyPilot
capacity) and as a "SkyPilot" tab on every task instance (Airflow 3.1+ ``external_views``); the
operator's extra link ("SkyPilot job") points at the task instance page.

The package, by concern:

``routes``      the app: pages, their JSON forms, errors, the icon
``jobs``        job data from the metadata DB (task instances, XComs, the deferred run state)
``capacity``    live capacity, probed off the event loop with a deadline and a short cache
``auth``        the caller and what the auth manager lets them read (as Airflow's REST API)
``formatting``  the Jinja templates (``templates/skypilot``) and their filters

Auth: every route resolves the caller with the API server's own ``get_user`` and asks the
configured auth manager, so the pages show exactly what Airflow's REST API would: job rows only
for DAGs the user may read (and whose XComs and task instances they may read), capacity only
for connections they may read.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_skypilot.links.skypilot import PLUGIN_PREFIX
from airflow_skypilot.plugins.routes import app

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
