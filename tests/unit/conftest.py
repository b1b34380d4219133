"""Fixtures shared by the unit tests of the operator's moves and looks."""

from __future__ import annotations

import json

import pytest

from airflow_skypilot import rebalance
from airflow_skypilot.backends import registry
from tests.fakes import FakeBackend, offer


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
