"""Operator extra links: from a task instance in the Airflow UI to its SkyPilot job page."""

from __future__ import annotations

from airflow_skypilot.links.skypilot import PLUGIN_PREFIX, SkyPilotJobLink, job_path, job_url

__all__ = ["PLUGIN_PREFIX", "SkyPilotJobLink", "job_path", "job_url"]
