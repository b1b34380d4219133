"""A sweep does not herd: placements decided moments ago hold their room in the ledger until
the backends show the jobs themselves (ledger.py). Real threads and a real file lock."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_skypilot.backends import registry
from airflow_skypilot.ledger import VISIBLE_AFTER_DEFAULT, PlacementLedger, hold
from airflow_skypilot.operators import SkyPilotOperator
from tests.fakes import FakeBackend, offer


def _entry(place, gpus=1, nodes=1, submitted=None, copy="other", at=None):
    e = {"copy": copy, "place": place, "gpus": gpus, "nodes": nodes, "at": at or time.time()}
    if submitted is not None:
        e["submitted"] = submitted
    return e


def test_room_chosen_moments_ago_is_not_free():
    o = offer("c1", "p", gpus_free=2, nodes_free=1)
    hold([o], [_entry("c1/p", gpus=2)], probe_began=time.time())
    assert (o.gpus_free, o.nodes_free, o.free_now) == (0, 0, False)
    assert o.est_start is None and o.details["estimate"] == "unknown"
    assert o.notes == ["2 GPUs taken by 1 placement(s) made moments ago"]


def test_what_is_left_still_takes_a_job():
    o = offer("c1", "p", gpus_free=8, nodes_free=1)
    hold([o], [_entry("c1/p", gpus=3), _entry("c1/p", gpus=4, copy="b")], probe_began=time.time())
    assert (o.gpus_free, o.free_now) == (1, True)


def test_a_job_the_backend_already_shows_is_not_counted_twice():
    began = time.time()
    o = offer("c1", "p", gpus_free=1)
    hold([o], [_entry("c1/p", submitted=began - VISIBLE_AFTER_DEFAULT - 1)], probe_began=began)
    assert o.gpus_free == 1 and "held_by_placements" not in o.details
    # submitted after the probe began: the probe may not have seen it
    hold([o], [_entry("c1/p", submitted=began + 0.5)], probe_began=began)
    assert o.gpus_free == 0


def test_a_job_the_probe_listed_by_name_is_not_counted_twice():
    # the probe began before the sweep-mate's submission but listed its job (then read the
    # capacity with it): time alone would count it twice, the name says it is in the counts
    began = time.time()
    entry = _entry("c1/p", submitted=began + 0.5)
    entry["job"] = "sky-mate-a0"
    o = offer("c1", "p", gpus_free=1)
    o.jobs_seen = frozenset({"sky-mate-a0", "someone-elses"})
    hold([o], [entry], probe_began=began)
    assert o.gpus_free == 1 and "held_by_placements" not in o.details
    # a probe that listed other jobs (it read the queue before the submission) holds the room
    o = offer("c1", "p", gpus_free=1)
    o.jobs_seen = frozenset({"sky-other-a0"})
    hold([o], [entry], probe_began=began)
    assert o.gpus_free == 0
    # so does one whose backend lists no jobs, and an entry not yet submitted (no name)
    o = offer("c1", "p", gpus_free=1)
    hold([o], [entry], probe_began=began)
    assert o.gpus_free == 0
    o = offer("c1", "p", gpus_free=1)
    o.jobs_seen = frozenset({"sky-mate-a0"})
    hold([o], [_entry("c1/p")], probe_began=began)
    assert o.gpus_free == 0


def test_the_submitted_stamp_names_the_job(tmp_path):
    ledger = PlacementLedger(str(tmp_path / "l.json"))
    with ledger.deciding() as entries:
        ledger.note(entries, "sky-t-", offer("c1", "p", gpus_free=1))
    ledger.submitted("sky-t-", True, "sky-t-c0-t1-a0")
    [entry] = json.loads((tmp_path / "l.json").read_text())
    assert entry["job"] == "sky-t-c0-t1-a0" and entry["submitted"] <= time.time()


def test_placements_made_moments_ago_join_the_queue_a_later_one_would_join():
    # a queue: the entries wait there too, so its work ahead grows by them (placement ranks
    # queues alike by it: a sweep spreads over them instead of piling onto the first by name)
    o = offer("c1", "p", gpus_free=0, nodes_free=0, pending=3)
    hold([o], [_entry("c1/p"), _entry("c1/p", copy="b")], probe_began=time.time())
    assert o.pending_jobs == 5 and not o.free_now
    free = offer("c1", "q", gpus_free=8, nodes_free=1, pending=0)
    hold([free], [_entry("c1/q")], probe_began=time.time())
    assert free.free_now and free.pending_jobs == 0  # room left: nobody waits


def test_a_partition_sharing_nodes_with_the_placements_is_held_too():
    batch = offer("slurm_alpha", "batch", gpus_free=3)  # a1 + a2
    batch.shares_capacity_with = ["slurm_alpha/short"]
    short = offer("slurm_alpha", "short", gpus_free=3)  # a2
    short.shares_capacity_with = ["slurm_alpha/batch"]
    hold([batch, short], [_entry("slurm_alpha/short", gpus=3)], probe_began=time.time())
    assert (batch.gpus_free, short.gpus_free) == (0, 0)
    assert not batch.free_now and not short.free_now


def test_own_entry_other_places_and_cpu_only_entries():
    gpu = offer("c1", "p", gpus_free=1)
    other = offer("c2", "q", gpus_free=1)
    hold([gpu, other], [_entry("c1/p", copy="me")], probe_began=time.time(), own="me")
    assert gpu.gpus_free == 1 and other.gpus_free == 1
    cpu = offer("c3", "r", acc=None, gpus_free=None, gpus_total=None, nodes_free=2)
    hold([cpu], [_entry("c3/r", gpus=0, nodes=2)], probe_began=time.time())
    assert cpu.nodes_free == 0 and not cpu.free_now


def test_entries_lapse_and_a_refused_placement_frees_its_room(tmp_path):
    ledger = PlacementLedger(str(tmp_path / "l.json"), ttl=60)
    with ledger.deciding() as entries:
        ledger.note(entries, "a", offer("c1", "p"))
        entries.append(_entry("c2/q", at=time.time() - 61))  # a worker that died long ago
    with ledger.deciding() as entries:
        assert [e["copy"] for e in entries] == ["a"]
    ledger.submitted("a", ok=False)
    with ledger.deciding() as entries:
        assert entries == []
    assert json.loads((tmp_path / "l.json").read_text()) == []


def test_an_unusable_ledger_places_as_without_one(tmp_path):
    (tmp_path / "file").write_text("")
    ledger = PlacementLedger(str(tmp_path / "file" / "l.json"))  # its parent is a file
    with ledger.deciding() as entries:
        assert entries == []
    (tmp_path / "bad.json").write_text("{not json")
    with PlacementLedger(str(tmp_path / "bad.json")).deciding() as entries:
        assert entries == []


def test_a_damaged_ledger_is_read_entry_by_entry_and_never_fails_a_placement(tmp_path):
    path = tmp_path / "l.json"
    good = _entry("c1/p", copy="good")
    for damaged in (b'[{"copy": "x"\xff\xfe', b"5", b'{"copy": "x"}'):
        path.write_bytes(damaged)  # a torn write, a bad block, a hand edit
        with PlacementLedger(str(path)).deciding() as entries:
            assert entries == []
    path.write_text(json.dumps([{"copy": "x", "place": "c1/p", "at": None}, "junk",
                                {**good, "gpus": "two"}, {**good, "submitted": "soon"}, good]))
    with PlacementLedger(str(path)).deciding() as entries:
        assert [e["copy"] for e in entries] == ["good"]


def test_a_ledger_that_cannot_be_written_does_not_fail_the_stamp_after_a_submission(
        tmp_path, monkeypatch, caplog):
    # the job is submitted: a full disk must not fail the task (its job would run unwatched)
    ledger = PlacementLedger(str(tmp_path / "l.json"))
    with ledger.deciding() as entries:
        ledger.note(entries, "a", offer("c1", "p"))

    def full(fh, entries):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PlacementLedger, "_write", staticmethod(full))
    ledger.submitted("a", True, "sky-a-c0-t1-a0")
    assert "could not be written" in caplog.text


def test_an_entry_from_a_clock_running_ahead_lapses_by_ours(tmp_path):
    path = tmp_path / "l.json"
    path.write_text(json.dumps([_entry("c1/p", at=time.time() + 600)]))
    ledger = PlacementLedger(str(path), ttl=60)
    with ledger.deciding() as entries:
        assert len(entries) == 1 and entries[0]["at"] <= time.time()
    stored = json.loads(path.read_text())[0]["at"]
    assert stored <= time.time()  # written back as now: it lapses 60 s from now, not 660


@pytest.fixture
def _two_free_places(monkeypatch):
    registry.register_backend(FakeBackend)
    for conn in ("c1", "c2"):
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn.upper()}", json.dumps({"conn_type": "fake"}))
    FakeBackend.reset()
    # 4 free A100 on each; every probe takes 0.3 s, so the sweep's probes all overlap
    FakeBackend.offers = {"c1": [offer("c1", "p", gpus_free=4)],
                          "c2": [offer("c2", "q", gpus_free=4)]}
    FakeBackend.delay = {"c1": 0.3, "c2": 0.3}
    lock = threading.Lock()
    submit = FakeBackend.submit

    def locked(self, *args, **kwargs):
        with lock:
            return submit(self, *args, **kwargs)

    monkeypatch.setattr(FakeBackend, "submit", locked)
    yield
    FakeBackend.reset()


def _sweep_of(n: int) -> Counter:
    """``n`` mapped members placing at the same moment, each in its own thread: where each
    member's job went."""
    where: dict[int, str] = {}

    def member(i: int) -> None:
        ti = SimpleNamespace(dag_id="dag", task_id="train", run_id="manual__1", try_number=1,
                             map_index=i, start_date=None, xcom_push=lambda *a, **k: None)
        op = SkyPilotOperator(task_id="train", deferrable=True, connections=["c1", "c2"],
                              task={"resources": {"accelerators": "A100:1"}, "run": "train"})
        try:
            op.execute({"ti": ti, "dag_run": SimpleNamespace(clear_number=0, start_date=None)})
        except TaskDeferred as deferred:
            where[i] = deferred.trigger.handle["connection"]

    threads = [threading.Thread(target=member, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(where) == n, where
    return Counter(where.values())


@pytest.mark.usefixtures("_two_free_places")
def test_a_sweep_placing_at_once_spreads_over_the_free_places():
    assert _sweep_of(8) == {"c1": 4, "c2": 4}
    assert len(FakeBackend.jobs) == 8, "one job per member, none submitted twice"


@pytest.mark.usefixtures("_two_free_places")
def test_without_the_ledger_the_same_sweep_herds(monkeypatch):
    monkeypatch.setenv("AIRFLOW__SKYPILOT__PLACEMENT_LEDGER", "")
    assert _sweep_of(8) == {"c1": 8}


def test_the_default_ledger_is_under_airflows_home_when_airflow_home_is_not_set(monkeypatch,
                                                                                 tmp_path):
    """Airflow leaves "$AIRFLOW_HOME" as written when the variable is unset (its home is then
    ~/airflow): the ledger was a directory named "$AIRFLOW_HOME" in the worker's cwd."""
    from airflow_skypilot.ledger import ledger_path

    monkeypatch.delenv("AIRFLOW__SKYPILOT__PLACEMENT_LEDGER")  # the suite's own: the default
    monkeypatch.delenv("AIRFLOW_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ledger_path() == str(tmp_path / "airflow" / "skypilot" / "placements.json")
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "af"))
    assert ledger_path() == str(tmp_path / "af" / "skypilot" / "placements.json")
