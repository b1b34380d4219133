"""The pages' pictures and summaries, pure: SVG timeline and bars, zone-grouped placement rows,
waiting jobs, GPU-hours per connection. The browser test renders them in Chromium."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest

from airflow_skypilot.plugins import charts, formatting, jobs, routes, usage

XSS = "<img src=x onerror=alert(1)>"


def _attempt(conn, state, sub, start, end, **kw):
    return {"connection": conn, "location": "p", "job_id": "1", "state": state,
            "reason": kw.pop("reason", ""), "submitted_at": sub, "started_at": start,
            "ended_at": end, **kw}


def test_timeline_draws_one_group_per_attempt_escaped():
    lanes = routes.attempt_lanes(
        [_attempt("k8s", "infra_failed", 1000, 1010, 1300, reason=XSS),
         _attempt("slurm", "succeeded", 1320, 1330, 1900)],
        [{"place": "slurm/p", "first_at": 1321, "last_at": 1325, "count": 2,
          "outcome": "stayed", "why": XSS}])
    svg = str(charts.timeline(lanes, now=2000))
    assert svg.startswith('<svg class="chart timeline"')
    assert re.findall(r'class="attempt" data-attempt="(\d)" data-state="(\w+)"', svg) == [
        ("1", "infra_failed"), ("2", "succeeded")]
    assert svg.count('class="look-mark"') == 1 and XSS not in svg
    assert "&lt;img src=x onerror=alert(1)&gt;" in svg
    assert charts.timeline([], now=1) == ""


def test_a_moved_attempt_points_at_the_next_and_an_open_one_runs_to_now():
    lane = {"label": "[0]", "attempts": [
        _attempt("a", "moved", 100, None, 200), _attempt("b", "running", 210, 220, None)]}
    svg = str(charts.timeline([lane], now=400))
    assert svg.count('class="arrow"') == 1 and 'class="run"' in svg
    assert "<title>now</title>" in svg


def test_capacity_bars_per_place_and_per_quota():
    groups = routes.capacity_groups([
        {"connection": "slurm", "location": "batch", "accelerator": "A100", "total": 8,
         "free": 3, "pending": 2, "price_per_hour": 0},
        *({"connection": "aws", "location": f"us-east-1/us-east-1{z}", "accelerator": "A100",
           "total": None, "free": 16, "pending": None, "price_per_hour": 22} for z in "abc"),
        {"connection": "aws", "location": "us-west-2/us-west-2a", "accelerator": "A100",
         "total": None, "free": 8, "pending": None, "price_per_hour": 22},
        {"connection": "down", "location": "", "accelerator": None, "error": "boom"}])
    aws = next(g for g in groups if g["connection"] == "aws")
    assert [(r["location"], r["grouped"]) for r in aws["rows"]] == [
        ("us-east-1/{a,b,c}", True), ("us-west-2/us-west-2a", False)]
    bars = routes.capacity_bars(groups)
    assert bars == [
        {"connection": "slurm", "label": "batch · A100", "total": 8, "free": 3, "pending": 2},
        {"connection": "aws", "label": "A100 · 2 region(s)", "total": None, "free": 24,
         "pending": 0}]
    svg = str(charts.capacity(bars))
    assert svg.count('class="place"') == 2 and "3/8 free, 2 pending" in svg
    assert "24 startable" in svg


def _capacity_html(groups):
    from airflow_skypilot.plugins.formatting import TEMPLATES

    return TEMPLATES.get_template("skypilot/capacity.html").render(
        prefix="/skypilot", ui_base="", nonce="n", page="capacity", title="t", user_name="",
        conns=[g["connection"] for g in groups], explicit=True, query="", groups=groups,
        chart=charts.capacity(routes.capacity_bars(groups)),
        data={"probed_at": 0, "seconds": 1.0, "ttl": 10, "timeout": 5, "rows": []})


def test_a_slurm_node_in_two_partitions_counts_once_in_the_connections_total():
    from airflow_skypilot.backends.slurm.cluster import ClusterState, NodeInfo, PartitionInfo
    from airflow_skypilot.backends.slurm.offers import capacity_rows
    from airflow_skypilot.backends.slurm.settings import SlurmSettings

    # the sandbox's slurm_alpha: batch = a1, a2; short = a2; 4 A100 each, 2 busy on a2
    nodes = {name: NodeInfo(name, parts, "mixed", 8, 0, 16000, 0, {"a100": 4}, {"a100": used})
             for name, parts, used in (("a1", ["batch"], 0), ("a2", ["batch", "short"], 2))}
    state = ClusterState(nodes=nodes, partitions={p: PartitionInfo(p) for p in ("batch",
                                                                              "short")}, now=0)
    rows = [r.to_json() for r in capacity_rows(
        state, SlurmSettings.from_extra("slurm_alpha", {"cluster": "alpha"}), "slurm_alpha")]
    assert [(r["location"], r["free"], r["total"]) for r in rows] == [("batch", 6, 8),
                                                                     ("short", 2, 4)]
    [group] = routes.capacity_groups(rows)
    assert "6 of 8 GPUs free" in _capacity_html([group])
    assert (group["free"], group["total"], group["unknown"]) == (6, 8, 0)
    # each partition keeps its own bar: what a job sent there can get
    assert [(b["label"], b["free"], b["total"]) for b in routes.capacity_bars([group])] == [
        ("batch · A100", 6, 8), ("short · A100", 2, 4)]


def test_rows_without_the_node_names_still_add_up():
    groups = routes.capacity_groups([
        {"connection": "k", "location": "ns", "accelerator": a, "total": 8, "free": 3}
        for a in ("A100", "H100")])
    assert (groups[0]["free"], groups[0]["total"]) == (6, 16)


def test_a_free_count_that_is_not_known_is_shown_as_unknown_not_as_zero():
    note = {"free": "unknown", "note": "pods cannot be listed (403)"}
    groups = routes.capacity_groups([
        {"connection": "k8s", "location": "k8s/default", "accelerator": "A100", "total": 8,
         "free": None, "pending": None, "price_per_hour": 0, "details": note},
        {"connection": "mixed", "location": "a", "accelerator": "A100", "total": 8,
         "free": 3, "pending": None, "price_per_hour": 0},
        {"connection": "mixed", "location": "b", "accelerator": "H100", "total": 4,
         "free": None, "pending": None, "price_per_hour": 0, "details": note}])
    html = _capacity_html(groups)
    assert "8 GPUs, free unknown" in html
    assert "3 of 8 GPUs free; 4 more, free unknown" in html
    assert "0 of 8 GPUs free" not in html and "of 12 GPUs free" not in html
    assert [(g["free"], g["total"], g["unknown"]) for g in groups] == [(0, 8, 8), (3, 12, 4)]
    assert html.count("? / ") == 2  # in the table too
    bars = routes.capacity_bars(groups)
    assert [(b["label"], b["free"], b["total"]) for b in bars] == [
        ("k8s/default · A100", None, 8), ("a · A100", 3, 8), ("b · H100", None, 4)]
    svg = str(charts.capacity(bars))
    # drawn whole, without a used/free split, and labelled unknown
    assert svg.count('class="unknown"') == 2 and svg.count('class="used"') == 1
    assert "8 GPUs, free unknown" in svg and "0/8 free" not in svg and "3/8 free" in svg


def test_a_quota_that_is_not_known_is_not_drawn_as_none_startable():
    groups = routes.capacity_groups([
        {"connection": "aws", "location": f"us-east-1/us-east-1{z}", "accelerator": "A100",
         "total": None, "free": None} for z in "ab"])
    bars = routes.capacity_bars(groups)
    assert bars == [{"connection": "aws", "label": "A100 · 1 region(s)", "total": None,
                     "free": None, "pending": 0}]
    svg = str(charts.capacity(bars))
    assert "startable unknown" in svg and "0 startable" not in svg


def test_placement_groups_keep_each_zone():
    rows = [{"verdict": "chosen", "connection": "k", "location": "ns", "rank": 1,
             "reason": "free now"}]
    rows += [{"verdict": "candidate", "connection": "aws", "location": f"us-east-1/us-east-1{z}",
              "request": "A100:2", "free": "16/16 A100", "start": "now", "price": "$22/h",
              "reason": "$22/h vs $0/h", "rank": 2 + i} for i, z in enumerate("abcd")]
    groups = jobs.placement_groups(rows)
    assert [(g["row"]["location"], g["row"]["rank_text"], len(g["members"])) for g in groups] \
        == [("ns", "1", 1), ("us-east-1/{a,b,c,d}", "2\u20135", 4)]


def test_a_deferred_queued_job_is_waiting_with_its_last_look():
    attempts = [{"connection": "slurm_beta", "location": "main", "job_id": "7",
                 "state": "pending", "submitted_at": 100.0}]
    looks = [{"place": "slurm_beta/main", "est_start": 5000.0, "best": "aws/x", "count": 3,
              "last_at": 400.0, "outcome": "stayed", "why": "no clear margin"}]
    w = jobs.waiting_view("deferred", attempts, "running", looks, None, 3)
    assert (w["place"], w["since"], w["est_start"], w["looks_total"]) == \
        ("slurm_beta/main", 100.0, 5000.0, 3)
    assert jobs.waiting_view("success", attempts, "result", looks, None) is None
    # the watch saw it start since the deferral: running, not waiting
    seen, view = jobs.watch_view(attempts, "running", {
        "job_id": "7", "connection": "slurm_beta", "state": "running", "started_at": 500.0,
        "looks": looks, "looks_total": 3}, None)
    assert seen[-1]["state"] == "running" and seen[-1]["started_at"] == 500.0
    assert view["looks_total"] == 3
    assert jobs.waiting_view("deferred", seen, "running", looks, None) is None


def test_gpu_hours_per_connection_from_attempts():
    day = datetime(2026, 11, 30, tzinfo=timezone.utc)
    t = day.timestamp()
    new = {"gpu_hours": 3.0, "cost": 10.0, "connection": "s", "attempts": [
        {"connection": "k", "started_at": t, "ended_at": t + 1800, "gpus": 2,
         "price_per_hour": 0},
        {"connection": "s", "started_at": t + 1800, "ended_at": t + 5400, "gpus": 2,
         "price_per_hour": 0}]}
    old = {"gpu_hours": 4.0, "cost": 8.0, "attempts": [  # before attempts had gpus: by hours
        {"connection": "a", "started_at": t, "ended_at": t + 3600},
        {"connection": "s", "started_at": t + 3600, "ended_at": t + 10800}]}
    data = usage.summarize([("d1", new, day), ("d2", old, day)], day, day)
    per = {r["name"]: r for r in data["per_connection"]}
    assert (per["k"]["gpu_hours"], per["s"]["gpu_hours"], per["a"]["gpu_hours"]) == \
        pytest.approx((1.0, 2.0 + 4.0 * 2 / 3, 4.0 / 3), abs=1e-6)
    assert per["a"]["cost"] == pytest.approx(8.0 / 3, abs=1e-6)
    assert [r["name"] for r in data["per_dag"]] == ["d2", "d1"] and data["jobs"] == 2
    assert data["series"]["s"] == {"2026-11-30": round(2.0 + 8 / 3, 6)}
    assert "usage-bars" in str(charts.usage(data["days"], data["series"]))


def test_short_run_ids_and_relative_times():
    assert formatting.short_run("manual__2026-12-01T03:52:17.978300+00:00") == \
        "manual 12-01 03:52:17"
    assert formatting.short_run("my_run") == "my_run"
    assert formatting.fmt_relative(1000, 400) == "in 10m00s"
    assert formatting.fmt_relative(400, 1000) == "10m00s ago"
    assert formatting.fmt_relative(1002, 1000) == "now"
