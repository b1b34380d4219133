"""Envs filled into the task, as SkyPilot fills them, and what is checked only after.

SkyPilot's Task.from_yaml_config (sky/task.py ``_fill_in_env_vars``) fills the task's envs and
inline secrets into ``file_mounts`` (keys and values: paths, bucket names and stores),
``workdir``, ``volumes`` and ``service`` before it reads them: a storage's ``store: $STORE``
is checked with STORE's value, a service's readiness probe with its filled-in path. We fill
the same fields with the same rule (``$NAME`` or ``${NAME}``; a name without a value stays as
written) and check storages, the service and local paths (workdir, file_mounts sources)
afterwards. What these checks say may quote a filled-in value, so secrets are taken out of it
(:func:`redacted`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from airflow_skypilot.spec import service
from airflow_skypilot.spec.errors import Problem
from airflow_skypilot.spec.model import TaskSpec, storage_problem
from airflow_skypilot.spec.source import Source

#: an env reference, as SkyPilot's ``_fill_in_env_vars`` finds them: ``$NAME`` or ``${NAME}``
ENV_REF = re.compile(r"\$\{?\b([a-zA-Z_][a-zA-Z0-9_]*)\b\}?")


def env_refs(value: Any) -> list[str]:
    """The env names ``value`` refers to (keys and values, nested)."""
    if isinstance(value, str):
        return ENV_REF.findall(value)
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in (*env_refs(k), *env_refs(v))]
    if isinstance(value, list):
        return [n for v in value for n in env_refs(v)]
    return []


def substitute(value: Any, env: Mapping[str, str]) -> Any:
    """``value`` with ``$VAR``/``${VAR}`` filled in from ``env`` (keys and values, nested);
    a name not in ``env`` stays as written."""
    if isinstance(value, str):
        return ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)
    if isinstance(value, dict):
        return {substitute(k, env): substitute(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, env) for v in value]
    return value


def storage_problems(spec: TaskSpec, src: Source, env: Mapping[str, str],
                     unfilled: set[str]) -> list[Problem]:
    """Storage mappings of ``file_mounts``, checked once ``env`` is filled in (SkyPilot's
    Storage.from_yaml_config runs after the fill). A mapping that still names an env in
    ``unfilled`` (no value) is not checked: that env is the problem, reported on its own."""
    out = []
    for dst, raw in (spec.file_mounts or {}).items():
        if not isinstance(raw, dict):
            continue
        filled = substitute(raw, env)
        if unfilled and set(env_refs(filled)) & unfilled:
            continue
        why = storage_problem(filled)
        if why and filled != raw:
            why += f" (once envs are filled in; the YAML says {_brief(raw)})"
        if why:
            out.append(src.problem(("file_mounts", dst), why))
    return out


def service_problems(spec: TaskSpec, src: Source, env: Mapping[str, str],
                     unfilled: set[str]) -> list[Problem]:
    """``service`` (envs filled in) and ``pool`` as SkyPilot checks them
    (:mod:`airflow_skypilot.spec.service`); both are then ignored with a warning."""
    filled = substitute(spec.service, env) if spec.service is not None else None
    if filled is not None and unfilled and set(env_refs(filled)) & unfilled:
        return []
    return [src.problem(path, why) for path, why in service.problems(filled, spec.pool)]


def local_path_problems(spec: TaskSpec, src: Source, base_dir: str | None,
                        env: Mapping[str, str], unfilled: set[str]) -> list[Problem]:
    """A local workdir must be a directory and local file_mounts sources must exist (SkyPilot
    checks these before launching, once envs are filled in: ``workdir: $CODE`` is checked
    with CODE's value). Relative paths are relative to the YAML file's folder. A path that
    still names an env in ``unfilled`` (no value) is not checked: that env is the problem,
    reported on its own."""
    out = []
    root = base_dir or os.getcwd()

    def local(path: str) -> str:
        path = os.path.expanduser(path)
        return path if os.path.isabs(path) else os.path.join(root, path)

    def filled(raw: str) -> tuple[str | None, str]:
        """(the path as SkyPilot reads it, or None when an env has no value; how to name it)"""
        path = substitute(raw, env)
        if unfilled and set(env_refs(path)) & unfilled:
            return None, ""
        return path, repr(raw) if path == raw else f"{raw!r} (once envs are filled in: {path!r})"

    if isinstance(spec.workdir, str):
        path, named = filled(spec.workdir)
        if path is not None and not os.path.isdir(local(path)):
            out.append(src.problem(("workdir",), f"{named} is not a directory "
                                                 f"(relative paths start at {root})"))
    for dst, source in (spec.file_mounts or {}).items():
        if not isinstance(source, str):
            continue
        path, named = filled(source)
        # one ending in '/' is refused on its own (model.py, slash_problems)
        if path is None or path.endswith("/") or "://" in path:
            continue
        if not os.path.exists(local(path)):
            out.append(src.problem(("file_mounts", dst), (
                f"source {named} does not exist (relative paths start at {root})")))
    return out


def slash_problems(spec: TaskSpec, src: Source, env: Mapping[str, str]) -> list[Problem]:
    """file_mounts sources that end in '/' once envs are filled in (``$DIR`` with DIR=/a/):
    SkyPilot's launch refuses them (Task._validate_path), as it does one written so, which
    model.py refuses."""
    out = []
    for dst, source in (spec.file_mounts or {}).items():
        if isinstance(source, str) and (path := substitute(source, env)).endswith("/"):
            out.append(src.problem(("file_mounts", dst), (
                f"source {source!r} (once envs are filled in: {path!r}) must not end with a "
                "slash")))
    return out


class SecretDict(dict):
    """A dict whose repr never shows values: secrets must not reach logs by accident."""

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: '***'" for k in self) + "}"

    __str__ = __repr__


def masked(text: str, values: Iterable[str]) -> str:
    """``text`` with each of ``values`` (secrets) replaced by ``***``: as written, and as
    repr() quotes it (a backslash or a quote is escaped there)."""
    pattern = _secrets_pattern(values)
    return pattern.sub("***", text) if pattern else text


def redacted(problems: list[Problem], values: Iterable[str]) -> list[Problem]:
    """``problems`` with :func:`masked` messages: a message about a filled-in path or storage
    must not show a secret filled into it."""
    pattern = _secrets_pattern(values)
    if pattern is None:
        return problems
    return [replace(p, message=pattern.sub("***", p.message)) for p in problems]


def _secrets_pattern(values: Iterable[str]) -> re.Pattern[str] | None:
    forms = {form for v in values if v for form in (v, repr(v)[1:-1]) if form}
    if not forms:
        return None
    return re.compile("|".join(re.escape(v) for v in sorted(forms, key=len, reverse=True)))


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
