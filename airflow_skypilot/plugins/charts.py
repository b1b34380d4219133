"""The pages' pictures: inline SVG drawn here, on the server (no script, no build step).

``timeline``  attempts over time, one lane per job or per sweep instance: queued, running and
              how each ended (failed, moved, ...), and the looks at a waiting job
``capacity``  GPUs per connection and accelerator: used, free and pending jobs
``usage``     GPU-hours per day over a period, stacked by connection

Every text is escaped; colours come from the page's CSS variables (light and dark themes).
Each attempt is one ``<g class="attempt">`` (the browser test counts them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from markupsafe import Markup

from airflow_skypilot.plugins.formatting import as_datetime, fmt_duration

#: how an attempt's end is coloured (JobState values and "moved")
OUTCOME_CLASS = {
    "succeeded": "ok", "failed": "bad", "cancelled": "off", "moved": "moved",
    "preempted": "infra", "lost": "infra", "infra_failed": "infra", "node_fail": "infra",
    "running": "run", "pending": "wait", "unknown": "off",
}
PALETTE = ("#4f6bed", "#1e9e6a", "#d9822b", "#b04fbf", "#2f9fbf", "#c9474d", "#7d8c2a",
           "#6b7280")
LEGEND = (("wait", "queued"), ("run", "running"), ("ok", "succeeded"), ("bad", "failed"),
          ("infra", "infrastructure failure"), ("moved", "moved"), ("off", "cancelled"))

STYLE = """
svg.chart { width: 100%; height: auto; font: 11px system-ui, sans-serif; overflow: visible; }
svg.chart text { fill: var(--fg); }
svg.chart .muted, svg.chart .tick text { fill: var(--muted); }
svg.chart .grid { stroke: var(--line); stroke-width: 1; }
svg.chart .lane-bg { fill: var(--panel); }
svg.chart .wait { fill: var(--warn); fill-opacity: .35; stroke: var(--warn); stroke-width: 1; }
svg.chart .run { fill: var(--info); }
svg.chart .ok { fill: var(--ok); }
svg.chart .bad { fill: var(--error); }
svg.chart .infra { fill: #d9822b; }
svg.chart .moved { fill: var(--purple); }
svg.chart .off { fill: var(--muted); }
svg.chart .end.ok, svg.chart .end.bad, svg.chart .end.infra, svg.chart .end.moved,
svg.chart .end.off { stroke: var(--bg); stroke-width: 1; }
svg.chart .look { fill: var(--accent); stroke: var(--bg); stroke-width: 1; }
svg.chart .look-span { stroke: var(--accent); stroke-width: 2; stroke-opacity: .6; }
svg.chart .arrow { stroke: var(--purple); stroke-width: 1.5; fill: none; }
svg.chart .used { fill: var(--info); fill-opacity: .75; }
svg.chart .free { fill: var(--ok); fill-opacity: .8; }
svg.chart .quota { fill: var(--ok); fill-opacity: .35; stroke: var(--ok); stroke-dasharray: 3 2; }
svg.chart .pending { fill: var(--warn); }
svg.chart .unknown { fill: var(--muted); fill-opacity: .2; stroke: var(--muted);
                     stroke-dasharray: 3 2; }
svg.chart a text { fill: var(--accent); }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; color: var(--muted);
          margin: 4px 0 6px; }
.legend i { display: inline-block; width: 12px; height: 10px; border-radius: 2px;
            vertical-align: -1px; margin-right: 4px; }
