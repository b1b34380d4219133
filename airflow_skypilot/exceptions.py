"""Exceptions of the provider, kept apart from Airflow's so the spec and CLI import cheaply."""

from __future__ import annotations


class SkyPilotError(Exception):
    """Base class of the provider's own errors."""


class BackendError(SkyPilotError):
    """A backend (cluster, API, cloud) failed to answer or refused a request."""


class BackendUnreachable(BackendError):
    """The backend could not be reached at all (login node down, API refused, timeout)."""


class SubmissionError(BackendError):
    """A job could not be submitted to the chosen placement."""

    def __init__(self, message: str, *, retry_elsewhere: bool = True):
        super().__init__(message)
        #: True when another placement may well succeed (capacity, quota, node down).
        self.retry_elsewhere = retry_elsewhere


class NoPlacementError(SkyPilotError):
    """No connection offers capacity that fits the task."""


class ConfigurationError(SkyPilotError):
    """The deployment is misconfigured (unknown connection, unsupported connection type):
    retrying or waiting cannot help, so it fails the task at once."""
