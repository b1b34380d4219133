"""Operators: ``SkyPilotOperator`` places and runs a SkyPilot task."""

from airflow_skypilot.operators.skypilot import SkyPilotOperator

__all__ = ["SkyPilotOperator"]
