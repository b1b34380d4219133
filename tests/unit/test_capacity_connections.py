"""Which connections the capacity page probes: any id Airflow itself accepts (its
``sanitize_conn_id`` rule), shown escaped and quoted in links; at most 16 asked for in one
``?conn=`` list, while ``[skypilot] connections`` (the menu entry's default) is not capped."""

from __future__ import annotations

import pytest

from airflow_skypilot.backends.base import CapacityRow
from airflow_skypilot.plugins import auth, capacity, routes

ODD = ["team/slurm", "slurm:alpha", "k8s#(eu)", r"aws\gpu", "x!"]  # Airflow allows all of these


class _Probes:
    """Records what was probed; every connection has one free A100."""

    ttl = 10.0

    def __init__(self):
        self.asked: list[list[str]] = []

    def probe(self, conn_ids, timeout, refresh=False):
        self.asked.append(list(conn_ids))
        return ([CapacityRow(c, "p", "A100", total=1, free=1).to_json() for c in conn_ids],
                0.0, 0.0)


@pytest.fixture
def probes(monkeypatch):
    fake = _Probes()
    monkeypatch.setattr(capacity, "PROBES", fake)
    monkeypatch.setattr(capacity, "can_read_connection", lambda user, conn_id: True)
    monkeypatch.setitem(routes.app.dependency_overrides, auth.current_user, lambda: object())
    monkeypatch.setenv("AIRFLOW__SKYPILOT__CONNECTIONS", "")
    return fake


def _get(path, **params):
    from fastapi.testclient import TestClient

    return TestClient(routes.app, root_path="/skypilot").get(path, params=params)


def test_any_connection_id_airflow_accepts_is_probed(probes):
    r = _get("/api/capacity", conn=ODD)
    assert r.status_code == 200, r.text
    assert r.json()["connections"] == ODD and probes.asked == [ODD]
    assert _get("/api/capacity", conn="team/slurm,slurm:alpha").json()["connections"] == \
        ["team/slurm", "slurm:alpha"]


def test_the_page_shows_the_ids_escaped_and_links_them_quoted(probes):
    r = _get("/capacity", conn=["team/slurm", "k8s#(eu)"])
    assert r.status_code == 200, r.text
    assert "<b>team/slurm</b>" in r.text and "<b>k8s#(eu)</b>" in r.text
    assert "capacity?conn=team%2Fslurm&amp;conn=k8s%23%28eu%29&amp;refresh=true" in r.text


# the last four: Airflow takes them, but a secrets backend building a path from the id (Vault's
# connections/<id>) would read outside its connections
@pytest.mark.parametrize("bad", ["bad id", "<b>", "a'b", "é" * 251, "a\tb",
                                 "../variables/db_password", "a/../../b", "/abs", "\\x", "."])
def test_what_airflow_refuses_is_a_400(probes, bad):
    r = _get("/api/capacity", conn=bad)
    assert r.status_code == 400 and "not a connection id" in r.text
    assert probes.asked == []


def test_the_cap_is_on_an_explicit_list_not_on_the_configured_connections(probes, monkeypatch):
    many = [f"slurm:c{i}" for i in range(20)]
    monkeypatch.setenv("AIRFLOW__SKYPILOT__CONNECTIONS", ",".join(many))
    r = _get("/capacity")  # the menu entry, for everyone
    assert r.status_code == 200, r.text
    assert probes.asked == [many]
    r = _get("/api/capacity", conn=many[:17])
    assert r.status_code == 400 and "at most 16 connections" in r.text
    assert _get("/api/capacity", conn=many[:16]).status_code == 200
