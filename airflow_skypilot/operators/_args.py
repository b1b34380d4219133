"""The operator's and sensor's arguments: checked when the DAG is parsed, parsed once rendered.

Airflow renders template fields after ``__init__``: a literal value can be checked at parse time
(a bad DAG fails to load, with the argument named), a Jinja one only in ``execute``. Mappings
given as templates render to text (JSON, or a dict's Python repr without
``render_template_as_native_obj``), which :func:`as_mapping` reads back; a list of connection
ids so rendered (``"{{ params.conns }}"`` -> ``"['c1', 'c2']"``), :func:`as_names`.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from airflow_skypilot import placement

#: arguments that must be > 0 and >= 0 (None: the configured default)
POSITIVE = ("poll_interval", "reprobe_interval")
NOT_NEGATIVE = ("max_failovers", "max_moves", "confirm_timeout", "unreachable_timeout",
                "block_cooldown", "probe_timeout",  # probe_timeout 0: the configured default
                "paid_move_min_wait")


def _templated(value: Any) -> bool:
    return isinstance(value, str) and "{{" in value


def check(values: Mapping[str, Any], templated: Sequence[str] = ("policy",)) -> None:
    """ValueError naming the first argument out of range. A Jinja string is checked once
    rendered where it is a template field (``templated``: ``policy``, and the numbers a
    subclass adds to its ``template_fields``); in any other argument it would never be
    rendered, and is refused now rather than fail the task later."""
    policy = values.get("policy")
    if isinstance(policy, str) and not _templated(policy) and policy not in placement.POLICIES:
        raise ValueError(f"policy must be one of {placement.POLICIES}, got {policy!r}")
    for names, ok, what in ((POSITIVE, lambda v: v > 0, "> 0"),
                            (NOT_NEGATIVE, lambda v: v >= 0, ">= 0")):
        for name in names:
            value = values.get(name)
            if value is None or (_templated(value) and name in templated):
                continue
            if _templated(value):
                raise ValueError(f"{name} is not a template field: give a number {what}, "
                                 f"got {value!r}")
            try:
                good = ok(float(value))
            except (TypeError, ValueError):
                good = False
            if not good:
                raise ValueError(f"{name} must be a number {what}, got {value!r}")


def as_mapping(value: Any) -> Any:
    """A rendered template of a mapping, read back (JSON, else a Python literal); anything
    else as given (the caller says what it expected)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value


def as_names(value: Any) -> list[str]:
    """Names (connection ids) given as a list, or as text: a rendered list (JSON, else a Python
    literal) of strings, else comma-separated names. Blanks are left out."""
    if isinstance(value, str):
        parsed = as_mapping(value)
        if isinstance(parsed, (list, tuple)) and all(isinstance(v, str) for v in parsed):
            value = parsed
        else:  # "c1, c2", or a lone id
            value = value.split(",")
    return [str(v).strip() for v in value or () if str(v).strip()]


class TaskNotRenderedInside:
    """Airflow renders every string inside a templated mapping; a ``task`` given as a dict is
    the YAML's contents, which stay as written (a ``run`` with ``docker ps --format
    '{{.Names}}'`` or a Go template is not Jinja), as a YAML file's contents do."""

    def _do_render_template_fields(self, parent: Any, template_fields: Any, context: Any,
                                   jinja_env: Any, seen_oids: set) -> None:
        if parent is self and isinstance(getattr(self, "task", None), Mapping):
            template_fields = [f for f in template_fields if f != "task"]
        super()._do_render_template_fields(  # type: ignore[misc]
            parent, template_fields, context, jinja_env, seen_oids)
