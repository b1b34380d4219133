"""Fixtures shared by the unit tests: a home of their own, and the operator's moves and looks."""

from __future__ import annotations

import json

import pytest

from airflow_skypilot import rebalance
from airflow_skypilot.backends import registry
from tests.fakes import FakeBackend, offer


@pytest.fixture(autouse=True)
def _own_home(tmp_path_factory, monkeypatch):
    """An empty ``$HOME`` for every unit test: the job scripts they run read ``~/.bashrc``,
    as SkyPilot's prologue does, and the machine's own (a ``pyenv init`` whose rehash waits
    60 s for a lock a killed job left behind, a ``conda init``) must not decide a test, nor a
    test's killed job leave such a lock for the machine's user."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture
def c1_queues_c2_full(monkeypatch):
    """Two connections of the in-memory backend: c1 can queue a job (est. 1 h), c2 is full
    with no estimate; the trigger's shared probes start empty."""
    registry.register_backend(FakeBackend)
    for conn in ("c1", "c2"):
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn.upper()}", json.dumps({"conn_type": "fake"}))
    FakeBackend.reset()
    rebalance._cache.clear()
    FakeBackend.offers = {"c1": [offer("c1", "p", nodes_free=0, est_in=3600)],
                          "c2": [offer("c2", "q", nodes_free=0, est_in=None)]}
    yield
    FakeBackend.reset()
    rebalance._cache.clear()
