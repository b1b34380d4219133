"""Rank offers and explain the choice: pure functions, no I/O.

Policies:

``fastest`` (default)
    Free now first; then the soonest estimated start; then the lower price.
``cheapest``
    Lowest price per hour first; then free now; then the soonest start.

``ordered`` candidates (SkyPilot's ``ordered:`` or an accelerator list) keep the user's order
as the preference: with ``fastest``, an earlier candidate that can start now beats a later
one; when no candidate can start now, the earliest candidate in the list waits where it will
start soonest. With ``cheapest``, the list order comes before the price.

Every offer gets a row in the explanation table with why it won or lost.

A placement is not a one-time guess: while a job waits in a queue, :func:`reconsider` looks at
its place again (as just re-probed) beside fresh offers elsewhere and says whether to move it.
Start estimates are guesses (Slurm's come from time limits, which real jobs rarely use up), so a
move needs a clear margin, never goes back and forth without bound, and never to a place the
policy would not pick (a costlier place under ``fastest`` only within the request's
``max_hourly_cost`` and when the wait where the job is would be long; never under
``cheapest``; never against the user's ``ordered`` list).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from airflow_skypilot.backends.base import Offer
from airflow_skypilot.runstate import Blocked  # a failed place is run state; kept importable here

POLICIES = ("fastest", "cheapest")
#: moves of one job, at most (each one cancels a waiting copy and queues a new one)
MAX_MOVES = 3
#: a move to a place that cannot start the job now must gain this share of the current wait...
MOVE_GAIN_SHARE = 0.5
#: ...and at least this many seconds
MOVE_GAIN_MIN_S = 120.0
#: a waiting job whose place estimates its start within this many seconds does not move to a
#: costlier place: queued copies start at about half their estimate (benchmarks/README.md:
#: median real/estimated wait 0.5) and a cloud instance boots for minutes, so paying to save
#: such a wait buys little (the scheduling benchmark: 0.99x SkyPilot's spend instead of 1.02x
#: at the same wait). The operator's ``paid_move_min_wait``; 0: a costlier place free now
#: always wins under ``fastest``
PAID_MOVE_MIN_WAIT_S = 1800.0


@dataclass
class Row:
    """One line of the explanation table."""

    verdict: str  # chosen | candidate | queued | blocked | no fit | over budget | unreachable
    connection: str
    location: str = ""
    request: str = ""
    free: str = ""
    start: str = ""
    price: str = ""
    reason: str = ""
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Placement:
    """The outcome of ranking: the chosen offer (or None) and the table that explains it."""

    chosen: Offer | None
    rows: list[Row]
    policy: str
    ranked: list[Offer] = field(default_factory=list)

    @property
    def summary(self) -> str:
        if self.chosen is None:
            return "no placement: " + (_no_fit_summary(self.rows) or "no offers")
        c = self.chosen
        how = "free now" if c.free_now else f"queued, est. start {_start_text(c)}"
        return (f"placed on {c.connection} ({c.location}) as {c.request.describe()} x "
                f"{c.num_nodes} node(s): {how}, {_price_text(c.price_per_hour)}")

    def table(self) -> str:
        """The explanation table as fixed-width text, for the task log and the CLI."""
        headers = ["", "connection", "location", "request", "free", "start", "price", "why"]
        lines = [[_mark(r), r.connection, r.location, r.request, r.free, r.start, r.price,
                  r.reason] for r in self.rows]
        widths = [max(len(h), *(len(str(line[i])) for line in lines)) if lines else len(h)
                  for i, h in enumerate(headers)]
        out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
        out.append("  ".join("-" * w for w in widths))
        for line in lines:
            out.append("  ".join(str(v).ljust(w)
                                 for v, w in zip(line, widths, strict=True)).rstrip())
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "summary": self.summary,
            "chosen": self.chosen.to_dict() if self.chosen else None,
            "rows": [r.to_dict() for r in self.rows],
        }


def _mark(row: Row) -> str:
    return {"chosen": "*"}.get(row.verdict, "")


def rank(
    offers: Iterable[Offer],
    policy: str = "fastest",
    *,
    ordered: bool = False,
    blocked: Iterable[Blocked] = (),
    unreachable: dict[str, str] | None = None,
    prefer: str | None = None,
    avoid: str | None = None,
    now: float | None = None,
) -> Placement:
    """Pick the best offer under ``policy`` and explain every other one.

    ``blocked`` places are skipped while their block is active at ``now`` (a ``soft`` block
    only while another place takes the job); ``unreachable`` maps connection -> error (shown
    as rows);
    ``prefer`` (a ``connection/location``) wins among offers that can start now: the FAILOVER
    recovery strategy tries the same place first. ``avoid`` (a place, or ``conn/region/*``)
    comes after every other viable offer while one of those can start the job now:
    EAGER_NEXT_REGION tries elsewhere first, and falls back to it rather than queue elsewhere.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; expected one of {POLICIES}")
    offers = list(offers)
    now = time.time() if now is None else now
    blocked = [b for b in blocked if b.active(now)]
    if any(b.soft for b in blocked) and not any(
            o.fits and not over_cap(o) and not any(b.covers(o) for b in blocked)
            for o in offers):
        # nowhere else takes the job: a soft block (a place EAGER_NEXT_REGION left) lifts
        blocked = [b for b in blocked if not b.soft]
    viable: list[Offer] = []
    rows_by_id: dict[int, Row] = {}
    rest: list[Row] = []
    for offer in offers:
        block = next((b for b in blocked if b.active(now) and b.covers(offer)), None)
        row = _row(offer)
        if block is not None:
            row.verdict, row.reason = "blocked", block.describe()
        elif not offer.fits:
            row.verdict, row.reason = "no fit", offer.reason or "does not fit"
        elif over_cap(offer):
            row.verdict = "over budget"
            each = offer.price_per_hour / max(1, offer.num_nodes)
            row.reason = (f"{_price_text(each)}{' a node' if offer.num_nodes > 1 else ''} is "
                          f"over max_hourly_cost {_price_text(offer.request.max_hourly_cost)}")
        else:
            viable.append(offer)
            rows_by_id[id(offer)] = row
            continue
        rest.append(row)
    for conn, error in sorted((unreachable or {}).items()):
        rest.append(Row(verdict="unreachable", connection=conn, reason=f"unreachable: {error}"))

    # ``avoid`` goes last only while another place can start the job now (SkyPilot's EAGER
    # falls back to the failed region when elsewhere cannot launch: no queue elsewhere wins)
    avoided = Blocked(avoid, "") if avoid else None
    if avoided and not any(o.free_now and not avoided.covers(o) for o in viable):
        avoided = None
    viable.sort(key=lambda o: (bool(avoided and avoided.covers(o)),
                               *_key(o, policy, ordered, prefer)))
    chosen = viable[0] if viable else None
    ranked_rows = []
    for i, offer in enumerate(viable):
        row = rows_by_id[id(offer)]
        row.rank = i + 1
        if offer is chosen:
            row.verdict = "chosen"
            row.reason = _why_chosen(offer, viable[1:], policy, ordered, prefer)
        elif avoided and avoided.covers(offer):
            row.verdict = "candidate" if offer.free_now else "queued"
            row.reason = "tried last (job_recovery EAGER_NEXT_REGION: elsewhere first)"
        else:
            row.verdict = "candidate" if offer.free_now else "queued"
            row.reason = _why_lost(offer, chosen, policy, ordered,  # type: ignore[arg-type]
                                   prefer)
        ranked_rows.append(row)
    order = {"no fit": 2, "over budget": 1, "blocked": 0, "unreachable": 3}
    rest.sort(key=lambda r: (order.get(r.verdict, 9), r.connection, r.location))
    return Placement(chosen=chosen, rows=ranked_rows + rest, policy=policy, ranked=viable)


#: the ranking key's elements, in order, per (policy, ordered): :func:`_key` sorts by them and
#: the explanations name the first one in which two offers differ (:func:`_decided_by`)
_KEY_ORDER: dict[tuple[str, bool], tuple[str, ...]] = {
    ("fastest", True): ("preferred", "not_free", "index", "wait", "depth", "gpu_taker",
                        "price", "spare", "tie"),
    ("fastest", False): ("preferred", "not_free", "wait", "depth", "gpu_taker", "price",
                         "spare", "tie"),
    ("cheapest", True): ("preferred", "index", "price", "not_free", "wait", "depth",
                         "gpu_taker", "spare", "tie"),
    ("cheapest", False): ("preferred", "price", "not_free", "wait", "depth", "gpu_taker",
                          "spare", "tie"),
}


def _key_parts(o: Offer, prefer: str | None) -> dict[str, Any]:
    """Every element the ranking may sort ``o`` by, by name."""
    return {
        "preferred": 0 if (prefer and o.place_key == prefer and o.free_now) else 1,
        "not_free": 0 if o.free_now else 1,
        "index": o.request.index,
        "wait": math.inf if o.wait_seconds is None else o.wait_seconds,
        # queues alike (both "unknown", say): the least work ahead per GPU (or node)
        "depth": _depth(o) if not o.free_now else 0.0,
        # a CPU-only job that would sit on GPU nodes goes elsewhere when elsewhere is as
        # good: the GPUs stay free for the jobs that need them
        "gpu_taker": 1 if o.details.get("gpu_place") else 0,
        "price": o.price_per_hour,
        "spare": -(o.gpus_free or 0),
        "tie": (o.connection, o.location, o.request.index),
    }


def _key(o: Offer, policy: str, ordered: bool, prefer: str | None) -> tuple[Any, ...]:
    parts = _key_parts(o, prefer)
    return tuple(parts[name] for name in _KEY_ORDER[(policy, ordered)])


def _decided_by(o: Offer, chosen: Offer, policy: str, ordered: bool,
                prefer: str | None) -> str:
    """The element of the ranking key that put ``chosen`` before ``o``."""
    mine, theirs = _key_parts(o, prefer), _key_parts(chosen, prefer)
    return next((n for n in _KEY_ORDER[(policy, ordered)] if mine[n] != theirs[n]), "tie")


def _depth(o: Offer) -> float:
    """Jobs waiting ahead per GPU (per node for CPU-only offers) of the place; unknown: last."""
    if o.pending_jobs is None:
        return math.inf
    size = o.gpus_total if o.request.accelerator and o.gpus_total else o.nodes_total
    return o.pending_jobs / max(1, size or 1)


def _row(o: Offer) -> Row:
    return Row(
        verdict="", connection=o.connection, location=o.location,
        request=f"{o.request.describe()} x{o.num_nodes}" if o.num_nodes > 1
        else o.request.describe(),
        free=_free_text(o), start=_start_text(o) if o.fits else "",
        price=_price_text(o.price_per_hour) if o.fits else "",
    )


def _free_text(o: Offer) -> str:
    acc = o.request.accelerator
    if acc and o.gpus_total is not None:
        free = "?" if o.gpus_free is None else str(o.gpus_free)
        return f"{free}/{o.gpus_total} {acc}"
    if o.nodes_total is not None:
        free = "?" if o.nodes_free is None else str(o.nodes_free)
        return f"{free}/{o.nodes_total} nodes"
    return ""


def _start_text(o: Offer) -> str:
    if o.free_now:
        return "now"
    wait = o.wait_seconds
    if wait is None:
        return "unknown"
    return f"in {_duration(wait)}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, _ = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24}h"


def _price_text(price: float) -> str:
    return f"${price:.3g}/h" if price else "$0/h"


def _need_text(o: Offer) -> str:
    req = o.request
    if req.accelerator:
        n = req.accelerator_count
        n_text = int(n) if float(n).is_integer() else n
        per = f"{n_text} {req.accelerator}"
        return per if o.num_nodes == 1 else f"{per} on each of {o.num_nodes} nodes"
    return f"{o.num_nodes} node(s)"


def _capacity_text(o: Offer) -> str:
    """``2 of 8 A100 free, need 4``; or the queue depth and estimated start."""
    parts = []
    if o.request.accelerator and o.gpus_total is not None and o.gpus_free is not None:
        parts.append(f"{o.gpus_free} of {o.gpus_total} {o.request.accelerator} free, "
                     f"need {_need_text(o)}")
    elif o.nodes_free is not None and o.nodes_total is not None:
        parts.append(f"{o.nodes_free} of {o.nodes_total} nodes free, need {o.num_nodes}")
    if o.pending_jobs:
        parts.append(f"{o.pending_jobs} job(s) pending")
    if not o.free_now:
        parts.append(f"est. start {_start_text(o)}")
    return "; ".join(parts)


def _why_chosen(o: Offer, others: list[Offer], policy: str, ordered: bool,
                prefer: str | None) -> str:
    bits = []
    if prefer and o.place_key == prefer and o.free_now:
        bits.append("same place first (job_recovery FAILOVER)")
    if o.free_now:
        bits.append("free now" + (f" ({_capacity_text(o)})" if o.gpus_total is not None else ""))
    else:
        free = next((x for x in others if x.free_now), None)  # the best place free now
        if free is not None:
            bits.append(f"queued ({_capacity_text(o)}) though "
                        f"{free.connection}/{free.location} is free now: " + {
                            "index": "this one comes earlier in your order",
                            "price": f"this one costs {_price_text(o.price_per_hour)} vs "
                                     f"{_price_text(free.price_per_hour)}",
                        }.get(_decided_by(free, o, policy, ordered, prefer),
                              f"ranked first under {policy}"))
        else:
            wait = math.inf if o.wait_seconds is None else o.wait_seconds
            soonest = all(wait <= (math.inf if x.wait_seconds is None else x.wait_seconds)
                          for x in others)
            bits.append("nothing free now anywhere; " + ("soonest: " if soonest else "")
                        + _capacity_text(o))
    if ordered:
        bits.append(f"candidate #{o.request.index + 1} in your order")
    if policy == "cheapest" or any(x.price_per_hour != o.price_per_hour for x in others):
        bits.append(_price_text(o.price_per_hour))
    return "; ".join(bits)


def _why_lost(o: Offer, chosen: Offer, policy: str, ordered: bool,
              prefer: str | None = None) -> str:
    """Why ``o`` ranks below ``chosen``: the ranking key's first element that tells them apart."""
    by = _decided_by(o, chosen, policy, ordered, prefer)
    free_but = "free now, but " if o.free_now and not chosen.free_now else ""
    if by == "preferred":
        return (f"{chosen.connection}/{chosen.location} goes first: same place first "
                "(job_recovery FAILOVER)")
    if by == "not_free":
        return _capacity_text(o) or "cannot start now"
    if by == "index":
        if free_but:
            return "free now, but later in your order"
        return (f"candidate #{o.request.index + 1}; #{chosen.request.index + 1} comes "
                "first in your order")
    if by == "price":
        return (f"{free_but}{_price_text(o.price_per_hour)} vs "
                f"{_price_text(chosen.price_per_hour)}")
    if by == "wait":
        return f"starts later: {_capacity_text(o)}"
    if by == "depth":
        return f"more work queued ahead: {_queue_text(o)} vs {_queue_text(chosen)}"
    if by == "gpu_taker":
        return "would take GPU nodes for a job that asks for no GPU"
    if by == "spare":
        return f"fewer spare GPUs ({o.gpus_free} vs {chosen.gpus_free})"
    return "tie; broken by name"


def _queue_text(o: Offer) -> str:
    """``3 job(s) pending for 8 A100``: the work ahead that :func:`_depth` weighs."""
    if o.pending_jobs is None:
        return "pending jobs unknown"
    if o.request.accelerator and o.gpus_total:
        return f"{o.pending_jobs} job(s) pending for {o.gpus_total} {o.request.accelerator}"
    return f"{o.pending_jobs} job(s) pending for {o.nodes_total or 1} node(s)"


def _no_fit_summary(rows: list[Row]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    return ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))


@dataclass
class Reconsideration:
    """One look at a waiting job: where to move it (``move_to``, None: it stays), the best
    other place seen (None: none could take it), and why it moves or stays, in words."""

    move_to: Offer | None
    best: Offer | None
    why: str


def reconsider(current: Offer, offers: list[Offer], policy: str, *, ordered: bool = False,
               blocked: Iterable[Blocked] = (), waited_s: float = 0.0, moves: int = 0,
               max_moves: int = MAX_MOVES, now: float | None = None,
               paid_min_wait: float = PAID_MOVE_MIN_WAIT_S) -> Offer | None:
    """Should a job waiting in a queue move? The offer to move to, or None to stay.

    ``current`` is the waiting job's own place as just re-probed (its estimated start counts
    its position in that queue); ``offers`` are fresh offers elsewhere (the current place among
    them is ignored). Pure: the caller acts on the answer; the reason is the returned offer's
    ``details["move_reason"]``. :func:`judge` also says why a job stays.

    Rules: never after ``max_moves`` moves, and never when the current place can start the job
    now. A place that can start it now wins over a queue (under ``cheapest`` only if it costs no
    more; under ``fastest`` a costlier one too, within the request's ``max_hourly_cost``, unless
    the job's own place estimates its start within ``paid_min_wait`` seconds). A
    queue elsewhere wins only with a clear margin: it must save at least ``MOVE_GAIN_SHARE`` of
    the current wait and ``MOVE_GAIN_MIN_S`` seconds, since start estimates are guesses. With
    ``ordered`` candidates a move never goes to a later candidate than the current one.
    ``waited_s`` (how long the job has waited) only shows in the reason.
    """
    return judge(current, offers, policy, ordered=ordered, blocked=blocked, waited_s=waited_s,
                 moves=moves, max_moves=max_moves, now=now, paid_min_wait=paid_min_wait).move_to


def judge(current: Offer, offers: list[Offer], policy: str, *, ordered: bool = False,
          blocked: Iterable[Blocked] = (), waited_s: float = 0.0, moves: int = 0,
          max_moves: int = MAX_MOVES, now: float | None = None,
          paid_min_wait: float = PAID_MOVE_MIN_WAIT_S) -> Reconsideration:
    """:func:`reconsider`, with the best other place and why the job moves or stays."""
    if moves >= max_moves:
        return Reconsideration(None, None, f"moved {moves} time(s) already (max_moves "
                                           f"{max_moves})")
    if current.free_now:
        return Reconsideration(None, None, "its place can start it now")
    here = current.place_key
    elsewhere = [o for o in offers if o.place_key != here]
    # a short wait here is not worth paying more to save (PAID_MOVE_MIN_WAIT_S)
    short_wait = (paid_min_wait > 0 and current.wait_seconds is not None
                  and current.wait_seconds < paid_min_wait)
    def later(o: Offer) -> bool:
        return ordered and o.request.index > current.request.index

    others = [o for o in elsewhere if not later(o)
              and not ((policy == "cheapest" or short_wait)
                       and o.price_per_hour > current.price_per_hour)]
    if not others:
        if not elsewhere:
            return Reconsideration(None, None, "no other place takes it")
        if policy == "cheapest":
            why = "cost more (policy cheapest)"
        elif all(map(later, elsewhere)):
            why = "come later in your order"
        else:
            why = ("come later in your order or " if any(map(later, elsewhere)) else "") + (
                f"cost more, and here it starts est. in {_duration(current.wait_seconds)}, "
                f"under paid_move_min_wait ({_duration(paid_min_wait)})")
        return Reconsideration(None, None, "the other places " + why)
    # a place that can start it now wins over a queue, under cheapest too (``rank`` puts the
    # price first there: a cheaper queue without an estimate would hide it)
    free = [o for o in others if o.free_now]
    # the job waits somewhere: a place it failed at stays blocked for a move (no soft lift)
    blocked = [replace(b, soft=False) for b in blocked]
    best = rank(free, policy, ordered=ordered, blocked=blocked, now=now).chosen if free \
        else None
    best = best or rank(others, policy, ordered=ordered, blocked=blocked, now=now).chosen
    if best is None:
        return Reconsideration(None, None,
                               "every other place is blocked, over budget or does not fit")
    wait_here = current.wait_seconds
    waited = f"waited {_duration(waited_s)}; " if waited_s else ""
    there = f"{best.connection}/{best.location}"
    if best.free_now:
        why = (f"{waited}{there} can start it now; here "
               f"{'no start estimate' if wait_here is None else 'est. in ' + _duration(wait_here)}")
    else:
        wait_there = best.wait_seconds
        if wait_here is None or wait_there is None:
            # two guesses without numbers: no clear margin
            return Reconsideration(None, best, f"no clear margin: {there} "
                                   f"{_start_text(best)}, here {_start_text(current)}")
        gain = wait_here - wait_there
        if gain < max(MOVE_GAIN_MIN_S, MOVE_GAIN_SHARE * wait_here):
            return Reconsideration(None, best, (
                f"{there} est. in {_duration(wait_there)} vs here in {_duration(wait_here)}: "
                f"saves {_duration(max(gain, 0))}, under half the wait or 2 min"))
        why = (f"{waited}{there} est. in {_duration(wait_there)} "
               f"vs here in {_duration(wait_here)}")
    if best.price_per_hour > current.price_per_hour:
        why += f"; {_price_text(best.price_per_hour)} vs {_price_text(current.price_per_hour)}"
    # a move allowed only because it costs no more stays so when its target is probed again
    # (the placer caps every move under "cheapest" by itself)
    capped = {"no_costlier": True} if short_wait else {}
    moved = replace(best, details={**best.details, "move_reason": why, **capped})
    return Reconsideration(moved, best, why)


def as_promised(to: Offer, offers: list[Offer], *, max_price: float | None = None
                ) -> Offer | None:
    """``to`` (a move's target, as a look chose it) among ``offers`` (its connection probed
    again, the ledger's holds taken): the fresh offer if it still takes the job as promised,
    else None. Free now stays free now; a queue may be at most 20% and a minute later; the
    price (a spot price moves) at most 5% more, within the request's ``max_hourly_cost`` and
    within ``max_price`` (under "cheapest": the price of the place the job would leave)."""
    fresh = next((o for o in offers if o.place_key == to.place_key
                  and o.request.index == to.request.index and o.fits), None)
    promised = to.wait_seconds or 0.0
    if fresh is None or (to.free_now and not fresh.free_now) or (
            not to.free_now and (fresh.wait_seconds is None
                                 or fresh.wait_seconds > promised * 1.2 + 60)):
        return None
    if fresh.price_per_hour > to.price_per_hour * 1.05 + 1e-9 or over_cap(fresh) or (
            max_price is not None and fresh.price_per_hour > max_price + 1e-9):
        return None
    return fresh


def over_cap(offer: Offer) -> bool:
    """Over the request's ``max_hourly_cost``: a price an instance (a node), as SkyPilot's
    catalog filters instance types (``Resources`` are per node); the offer's is the job's."""
    cap = offer.request.max_hourly_cost
    return cap is not None and offer.price_per_hour / max(1, offer.num_nodes) > cap + 1e-9
