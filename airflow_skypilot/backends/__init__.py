"""Backends: one package per kind of place a job can run, all behind :class:`Backend`.

``base`` is the protocol and the plain types that cross it; ``registry`` finds the backend
classes (built-in and entry points); ``common`` holds what every backend shares.
"""

from airflow_skypilot.backends.base import (
    Backend,
    CapacityRow,
    JobHandle,
    JobState,
    JobStatus,
    Offer,
)
from airflow_skypilot.backends.registry import (
    backend_class,
    backend_for_connection,
    backend_for_handle,
    register_backend,
)

__all__ = ["Backend", "CapacityRow", "JobHandle", "JobState", "JobStatus", "Offer",
           "backend_class", "backend_for_connection", "backend_for_handle", "register_backend"]
