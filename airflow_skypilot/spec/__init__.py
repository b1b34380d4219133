"""SkyPilot task YAML: loading, validation with file:line errors, and candidate expansion."""

from airflow_skypilot.spec.errors import Problem, TaskValidationError
from airflow_skypilot.spec.task import ResourceRequest, Task, load_task, request_from_json

__all__ = ["Problem", "ResourceRequest", "Task", "TaskValidationError", "load_task",
           "request_from_json"]
