"""Zones of one region that say the same thing share a row: for people, not for programs.

A cloud connection reports one row per availability zone (``us-east-1/us-east-1a``), so a
placement table or a capacity listing has tens of rows that differ only in the zone. The CLI's
``show-gpus`` and the pages' capacity and placement tables group them with :func:`group`:
rows of one region with the same key become one :class:`ZoneGroup`, labelled
``us-east-1/{a,b,c}``, that keeps its member rows (the pages show them on demand). ``--json``
and the JSON forms keep one row per zone.

Standard library only: the UI plugin imports it in every process that loads plugins.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Row = TypeVar("Row")


def split(location: str) -> tuple[str, str] | None:
    """``(region, zone)`` of a ``region/zone`` location, None for anything else (a Slurm
    partition, a nested path)."""
    region, sep, zone = (location or "").partition("/")
    if not sep or not region or not zone or "/" in zone:
        return None
    return region, zone


def short_zone(region: str, zone: str) -> str:
    """``us-east-1a`` -> ``a`` under ``us-east-1``; a zone not named after its region stays."""
    return zone[len(region):] if zone.startswith(region) and len(zone) > len(region) else zone


def label(region: str, zones: Iterable[str]) -> str:
    """``us-east-1/{a,b,c}`` (one zone: its full location)."""
    zones = list(zones)
    if len(zones) == 1:
        return f"{region}/{zones[0]}"
    return f"{region}/{{{','.join(short_zone(region, z) for z in zones)}}}"


@dataclass
class ZoneGroup(Generic[Row]):
    """Rows that share a row on the screen: one row, or the zones of one region."""

    rows: list[Row]
    location: str  # what the shared row says: ``us-east-1/{a,b}``, or the one row's location
    region: str = ""
    zones: list[str] = field(default_factory=list)  # full zone names, in the rows' order

    @property
    def first(self) -> Row:
        return self.rows[0]

    @property
    def grouped(self) -> bool:
        return len(self.rows) > 1


def _get(row: Any, name: str) -> Any:
    return row.get(name) if isinstance(row, dict) else getattr(row, name, None)


def group(rows: Iterable[Row], key: Callable[[Row], Hashable | None],
          location: Callable[[Row], str] = lambda r: str(_get(r, "location") or "")
          ) -> list[ZoneGroup[Row]]:
    """Group the rows of each region whose ``key`` is equal (``key`` None: never grouped).

    Groups come in the order of their first row; a group's rows keep their order. A row whose
    location is not ``region/zone`` stays alone.
    """
    groups: dict[Hashable, ZoneGroup[Row]] = {}
    out: list[ZoneGroup[Row]] = []
    for row in rows:
        where = location(row)
        parts = split(where)
        k = key(row)
        if parts is None or k is None:
            out.append(ZoneGroup([row], where))
            continue
        region, zone = parts
        gkey = ("zone-group", region, k)
        if gkey not in groups:
            groups[gkey] = ZoneGroup([], "", region=region)
            out.append(groups[gkey])
        g = groups[gkey]
        g.rows.append(row)
        g.zones.append(zone)
    for g in out:
        if g.region:
            g.location = label(g.region, g.zones) if g.grouped else location(g.first)
    return out


def without_zone(text: str, row: Any) -> str:
    """``text`` with the row's zone (and location) replaced, so that reasons naming their own
    zone still group (``p5.48xlarge not offered in us-east-1e``)."""
    where = str(_get(row, "location") or "")
    parts = split(where)
    if not text or parts is None:
        return text or ""
    return text.replace(where, "{zone}").replace(parts[1], "{zone}")


def ranks_text(ranks: Iterable[int | None]) -> str:
    """``[4, 5, 6, 9]`` -> ``4-6, 9`` (None ranks left out)."""
    numbers = sorted({r for r in ranks if r is not None})
    spans: list[str] = []
    start = prev = None
    for n in numbers + [None]:
        if start is not None and n is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            spans.append(str(start) if start == prev else f"{start}\u2013{prev}")
        start = prev = n
    return ", ".join(spans)


#: a capacity row's numbers: zones with the same ones share a row
CAPACITY_KEY = ("connection", "accelerator", "free", "total", "pending", "price_per_hour")
#: a placement row's columns but its rank and location: zones with the same ones share a row
PLACEMENT_KEY = ("verdict", "connection", "request", "free", "start", "price")


def capacity_key(row: Any) -> tuple | None:
    if _get(row, "error") or _get(row, "note"):
        return None
    return tuple(_get(row, k) for k in CAPACITY_KEY)


def placement_key(row: Any) -> tuple | None:
    if _get(row, "verdict") == "chosen":
        return None
    return (*(_get(row, k) for k in PLACEMENT_KEY), without_zone(_get(row, "reason"), row))
