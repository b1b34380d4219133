"""Sensors: wait for a SkyPilot job submitted earlier."""

from airflow_skypilot.sensors.skypilot import SkyPilotJobSensor

__all__ = ["SkyPilotJobSensor"]
