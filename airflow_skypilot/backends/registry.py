"""Which backends exist, read from the backend classes themselves.

A backend class declares its ``name``, the Airflow ``conn_types`` it serves and the task
features it lacks (``unsupported_features``); nothing here repeats them. The built-in backends
are listed below; other packages add theirs through the entry point group
``airflow_skypilot.backends`` (``name = "package.module:BackendClass"``), and tests or plugins
may call :func:`register_backend`. Classes are imported on first use, not at import time, so
the CLI stays quick; each backend module keeps its heavy client imports inside its methods.
"""

from __future__ import annotations

import importlib
import logging
import threading
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from airflow_skypilot.exceptions import ConfigurationError

if TYPE_CHECKING:
    from airflow_skypilot.backends.base import Backend, JobHandle

ENTRY_POINT_GROUP = "airflow_skypilot.backends"
BUILTIN = (
    "airflow_skypilot.backends.slurm:SlurmBackend",
    "airflow_skypilot.backends.kubernetes:KubernetesBackend",
    "airflow_skypilot.backends.aws:AwsBackend",
)

_lock = threading.Lock()
_classes: dict[str, type[Backend]] | None = None
_added: list[type[Backend]] = []
#: entry points that could not be loaded: name -> error (shown by `airflow-skypilot backends`)
load_errors: dict[str, str] = {}


def _import(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _load() -> dict[str, type[Backend]]:
    from airflow_skypilot.backends.base import Backend

    found: list[type[Backend]] = [_import(t) for t in BUILTIN]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # one broken plugin must not take the built-in backends down
            load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            logging.getLogger(__name__).warning("Backend entry point %s=%s failed to load: %s",
                                                ep.name, ep.value, exc)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            load_errors[ep.name] = f"{ep.value} is not a Backend subclass"
            continue
        found.append(cls)
    classes: dict[str, type[Backend]] = {}
    for cls in [*found, *_added]:  # later wins: a registered class may replace a built-in
        classes[cls.name] = cls
    return classes


def backend_classes() -> dict[str, type[Backend]]:
    """Every known backend class by name (built-in, entry points, registered)."""
    global _classes
    with _lock:
        if _classes is None:
            _classes = _load()
        return dict(_classes)


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Add a backend class (usable as a class decorator). Its ``name`` and ``conn_types``
    are read from the class; a class of the same name replaces the earlier one."""
    global _classes
    with _lock:
        _added[:] = [c for c in _added if c.name != cls.name] + [cls]
        if _classes is not None:
            _classes[cls.name] = cls
    return cls


def conn_types() -> dict[str, str]:
    """Airflow connection type -> backend name."""
    out: dict[str, str] = {}
    for name, cls in backend_classes().items():
        for conn_type in cls.conn_types:
            out[conn_type] = name
    return out


def backend_class(name: str) -> type[Backend]:
    classes = backend_classes()
    try:
        return classes[name]
    except KeyError:
        raise ConfigurationError(f"unknown backend {name!r} (known: "
                                 f"{', '.join(sorted(classes))})") from None


def backend_name_for_conn_type(conn_type: str, conn_id: str | None = None) -> str:
    types = conn_types()
    try:
        return types[conn_type]
    except KeyError:
        who = f"connection {conn_id!r} has type {conn_type!r}" if conn_id else \
            f"connection type {conn_type!r}"
        raise ConfigurationError(f"{who}, which no backend serves (supported types: "
                                 f"{', '.join(sorted(types))})") from None


def backend_for_connection(conn_id: str, conn_type: str | None = None) -> Backend:
    """The backend instance for an Airflow connection id (its type picks the backend)."""
    if conn_type is None:
        from airflow_skypilot.compat import get_connection

        try:
            conn = get_connection(conn_id)
        except Exception as exc:
            if type(exc).__name__ in ("AirflowNotFoundException", "ConnectionNotFound") or \
                    "isn't defined" in str(exc):
                raise ConfigurationError(f"connection {conn_id!r} is not defined (supported "
                                         f"types: {', '.join(sorted(conn_types()))})") from None
            raise
        conn_type = conn.conn_type or ""
    return backend_class(backend_name_for_conn_type(conn_type, conn_id))(conn_id)


def backend_for_handle(handle: JobHandle) -> Backend:
    return backend_class(handle.backend)(handle.connection)


def describe() -> list[dict[str, Any]]:
    """One row per backend: what ``airflow-skypilot backends`` prints."""
    rows = []
    for name, cls in sorted(backend_classes().items()):
        rows.append({
            "name": name,
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "conn_types": list(cls.conn_types),
            "unsupported_features": {f.value: why for f, why in
                                     cls.unsupported_features.items()},
        })
    return rows
