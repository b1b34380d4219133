"""The Airflow UI plugin (``airflow_skypilot.plugins.skypilot.SkyPilotPlugin``).

Nothing is imported here: Airflow imports the plugin class by its full path, and importing this
package must not pull FastAPI and the pages into processes that only need the operator.
"""

from __future__ import annotations
