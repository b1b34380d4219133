"""Backends: one module per kind of place a job can run, all behind :class:`Backend`."""

from airflow_skypilot.backends.base import (
    Backend,
    CapacityRow,
    JobHandle,
    JobState,
    JobStatus,
    Offer,
    backend_class,
    backend_for_connection,
    backend_for_handle,
    register_backend,
)

__all__ = ["Backend", "CapacityRow", "JobHandle", "JobState", "JobStatus", "Offer",
           "backend_class", "backend_for_connection", "backend_for_handle", "register_backend"]