.legend .wait { background: var(--warn); opacity: .45; } .legend .run { background: var(--info); }
.legend .ok { background: var(--ok); } .legend .bad { background: var(--error); }
.legend .infra { background: #d9822b; } .legend .moved { background: var(--purple); }
.legend .off { background: var(--muted); } .legend .look { background: var(--accent);
  transform: rotate(45deg) scale(.7); }
.legend .used { background: var(--info); opacity: .75; }
.legend .free { background: var(--ok); opacity: .8; }
.legend .quota { background: var(--ok); opacity: .35; }
.legend .pending { background: var(--warn); }
"""


def _f(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _ts(value: Any) -> float | None:
    when = as_datetime(value)
    return when.timestamp() if when else None


def _clock(ts: float, span: float) -> str:
    when = datetime.fromtimestamp(ts, tz=timezone.utc)
    if span >= 2 * 86400:
        return when.strftime("%m-%d %H:%M")
    return when.strftime("%H:%M:%S" if span < 3600 else "%H:%M")


_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
          86400, 172800, 604800)


def _ticks(t0: float, t1: float, most: int = 8) -> list[float]:
    span = max(t1 - t0, 1.0)
    step = next((s for s in _STEPS if span / s <= most), _STEPS[-1])
    first = math.ceil(t0 / step) * step
    return [first + i * step for i in range(int((t1 - first) // step) + 1)]


def legend(items: Iterable[tuple[str, str]]) -> Markup:
    return Markup('<div class="legend">{}</div>').format(Markup("").join(
        Markup('<span><i class="{}"></i>{}</span>').format(cls, text) for cls, text in items))


def _attempt_title(index: int, a: Mapping[str, Any], start: float | None,
                   end: float | None, now: float) -> str:
    where = f"{a.get('connection') or '?'}/{a.get('location') or '?'}"
    parts = [f"attempt {index}: {where}, job {a.get('job_id') or '?'}"]
    sub = _ts(a.get("submitted_at"))
    if sub is not None:
        parts.append(f"queued {fmt_duration(sub, start or end or now)}")
    if start is not None:
        parts.append(f"ran {fmt_duration(start, end or now)}")
    state = a.get("state") or ""
    parts.append(state + (f": {a['reason']}" if a.get("reason") else ""))
    return "; ".join(parts)


def timeline(lanes: Sequence[Mapping[str, Any]], now: float | None = None,
             width: int = 1000, label_width: int = 230) -> Markup:
    """Attempts over time. ``lanes``: ``{"label", "sublabel"?, "url"?, "attempts": [attempt
    dicts: connection, location, job_id, state, reason, submitted_at, started_at, ended_at],
    "looks": [Look dicts]?}``; every attempt is one ``<g class="attempt">`` on its lane."""
    now = time.time() if now is None else now
    points: list[float] = []
    for lane in lanes:
        for a in lane.get("attempts") or []:
            points += [t for t in (_ts(a.get("submitted_at")), _ts(a.get("started_at")),
                                   _ts(a.get("ended_at"))) if t is not None]
        for look in lane.get("looks") or []:
            points += [t for t in (_ts(look.get("first_at")), _ts(look.get("last_at")))
                       if t is not None]
    if not points:
        return Markup("")
    t0 = min(points)
    open_ended = any(a.get("ended_at") is None and a.get("state") in (None, "pending", "running")
                     for lane in lanes for a in lane.get("attempts") or [])
    t1 = max(points + ([now] if open_ended else []))
    if t1 - t0 < 10:
        t1 = t0 + 10
    pad = (t1 - t0) * 0.02
    t0, t1 = t0 - pad, t1 + pad
    x0, x1 = label_width, width - 12
    lane_h, top = 28, 6
    height = top + lane_h * len(lanes) + 26

    def x(t: float) -> float:
        return x0 + (x1 - x0) * (t - t0) / (t1 - t0)

    out: list[Markup] = [Markup(
        '<svg class="chart timeline" xmlns="http://www.w3.org/2000/svg" role="img" '
        'viewBox="0 0 {w} {h}" width="{w}" height="{h}" aria-label="attempts over time">'
    ).format(w=width, h=height)]
    span = t1 - t0
    for i in range(0, len(lanes), 2):  # banded lanes under the grid and the bars
        out.append(Markup('<rect class="lane-bg" x="0" y="{y}" width="{w}" height="{h}" '
                          'rx="3"/>').format(y=top + i * lane_h, w=width, h=lane_h))
    for tick in _ticks(t0, t1):
        out.append(Markup('<g class="tick"><line class="grid" x1="{x}" x2="{x}" y1="{y0}" '
                          'y2="{y1}"/><text x="{x}" y="{ty}" text-anchor="middle">{label}'
                          '</text></g>').format(x=_f(x(tick)), y0=top, y1=height - 20,
                                                ty=height - 6, label=_clock(tick, span)))
    if open_ended and t0 <= now <= t1:
        out.append(Markup('<line class="grid" x1="{x}" x2="{x}" y1="{y0}" y2="{y1}" '
                          'stroke-dasharray="4 3"><title>now</title></line>').format(
            x=_f(x(now)), y0=top, y1=height - 20))
    number = 0
    for i, lane in enumerate(lanes):
        y = top + i * lane_h
        mid = y + lane_h / 2
        out.append(Markup('<g class="lane" data-lane="{i}">').format(i=i))
        text = Markup('<text x="6" y="{y}">{label}<tspan class="muted" dx="6">{sub}</tspan>'
                      '</text>').format(y=_f(mid + 4), label=lane.get("label", ""),
                                        sub=lane.get("sublabel", ""))
        if lane.get("url"):
            text = Markup('<a href="{url}">{text}</a>').format(url=lane["url"], text=text)
        out.append(text)
        previous_end: tuple[float, float] | None = None
        for a in lane.get("attempts") or []:
            number += 1
            sub, start, end = (_ts(a.get("submitted_at")), _ts(a.get("started_at")),
                               _ts(a.get("ended_at")))
            state = str(a.get("state") or "pending")
            outcome = OUTCOME_CLASS.get(state, "off")
            live_end = end if end is not None else now
            index = a.get("number") or number
            title = _attempt_title(index, a, start, end, now)
            out.append(Markup('<g class="attempt" data-attempt="{n}" data-state="{s}">'
                              '<title>{t}</title>').format(n=index, s=state, t=title))
            bar_y, bar_h = mid - 7, 14
            if sub is not None:
                q_end = start if start is not None else live_end
                out.append(Markup('<rect class="wait" x="{x}" y="{y}" width="{w}" height="{h}" '
                                  'rx="2"/>').format(x=_f(x(sub)), y=_f(bar_y),
                                                     w=_f(max(x(q_end) - x(sub), 2)), h=bar_h))
            if start is not None:
                cls = "run" if end is None else outcome
                out.append(Markup('<rect class="{c}" x="{x}" y="{y}" width="{w}" height="{h}" '
                                  'rx="2"/>').format(c=cls, x=_f(x(start)), y=_f(bar_y),
                                                     w=_f(max(x(live_end) - x(start), 2)),
                                                     h=bar_h))
            if end is not None:
                out.append(Markup('<rect class="end {c}" x="{x}" y="{y}" width="4" height="{h}"'
                                  ' rx="1"/>').format(c=outcome, x=_f(x(end) - 2),
                                                      y=_f(bar_y - 3), h=bar_h + 6))
            if previous_end is not None and sub is not None:
                out.append(Markup('<path class="arrow" d="M{ax} {ay} L{bx} {by}"/>').format(
                    ax=_f(previous_end[0]), ay=_f(previous_end[1]), bx=_f(x(sub)),
                    by=_f(mid)))
            previous_end = (x(live_end), mid) if state == "moved" else None
            out.append(Markup("</g>"))
        for look in lane.get("looks") or []:
            out.append(_look_marks(look, x, mid))
        out.append(Markup("</g>"))
    out.append(Markup("</svg>"))
    return Markup("").join(out)


def _look_marks(look: Mapping[str, Any], x: Any, mid: float) -> Markup:
    first, last = _ts(look.get("first_at")), _ts(look.get("last_at"))
    if last is None:
        return Markup("")
    count = int(look.get("count") or 1)
    best = look.get("best") or "no other place"
    title = (f"{count} look(s) {'' if count == 1 else 'up to '}"
             f"{_clock(last, 3600)}: {look.get('outcome', '')}; best other: {best}; "
             f"{look.get('why', '')}")
    y = mid - 12
    parts = [Markup('<g class="look-mark"><title>{}</title>').format(title)]
    if first is not None and count > 1 and x(last) - x(first) > 1:
        parts.append(Markup('<line class="look-span" x1="{a}" x2="{b}" y1="{y}" y2="{y}"/>')
                     .format(a=_f(x(first)), b=_f(x(last)), y=_f(y)))
    parts.append(Markup('<path class="look" d="M{cx} {t} L{r} {y} L{cx} {b} L{l} {y} Z"/>')
                 .format(cx=_f(x(last)), t=_f(y - 4), b=_f(y + 4), r=_f(x(last) + 4),
                         l=_f(x(last) - 4), y=_f(y)))
    parts.append(Markup("</g>"))
    return Markup("").join(parts)


def capacity(bars: Sequence[Mapping[str, Any]], width: int = 1000,
             label_width: int = 300) -> Markup:
    """GPUs per place: ``bars`` are ``{"connection", "label", "total" (None: bounded by a
    quota), "free", "pending"}``, grouped by connection in the given order. Counted GPUs share
    one scale, quota-bounded ones another (a quota's room is not a cluster's size)."""
    if not bars:
        return Markup("")
    counted = max((b.get("total") or 0 for b in bars if b.get("total") is not None), default=1)
    quota = max((b.get("free") or 0 for b in bars if b.get("total") is None), default=1)
    x0, x1 = label_width, width - 120
    bar_h, step = 14, 20
    rows: list[Markup] = []
    y = 4
    last_conn = None
    for b in bars:
        if b.get("connection") != last_conn:
            last_conn = b.get("connection")
            y += 6
            rows.append(Markup('<text x="4" y="{y}" font-weight="600">{c}</text>').format(
                y=y + 10, c=last_conn))
            y += step
        total, free = b.get("total"), b.get("free")
        pending = b.get("pending") or 0
        if free is None:  # not known (e.g. pods may not be listed): never drawn as 0 free
            what = f"{total} GPUs, free unknown" if total is not None else "startable unknown"
        elif total is not None:
            what = f"{free} of {total} free, {total - free} in use"
        else:
            what = f"{free} startable now (quota)"
        title = (f"{b.get('connection')} {b.get('label')}: " + what
                 + (f", {pending} job(s) pending" if pending else ""))
        rows.append(Markup('<g class="place" data-connection="{c}"><title>{t}</title>'
                           '<text x="16" y="{ty}">{label}</text>').format(
            c=b.get("connection"), t=title, ty=y + 11, label=b.get("label")))

        scale_max = (counted if total is not None else quota) or 1

        def w(n: float, scale_max: float = scale_max) -> float:
            return (x1 - x0) * n / scale_max

        if free is None:
            # the whole size (if known) without a used/free split
            rows.append(Markup('<rect class="unknown" x="{x}" y="{y}" width="{w}" height="{h}"'
                               '/>').format(x=x0, y=y, w=_f(w(total or 0)), h=bar_h))
            end = x0 + w(total or 0)
            text = f"{total} GPUs, free unknown" if total is not None else "startable unknown"
        elif total is not None:
            used = max(total - free, 0)
            rows.append(Markup('<rect class="used" x="{x}" y="{y}" width="{w}" height="{h}"/>'
                               ).format(x=x0, y=y, w=_f(w(used)), h=bar_h))
            rows.append(Markup('<rect class="free" x="{x}" y="{y}" width="{w}" height="{h}"/>'
                               ).format(x=_f(x0 + w(used)), y=y, w=_f(w(free)), h=bar_h))
            end = x0 + w(total)
            text = f"{free}/{total} free"
        else:
            rows.append(Markup('<rect class="quota" x="{x}" y="{y}" width="{w}" height="{h}"/>'
                               ).format(x=x0, y=y, w=_f(w(free)), h=bar_h))
            end = x0 + w(free)
            text = f"{free} startable"
        if pending:
            rows.append(Markup('<rect class="pending" x="{x}" y="{y}" width="{w}" height="{h}"'
                               '/>').format(x=_f(end + 3), y=y + 3,
                                            w=_f(min(6 * pending, 60)), h=bar_h - 6))
            end += 3 + min(6 * pending, 60)
            text += f", {pending} pending"
        rows.append(Markup('<text class="muted" x="{x}" y="{y}">{t}</text></g>').format(
            x=_f(end + 6), y=y + 11, t=text))
        y += step
    height = y + 4
    head = Markup('<svg class="chart capacity-bars" xmlns="http://www.w3.org/2000/svg" '
                  'role="img" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
                  'aria-label="GPUs per connection">').format(w=width, h=height)
    return head + Markup("").join(rows) + Markup("</svg>")


def usage(days: Sequence[str], series: Mapping[str, Mapping[str, float]], unit: str = "GPU-h",
          width: int = 1000, height: int = 220) -> Markup:
    """Stacked bars per day: ``series`` maps a name (connection) to ``{day: value}``."""
    if not days or not series:
        return Markup("")
    names = list(series)
    totals = {d: sum(series[n].get(d, 0.0) for n in names) for d in days}
    top = max(totals.values()) or 1.0
    x0, x1, y0, y1 = 50, width - 10, 10, height - 28
    slot = (x1 - x0) / len(days)
    bar = max(min(slot * 0.7, 40), 2)
    out = [Markup('<svg class="chart usage-bars" xmlns="http://www.w3.org/2000/svg" role="img" '
                  'viewBox="0 0 {w} {h}" width="{w}" height="{h}" aria-label="{u} per day">')
           .format(w=width, h=height, u=unit)]
    for frac in (0, 0.5, 1):
        yy = y1 - (y1 - y0) * frac
        out.append(Markup('<g class="tick"><line class="grid" x1="{a}" x2="{b}" y1="{y}" '
                          'y2="{y}"/><text x="{t}" y="{ty}" text-anchor="end">{v}</text></g>')
                   .format(a=x0, b=x1, y=_f(yy), t=x0 - 6, ty=_f(yy + 4),
                           v=f"{top * frac:.3g}"))
    every = max(1, math.ceil(len(days) / 12))
    for i, day in enumerate(days):
        bx = x0 + i * slot + (slot - bar) / 2
        base = y1
        for k, name in enumerate(names):
            value = series[name].get(day, 0.0)
            if value <= 0:
                continue
            h = (y1 - y0) * value / top
            out.append(Markup('<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{c}">'
                              '<title>{d} {n}: {v:.3f} {u}</title></rect>').format(
                x=_f(bx), y=_f(base - h), w=_f(bar), h=_f(max(h, 0.5)),
                c=PALETTE[k % len(PALETTE)], d=day, n=name, v=value, u=unit))
            base -= h
        if i % every == 0:
            out.append(Markup('<text class="muted" x="{x}" y="{y}" text-anchor="middle">{d}'
                              '</text>').format(x=_f(bx + bar / 2), y=height - 10, d=day[5:]))
    out.append(Markup("</svg>"))
    return Markup("").join(out)


def usage_legend(names: Sequence[str]) -> Markup:
    return Markup('<div class="legend">{}</div>').format(Markup("").join(
        Markup('<span><i style="background: {c}"></i>{n}</span>').format(
            c=PALETTE[k % len(PALETTE)], n=name) for k, name in enumerate(names)))

