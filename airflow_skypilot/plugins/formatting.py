"""The pages' templates and the filters they format values with (times in UTC, money, hours)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

TEMPLATES = Environment(
    loader=FileSystemLoader(str(Path(__file__).parent / "templates")),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


def as_datetime(value: Any) -> datetime | None:
    """An aware datetime from epoch seconds, an ISO string or a datetime (None if not one)."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(float(value), tz=timezone.utc)
    if isinstance(value, str):
        try:
            return as_datetime(datetime.fromisoformat(value.replace("Z", "+00:00")))
        except ValueError:
            return None
    return None


def fmt_time(value: Any, short: bool = False) -> str:
    """UTC, like the Airflow UI's default; ``short`` drops the year for dense tables."""
    when = as_datetime(value)
    if when is None:
        return ""
    return when.astimezone(timezone.utc).strftime("%m-%d %H:%M:%S" if short
                                                  else "%Y-%m-%d %H:%M:%S UTC")


def fmt_duration(start: Any, end: Any = None) -> str:
    a, b = as_datetime(start), as_datetime(end) or datetime.now(timezone.utc)
    if a is None:
        return ""
    seconds = max(0, int((b - a).total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def fmt_money(value: Any) -> str:
    if value is None or value == "":
        return ""
    value = float(value)
    if 0 < value < 0.01:
        return "<$0.01"
    return f"${value:,.2f}"


def fmt_hours(value: Any) -> str:
    if value is None or value == "":
        return ""
    value = float(value)
    return f"{value:.3f}" if 0 < value < 0.1 else f"{value:,.2f}"


def fmt_price(value: Any) -> str:
    if value is None or value == "":
        return ""
    return f"${float(value):.3g}/h" if float(value) else "$0/h"


def fmt_relative(value: Any, now: Any = None) -> str:
    """``in 25m``, ``3m ago`` or ``now`` (within 5 s)."""
    when = as_datetime(value)
    if when is None:
        return ""
    ref = as_datetime(now) or datetime.now(timezone.utc)
    seconds = (when - ref).total_seconds()
    if abs(seconds) <= 5:
        return "now"
    text = fmt_duration(min(when, ref), max(when, ref))
    return f"in {text}" if seconds > 0 else f"{text} ago"


def short_run(run_id: Any) -> str:
    """``manual__2026-12-01T03:52:17.978300+00:00`` -> ``manual 12-01 03:52:17`` (the full id
    stays in the cell's title)."""
    text = str(run_id or "")
    kind, sep, rest = text.partition("__")
    when = as_datetime(rest) if sep else None
    if when is None:
        return text if len(text) <= 28 else text[:26] + "…"
    return f"{kind} {when.astimezone(timezone.utc).strftime('%m-%d %H:%M:%S')}"


TEMPLATES.filters.update(time=fmt_time, duration=fmt_duration, money=fmt_money,
                         hours=fmt_hours, price=fmt_price, relative=fmt_relative,
                         short_run=short_run)
