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
from airflow_skypilot.ledger import VISIBLE_AFTER, PlacementLedger, hold
from airflow_skypilot.operators import SkyPilotOperator
from tests.fakes import FakeBackend, offer


def _entry(place, gpus=1, nodes=1, submitted=None, copy="other", at=None):
    e = {"copy": copy, "place": place, "gpus": gpus, "nodes": nodes, "at": at or time.time()}
    if submitted is not None:
        e["submitted"] = submitted
    return e


def test_room_chosen_moments_ago_is_not_free():
    o = offer("c1", "p", gpus_free=2, nodes_free=1)
    hold([o], [_entry("c1/p", gpus=2)])
    assert (o.gpus_free, o.nodes_free, o.free_now) == (0, 0, False)
    assert o.est_start is None and o.details["estimate"] == "unknown"
    assert o.notes == ["2 GPUs taken by 1 placement(s) made moments ago"]


def test_what_is_left_still_takes_a_job():
    o = offer("c1", "p", gpus_free=8, nodes_free=1)
    hold([o], [_entry("c1/p", gpus=3), _entry("c1/p", gpus=4, copy="b")])
    assert (o.gpus_free, o.free_now) == (1, True)


def test_a_job_the_backend_already_shows_is_not_counted_twice():
    o = offer("c1", "p", gpus_free=1)  # probed now
    hold([o], [_entry("c1/p", submitted=time.time() - VISIBLE_AFTER - 1)])
    assert o.gpus_free == 1 and "held_by_placements" not in o.details
    # a probe that began before the job could show is still held
    hold([o], [_entry("c1/p", submitted=time.time())])
    assert o.gpus_free == 0


def test_own_entry_other_places_and_cpu_only_entries():
    gpu = offer("c1", "p", gpus_free=1)
    other = offer("c2", "q", gpus_free=1)
    hold([gpu, other], [_entry("c1/p", copy="me")], own="me")
    assert gpu.gpus_free == 1 and other.gpus_free == 1
    cpu = offer("c3", "r", acc=None, gpus_free=None, gpus_total=None, nodes_free=2)
    hold([cpu], [_entry("c3/r", gpus=0, nodes=2)])
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


def test_a_place_that_shows_jobs_at_once_stops_counting_them_sooner():
    # Slurm shows a job once sbatch returns: a probe 2 s after the submission counts the job
    # itself, and the ledger's entry must not take its GPU a second time
    submitted = time.time() - 2
    o = offer("c1", "p", gpus_free=1)
    o.shows_jobs_after = 0.1
    hold([o], [_entry("c1/p", submitted=submitted)])
    assert o.gpus_free == 1 and "held_by_placements" not in o.details
    # ...but one that began before the submission's end (plus the skew margin) is held
    o = offer("c1", "p", gpus_free=1)
    o.shows_jobs_after = 0.1
    o.probed_at = submitted + 0.05
    hold([o], [_entry("c1/p", submitted=submitted)])
    assert o.gpus_free == 0
    # the default lag still holds an offer that says nothing
    o = offer("c1", "p", gpus_free=1)
    hold([o], [_entry("c1/p", submitted=submitted)])
    assert o.gpus_free == 0



def test_slurm_offers_show_jobs_at_once_and_their_probe_time_is_sub_second():
    from airflow_skypilot.backends.slurm.cluster import parse_cluster
    from tests.unit.test_slurm_package import _offers
    from tests.unit.test_slurm_parse import PROBE

    _, got = _offers({"accelerators": "A100:1"})
    batch = got["batch"]
    assert batch.shows_jobs_after is not None and 0 < batch.shows_jobs_after < VISIBLE_AFTER
    free = batch.gpus_free
    # a sweep-mate submitted there 2 s before this probe: the probe counts its job itself
    hold([batch], [_entry(batch.place_key, submitted=batch.probed_at - 2)])
    assert batch.gpus_free == free
    # the login node's clock with its fraction (``date +%s.%N``): a second's truncation would
    # make a probe look up to a second older than it is
    head, _, rest = PROBE.partition("@@now\n")
    state = parse_cluster(head + "@@now\n1764565691.25\n" + rest.split("\n", 1)[1])
    assert state.now == 1764565691.25


def test_a_placement_in_a_partition_holds_room_in_the_partitions_sharing_its_nodes():
    # alpha: batch = a1 + a2, short = a2. A placement on short takes a GPU batch has too (and
    # one on batch may take one of short's): the other partition's offer counts it.
    from tests.unit.test_slurm_package import _offers

    _, got = _offers({"accelerators": "A100:1"})
    batch, short = got["batch"], got["short"]
    assert short.place_key in batch.shares_capacity_with
    assert batch.place_key in short.shares_capacity_with
    free = batch.gpus_free, short.gpus_free
    hold([batch, short], [_entry(short.place_key), _entry(batch.place_key, copy="b")])
    assert (batch.gpus_free, short.gpus_free) == (free[0] - 2, free[1] - 2)
    # a partition of no shared node is left alone
    assert got["empty"].shares_capacity_with == []
