"""The secret values a task names, found before (and whether or not) it is valid.

They are registered with Airflow's secrets masker as early as possible (the operator does it
right after its templates are rendered, before the rendered fields are stored and before any
log line or validation error could show them): a value that shows up later in a log line, an
exception or the rendered YAML text appears as ``***``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from airflow_skypilot.spec.errors import TaskValidationError
from airflow_skypilot.spec.source import load_yaml
from airflow_skypilot.spec.task import read_task_text


def secret_values(task: Any, overrides: Any = None) -> list[str]:
    """Every value of the task's ``secrets`` (YAML path, YAML text or dict) and of the
    ``overrides`` mapping, as text. Never raises: what cannot be read has no values."""
    found: list[str] = []
    if isinstance(overrides, Mapping):
        found.extend(_leaves(overrides))
    data: Any = task
    if isinstance(task, (str, os.PathLike)):
        try:
            text, name = read_task_text(task)
            sources = load_yaml(text, file=name)
        except (TaskValidationError, OSError, ValueError):
            return found
        data = sources[0].data if sources else None
    if isinstance(data, Mapping) and isinstance(data.get("secrets"), Mapping):
        found.extend(_leaves(data["secrets"]))
    return [v for v in dict.fromkeys(found) if v]


def _leaves(value: Any) -> Iterator[str]:
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif value is not None and not isinstance(value, bool):
        yield str(value)
