"""The jobs page groups a sweep (several mapped instances of one task in one DAG run); a mapped
instance's job page links its siblings. Real task instances of a real sweep: test_taskflow_e2e."""

from __future__ import annotations

import re

from airflow_skypilot.plugins.formatting import TEMPLATES
from airflow_skypilot.plugins.sweep_views import group_sweeps, sweep_summary


def _job(task_id="train", map_index=-1, run_id="r1", state="success", connection="slurm_alpha",
         start="2026-01-01T00:00:0{}+00:00", gpu_hours=0.5, cost=1.0, attempts=1):
    return {"dag_id": "sweep", "run_id": run_id, "task_id": task_id, "map_index": map_index,
            "try_number": 1, "state": state, "start_date": start.format(max(map_index, 0)),
            "end_date": None, "connection": connection, "location": "batch",
            "backend": "slurm", "accelerator": "A100", "job_id": f"{task_id}{map_index}",
            "job_name": f"sky-{task_id}-{map_index}", "attempts": attempts,
            "attempts_source": "result", "gpu_hours": gpu_hours, "cost": cost,
            "placement_summary": "placed", "policy": "fastest",
            "job_url": f"/skypilot/jobs/sweep/{run_id}/{task_id}/{map_index}", "ui_url": "/x"}


def test_a_sweep_is_one_entry_with_its_instances_in_map_index_order():
    jobs = [_job("train", 2), _job("other"), _job("train", 0, connection="k8s"),
            _job("train", 1, state="running", gpu_hours=None, cost=None, attempts=2),
            _job("train", 0, run_id="r2"), _job("eval", 0)]
    entries = group_sweeps(jobs)
    assert [(e["jobs"][0]["task_id"], len(e["jobs"]), bool(e["sweep"])) for e in entries] == [
        ("train", 3, True), ("other", 1, False), ("train", 1, False), ("eval", 1, False)]
    sweep = entries[0]["sweep"]
    assert [j["map_index"] for j in entries[0]["jobs"]] == [0, 1, 2]
    assert sweep == {"dag_id": "sweep", "run_id": "r1", "task_id": "train", "size": 3,
                     "map_indexes": [0, 1, 2], "states": [("running", 1), ("success", 2)],
                     "places": [("slurm_alpha", 2), ("k8s", 1)], "attempts": 4,
                     "gpu_hours": 1.0, "cost": 2.0,
                     "start_date": "2026-01-01T00:00:00+00:00"}


def test_a_sweep_with_no_result_yet_has_no_totals():
    summary = sweep_summary([_job(map_index=0, gpu_hours=None, cost=None),
                             _job(map_index=1, gpu_hours=None, cost=None)])
    assert summary["gpu_hours"] is None and summary["cost"] is None


def _render(template, **context):
    return TEMPLATES.get_template(f"skypilot/{template}").render(
        prefix="/skypilot", ui_base="", nonce="n", user_name="", **context)


def test_the_jobs_page_shows_a_sweep_as_a_group():
    jobs = [_job("train", i) for i in range(4)] + [_job("single")]
    html = _render("jobs.html", title="t", page="jobs", jobs=jobs, entries=group_sweeps(jobs),
                   counts=[("success", 5)], limit=100, dag_id=None)
    head = re.search(r'<tr class="sweep-head group-start">(.*?)</tr>', html, re.S).group(1)
    assert "<b>train</b>" in head and "sweep of 4" in head and "4 success" in head
    assert "<b>slurm_alpha</b>" in head and "×4" in head and "$4.00" in head
    members = re.findall(r'<tr class="member">.*?</tr>', html, re.S)
    assert len(members) == 4
    for index, row in enumerate(members):
        assert f'<span class="idx">[{index}]</span>' in row
        assert f"/skypilot/jobs/sweep/r1/train/{index}" in row
    assert html.count('<tbody class="sweep">') == 1 and ">single</a>" in html


def test_a_mapped_instances_job_page_links_its_sweep():
    ti = {**_job("train", 1), "ui_url": "/x"}
    job = {"task_instance": ti, "handle": None, "handle_extra": {}, "placement": None,
           "result": None, "attempts": [], "attempts_source": "none",
           "sweep": [{"map_index": i, "state": "success", "url": f"/j/{i}"} for i in range(3)]}
    html = _render("job.html", title="t", page="job", job=job, ti=ti, json_url="/api")
    assert "sweep of 3:" in html
    assert '<b class="idx">[1]</b>' in html  # this one
    assert 'href="/j/0"' in html and 'href="/j/2"' in html and 'href="/j/1"' not in html


def test_a_job_page_shows_looks_recorded_before_they_had_a_best_price():
    """Run states written before looks recorded ``best_price_per_hour``."""
    ti = _job("train")
    old_look = {"first_at": 1000.0, "last_at": 1000.0, "count": 1, "place": "slurm_alpha/batch",
                "est_start": 1600.0, "best": "k8s/default", "best_start": 1060.0,
                "outcome": "stayed", "why": "no clear margin"}
    handle = {"backend": "slurm", "connection": "slurm_alpha", "location": "batch",
              "job_id": "7"}
    job = {"task_instance": ti, "handle": handle, "handle_extra": {}, "placement": None,
           "result": None, "attempts": [], "attempts_source": "none", "sweep": [],
           "looks": [old_look], "looks_total": 1, "waiting": None}
    html = _render("job.html", title="t", page="job", job=job, ti=ti, json_url="/api")
    row = re.search(r'<table class="looks">.*?</table>', html, re.S).group(0)
    assert "k8s/default" in row and "in 1m00s" in row and "no clear margin" in row
    assert "$" not in row  # no price to show, and none made up
