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


def test_a_base_exception_in_a_probe_is_reported_as_what_it_was_not_as_a_timeout():
    import asyncio

    class Cancelling(FakeBackend):
        def probe(self, task):
            raise asyncio.CancelledError("loop gone")

    FakeBackend.offers = {"b": [offer("b")]}
    hook = SkyPilotCapacityHook(["a", "b"], timeout=5.0, backend_factory=lambda c: (
        Cancelling(c) if c == "a" else FakeBackend(c)))
    start = time.monotonic()
    result = hook.probe(TASK)
    assert time.monotonic() - start < 2.0
    assert result.errors == {"a": "CancelledError: loop gone"}
    assert [o.connection for o in result.offers] == ["b"]


def test_a_configuration_error_belongs_to_the_call_that_met_it():
    from airflow_skypilot.exceptions import ConfigurationError

    FakeBackend.offers = {"a": [offer("a")], "b": [offer("b")]}
    made = []

    def factory(conn_id):
        made.append(conn_id)
        if conn_id == "a" and made.count("a") == 1:
            raise ConfigurationError("connection 'a' is not defined")
        return FakeBackend(conn_id)

    hook = SkyPilotCapacityHook(["a", "b"], timeout=5.0, backend_factory=factory)
    first = hook.probe(TASK)
    assert first.config_errors == {"a": "ConfigurationError: connection 'a' is not defined"}
    assert [o.connection for o in first.offers] == ["b"]
    second = hook.probe(TASK)  # the connection was defined since: it answers now
    assert second.config_errors == {} and second.errors == {}
    assert sorted(o.connection for o in second.offers) == ["a", "b"]
    assert hook.find_all("x").config_errors == {}


def test_a_hung_connection_is_not_probed_again_while_its_thread_runs():
    import threading

    FakeBackend.offers = {"a": [offer("a")], "b": [offer("b")]}
    FakeBackend.delay = {"a": 1.5}
    hook = _hook(["a", "b"], timeout=0.2)
    assert hook.probe(TASK).errors == {"a": "no answer within 0.2s"}
    for _ in range(3):
        result = hook.probe(TASK)
        assert list(result.errors) == ["a"]
        assert result.errors["a"].startswith("still probing since ")
        assert [o.connection for o in result.offers] == ["b"]
    assert [t.name for t in threading.enumerate()].count("probe-a") == 1
    time.sleep(1.6)  # the hung probe returned: the next call probes the connection again
    FakeBackend.delay = {}
    result = hook.probe(TASK)
    assert result.errors == {} and sorted(o.connection for o in result.offers) == ["a", "b"]
