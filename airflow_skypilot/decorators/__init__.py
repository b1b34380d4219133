"""TaskFlow decorators: ``@task.skypilot`` (registered in the provider info)."""

from airflow_skypilot.decorators.skypilot import SkyPilotDecoratedOperator, skypilot_task

__all__ = ["SkyPilotDecoratedOperator", "skypilot_task"]
