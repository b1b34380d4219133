"""The ``[skypilot]`` options that more than one part reads (operator, sensor, UI plugin).

Cheap to import (the plugin loads it in the api-server): the configuration is read when asked.
Every option is declared in ``get_provider_info.py``; tests/unit/test_provider.py holds the two
to each other.
"""

from __future__ import annotations


def _conf():
    from airflow.sdk.configuration import conf

    return conf


def default_connections() -> list[str]:
    """``[skypilot] connections``: comma-separated conn ids."""
    conf = _conf()
    raw = conf.get("skypilot", "connections", fallback="") or ""
    return [c.strip() for c in raw.split(",") if c.strip()]


def deployment_id() -> str:
    """``[skypilot] deployment_id``: part of every job's identity, so two Airflow deployments
    sharing a cluster account never adopt or stop each other's jobs."""
    conf = _conf()
    return conf.get("skypilot", "deployment_id", fallback="") or ""


def default_deferrable() -> bool:
    """Deferral is the normal path: on unless ``[skypilot] deferrable = False`` (and
    ``[operators] default_deferrable = True`` always keeps it on)."""
    conf = _conf()
    return conf.getboolean("operators", "default_deferrable", fallback=False) or \
        conf.getboolean("skypilot", "deferrable", fallback=True)
