"""The capacity hook probes all connections at once; a slow or dead one is skipped, reported."""

from __future__ import annotations

import time

import pytest

from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
from airflow_skypilot.spec import load_task
from tests.fakes import FakeBackend, offer


@pytest.fixture(autouse=True)
def _reset():
    FakeBackend.reset()
    yield
    FakeBackend.reset()


def _hook(conns, timeout=5.0):
    return SkyPilotCapacityHook(conns, timeout=timeout, backend_factory=FakeBackend)


TASK = load_task({"resources": {"accelerators": "A100:1"}})


def test_offers_from_every_connection():
    FakeBackend.offers = {"a": [offer("a")], "b": [offer("b"), offer("b", "q")]}
    result = _hook(["a", "b"]).probe(TASK)
    assert sorted((o.connection, o.location) for o in result.offers) == [
        ("a", "p"), ("b", "p"), ("b", "q")]
    assert result.errors == {}


def test_unreachable_connection_is_reported_and_skipped():
    FakeBackend.offers = {"b": [offer("b")]}
    FakeBackend.down = {"a"}
    result = _hook(["a", "b"]).probe(TASK)
    assert [o.connection for o in result.offers] == ["b"]
    assert result.errors == {"a": "BackendUnreachable: a is down"}


def test_probes_run_concurrently_and_time_out():
    FakeBackend.offers = {"slow": [offer("slow")], "x": [offer("x")], "y": [offer("y")]}
    FakeBackend.delay = {"slow": 3.0, "x": 0.5, "y": 0.5}
    start = time.monotonic()
    result = _hook(["slow", "x", "y"], timeout=1.0).probe(TASK)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, "probes must run in parallel and stop waiting at the timeout"
    assert sorted(o.connection for o in result.offers) == ["x", "y"]
    assert result.errors == {"slow": "no answer within 1s"}


def test_capacity_rows_with_error_rows():
    FakeBackend.offers = {"a": [offer("a", gpus_free=3)]}
    FakeBackend.down = {"b"}
    rows = [r.to_json() for r in _hook(["a", "b"]).capacity()]
    assert rows[0]["connection"] == "a" and rows[0]["free"] == 3 and "error" not in rows[0]
    assert rows[1] == {"connection": "b", "location": "", "accelerator": None, "total": None,
                       "free": None, "pending": None, "price_per_hour": None,
                       "error": "BackendUnreachable: b is down"}


def test_duplicate_connections_probed_once():
    assert _hook(["a", "a", "b"]).connections == ["a", "b"]
