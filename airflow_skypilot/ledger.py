"""The deployment's own placements decided moments ago, so a sweep does not herd.

N mapped tasks that place at the same moment all probe before any of them has submitted: each
sees the same free place, and all but the first queue behind it (or are refused by it). The
backends cannot show a job that does not exist yet, so placement keeps its own note.

Protocol (one JSON file, ``[skypilot] placement_ledger``, shared by the workers of one machine
or of any that mount it; an empty value turns it off):

1. A placer probes (slowly, outside any lock).
2. Under an exclusive ``flock`` on the file it reads the live entries, takes from each offer
   what entries not yet visible to that offer hold (:func:`hold`), ranks, and writes its own
   entry for the chosen place: ``{"copy", "place", "gpus", "nodes", "at"}``. The lock is held
   for the ranking only (milliseconds), never across a submission.
3. After the submission it stamps ``submitted`` and the job's name on its entry (or drops the
   entry when the place refused). An entry counts against a probe only while that probe cannot
   have seen the job: the job was not yet submitted, or was submitted after the probe began
   (less the backend's ``VISIBLE_AFTER``). A probe begun later sees the job itself (pending
   jobs, pods, launching instances): counting it again would make the place look fuller than
   it is. A probe that names the jobs whose room it counts (``Offer.jobs_seen``: Slurm,
   Kubernetes) settles the case time cannot: begun before a submission, it read the queue
   after it; an entry whose job it named is in its counts already.
4. Entries lapse ``TTL`` seconds after they were written (a worker that died mid-placement).
   Times are the writers' clocks: an entry stamped in a reader's future counts from the
   reader's now; a writer whose clock runs behind has its entries lapse early (the workers
   sharing a file should keep their clocks in step, as NTP does).

A ledger that cannot be read or written, or an entry that cannot be read, is logged and
ignored: it only ever makes a place look fuller, so without it placement is what it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_skypilot.backends.base import Offer

log = logging.getLogger(__name__)

#: seconds an entry lives at most (a placement whose worker died before it submitted)
TTL = 180.0
#: seconds after a submission before a backend's listing shows the job itself (squeue and the
#: Kubernetes API at once; EC2's DescribeInstances is eventually consistent)
VISIBLE_AFTER = {"aws": 5.0}
VISIBLE_AFTER_DEFAULT = 0.1


def ledger_path() -> str:
    """``[skypilot] placement_ledger``, else ``$AIRFLOW_HOME/skypilot/placements.json``."""
    from airflow.sdk.configuration import conf

    home = os.environ.get("AIRFLOW_HOME") or os.path.expanduser("~/airflow")
    path = conf.get("skypilot", "placement_ledger",
                    fallback=os.path.join(home, "skypilot", "placements.json")) or ""
    # the default names $AIRFLOW_HOME, which Airflow leaves as written when the variable is
    # not set (its home is then ~/airflow): a directory named "$AIRFLOW_HOME" in the cwd
    path = path.replace("${AIRFLOW_HOME}", home).replace("$AIRFLOW_HOME", home)
    return os.path.expanduser(path)


def _gpus(offer: Offer) -> int:
    return int(math.ceil(offer.gpus_per_node * offer.num_nodes)) if offer.gpus_per_node else 0


def hold(offers: list[Offer], entries: list[dict[str, Any]], *, probe_began: float,
         own: str = "") -> list[Offer]:
    """``offers`` (of a probe begun at ``probe_began``) with what ``entries`` hold taken from
    their places (in place; returned).

    An entry holds room at its own place and at every place that shares capacity with it
    (``Offer.shares_capacity_with``: a Slurm partition whose nodes another one has too; an
    entry there is counted whole, as if its job took the shared nodes: conservative).
    GPUs first: a place's free GPUs shrink by the entries' GPUs, and its free nodes to what
    the GPUs left can fill. A CPU-only entry takes whole nodes (we do not know how it packs).
    An offer that is no longer free now gets an unknown start (it waits behind jobs whose
    length nobody knows yet), ``details["held_by_placements"]`` and a note for the table.
    """
    for offer in offers:
        places = {offer.place_key, *offer.shares_capacity_with}
        lag = VISIBLE_AFTER.get(offer.backend, VISIBLE_AFTER_DEFAULT)
        mine = [e for e in entries if e.get("place") in places and e.get("copy") != own
                and _unseen(e, probe_began, lag) and e.get("job") not in (offer.jobs_seen or ())]
        if not mine or not offer.fits:
            continue
        was_free = offer.free_now
        gpus = sum(int(e.get("gpus") or 0) for e in mine)
        nodes = sum(int(e.get("nodes") or 1) for e in mine if not e.get("gpus"))
        if offer.gpus_free is not None and gpus:
            offer.gpus_free = max(0, offer.gpus_free - gpus)
        if offer.nodes_free is not None:
            free = offer.nodes_free - nodes
            if offer.gpus_per_node and offer.gpus_free is not None and gpus:
                free = min(free, int(offer.gpus_free // offer.gpus_per_node))
            elif gpus and not offer.gpus_per_node:
                free -= sum(int(e.get("nodes") or 1) for e in mine if e.get("gpus"))
            offer.nodes_free = max(0, free)
        offer.details["held_by_placements"] = len(mine)
        what = f"{gpus} GPUs" if gpus else f"{nodes} nodes"
        offer.notes.append(f"{what} taken by {len(mine)} placement(s) made moments ago")
        if was_free and not offer.free_now:
            offer.est_start = None
            offer.details["estimate"] = "unknown"
        if not offer.free_now and offer.pending_jobs is not None:
            # they wait there now too: the queue a later placement would join is longer
            offer.pending_jobs += len(mine)
    return offers


def _unseen(entry: dict[str, Any], probe_began: float, lag: float) -> bool:
    submitted = entry.get("submitted")
    return submitted is None or probe_began < float(submitted) + lag


class PlacementLedger:
    """The file of the protocol above. ``path`` empty: a ledger that holds nothing."""

    def __init__(self, path: str, *, ttl: float = TTL):
        self.path = Path(path) if path else None
        self.ttl = ttl

    @contextlib.contextmanager
    def deciding(self) -> Iterator[list[dict[str, Any]]]:
        """Hold the lock while the caller ranks; yields the live entries (a list the caller
        appends its own entry to, written back on exit). A file that cannot be opened, locked,
        read or written is logged and placement goes on without it: the ledger must never
        fail a placement, nor a submission already made (its stamp comes after it)."""
        if self.path is None:
            yield []
            return
        fh = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600), "rb+")
            fcntl.flock(fh, fcntl.LOCK_EX)
            text = fh.read().decode("utf-8", errors="replace")
        except OSError as exc:
            if fh is not None:
                fh.close()
            log.warning("Placement ledger %s unusable, placing without it: %s", self.path, exc)
            yield []
            return
        with fh:
            entries = self._live(text)
            yield entries
            if json.dumps(entries) != text:  # ours added or stamped, or some lapsed
                try:
                    self._write(fh, entries)
                except OSError as exc:
                    log.warning("Placement ledger %s could not be written: %s", self.path, exc)

    def _live(self, text: str) -> list[dict[str, Any]]:
        """The entries of ``text`` that have not lapsed; malformed ones are dropped one by one.
        An entry stamped in our future (a writer whose clock runs ahead) counts from now."""
        try:
            raw = json.loads(text) if text.strip() else []
        except ValueError:
            raw = None
        if not isinstance(raw, list):
            log.warning("Placement ledger %s is not a JSON list; starting it afresh", self.path)
            return []
        now = time.time()
        live = []
        for entry in raw:
            try:
                at = float(entry["at"])
                if entry.get("submitted") is not None:
                    float(entry["submitted"])
                int(entry.get("gpus") or 0), int(entry.get("nodes") or 1)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
            if at > now:
                entry["at"] = at = now
            if now - at < self.ttl:
                live.append(entry)
        return live

    @staticmethod
    def _write(fh, entries: list[dict[str, Any]]) -> None:
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(entries).encode())
        fh.flush()

    def note(self, entries: list[dict[str, Any]], copy: str, offer: Offer) -> None:
        """Inside :meth:`deciding`: this task's copy goes to ``offer``'s place (``copy`` names
        the task instance: it has one live copy, so a later placement replaces the entry)."""
        entries[:] = [e for e in entries if e.get("copy") != copy]
        entries.append({"copy": copy, "place": offer.place_key, "gpus": _gpus(offer),
                        "nodes": offer.num_nodes, "at": time.time()})

    def submitted(self, copy: str, ok: bool, job: str | None = None) -> None:
        """After the submission: stamp the entry with the time and the job's name (the backend
        shows the job from now), or drop it (the place refused, nothing holds room there)."""
        with self.deciding() as entries:
            if ok:
                for e in entries:
                    if e.get("copy") == copy:
                        e["submitted"] = time.time()
                        if job:
                            e["job"] = job
            else:
                entries[:] = [e for e in entries if e.get("copy") != copy]
