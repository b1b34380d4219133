"""The backend contract: every backend, on its sandbox, behaves the same through the protocol.

Each test is written once against :class:`~airflow_skypilot.backends.base.Backend` and runs for
every target in :data:`tests.integration.contract_targets.TARGETS` (``-k slurm``, ``-k aws``...).
A target supplies the connection, the resources that land on its sandbox and the few
observations the protocol cannot give (request counts, stored texts, what still runs). A new
backend adds a target and must pass these tests unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from airflow_skypilot import placement
from airflow_skypilot.backends.base import Backend, JobHandle, JobState, JobStatus, Offer
from airflow_skypilot.exceptions import BackendUnreachable
from airflow_skypilot.spec import load_task
from tests.conftest import wait_for_job
from tests.e2e.conftest import shared_dir
from tests.integration.contract_targets import TARGETS, Target

pytestmark = pytest.mark.sandbox

T = TypeVar("T")
ACTIVE = {JobState.PENDING, JobState.RUNNING}
TERMINAL = {s for s in JobState if s.terminal}


@pytest.fixture(params=TARGETS, ids=[t.id for t in TARGETS])
def target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    """A clean sandbox of one backend; after the test, every job it submitted is cancelled."""
    yield from _target(request, monkeypatch)


KEEPING = [t for t in TARGETS if t.keeps_nodes]


@pytest.fixture(params=KEEPING, ids=[t.id for t in KEEPING])
def keeping_target(request: pytest.FixtureRequest,
                   monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    """:func:`target`, of the backends whose nodes stay until every rank's run has ended."""
    yield from _target(request, monkeypatch)


QUEUED = [t for t in TARGETS if t.has_queue]


@pytest.fixture(params=QUEUED, ids=[t.id for t in QUEUED])
def queued_target(request: pytest.FixtureRequest,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    """:func:`target`, of the backends that queue work that cannot start yet."""
    yield from _target(request, monkeypatch)


def _target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Target]:
    box = request.getfixturevalue(request.param.fixture)
    tgt = request.param(box, monkeypatch)
    tgt.connect()
    yield tgt
    backend = tgt.backend()
    for handle, _ in tgt.submitted:
        try:
            backend.cancel(handle)
            backend.cleanup(handle)
        except Exception as exc:  # the next test's sandbox reset stops it anyway
            logging.getLogger(__name__).warning("could not stop %s: %s", handle.job_id, exc)


# --- helpers ------------------------------------------------------------------------------------


def _name(word: str) -> str:
    return f"ct-{word}-{uuid.uuid4().hex[:6]}"


def _task(target: Target, run: str, gpus: int = 0, **fields: Any):
    resources = {"accelerators": f"{target.accelerator}:{gpus}"} if gpus \
        else dict(target.cpu_resources)
    return load_task({"run": run, "resources": resources, **fields})


def _offer(backend: Backend, task) -> Offer:
    offers = backend.probe(task)
    fitting = [o for o in offers if o.fits]
    assert fitting, [o.reason for o in offers]
    return placement.rank(fitting).chosen


def _submit(target: Target, backend: Backend, task, name: str | None = None,
            offer: Offer | None = None) -> tuple[JobHandle, str]:
    """Submit ``task`` at the best offer; returns the handle and the job's SKYPILOT_TASK_ID."""
    task_id = f"ct-task-{uuid.uuid4().hex[:10]}"
    handle = backend.submit(task, offer or _offer(backend, task), name or _name("job"),
                            {"SKYPILOT_TASK_ID": task_id})
    target.submitted.append((handle, task_id))
    return handle, task_id


def _wait(target: Target, backend: Backend, handle: JobHandle, states=TERMINAL) -> JobStatus:
    return wait_for_job(backend, handle, set(states), target.job_timeout)


def _until(check: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            assert result, f"{what}: not within {timeout}s (last: {result!r})"
            return result
        time.sleep(0.3)


def _until_none(left: Callable[[], list[str]], timeout: float, what: str) -> None:
    """Wait until ``left()`` is empty; else fail showing what is still there."""
    deadline = time.monotonic() + timeout
    while remaining := left():
        assert time.monotonic() < deadline, f"{what}: still there after {timeout}s: {remaining}"
        time.sleep(0.3)


def _async(backend: Backend, call: Callable[[], Awaitable[T]]) -> T:
    """Run ``call`` as the triggerer does: aprepare first, aclose (when there is one) after."""
    async def main() -> T:
        await backend.aprepare()
        try:
            return await call()
        finally:
            close = getattr(backend, "aclose", None)
            if close is not None:
                await close()
    return asyncio.run(main())


def _same_end(backend: Backend, handle: JobHandle, status: JobStatus) -> None:
    """A terminal status says when the job ended, the same on every later poll (sync and
    async): the backend's record of the end, not the time it was asked."""
    assert status.ended_at is not None and status.ended_at >= handle.submitted_at - 5, status
    if status.started_at is not None:
        assert status.ended_at >= status.started_at - 1, status
    time.sleep(1.1)
    later = backend.status([handle])[handle.job_id]
    again = _async(backend, lambda: backend.astatus([handle]))[handle.job_id]
    assert (later.state, later.ended_at) == (status.state, status.ended_at), (status, later)
    assert (again.state, again.ended_at) == (status.state, status.ended_at), (status, again)


def _roundtrip(handle: JobHandle) -> JobHandle:
    return JobHandle.from_dict(json.loads(json.dumps(handle.to_dict())))


# --- placement ----------------------------------------------------------------------------------


def test_probe_gives_offers_of_the_contract_shape(target):
    backend = target.backend()
    task = load_task({"run": "true", "resources": {"accelerators": f"{target.accelerator}:1"}})
    offers = backend.probe(task)
    assert offers and all(isinstance(o, Offer) for o in offers)
    for o in offers:
        assert (o.connection, o.backend) == (target.conn_id, backend.name)
        assert o.location and o.infra.split("/")[0] == backend.name, o.infra
        assert o.request.accelerator == target.accelerator and o.request.accelerator_count == 1
        assert o.num_nodes == 1 and o.gpus_per_node == 1
        assert o.accelerator == target.accelerator  # the canonical name, not a backend label
        assert o.fits or o.reason, o  # an offer that cannot fit says why
        assert Offer.from_dict(json.loads(json.dumps(o.to_dict()))).to_dict() == o.to_dict()
    free = [o for o in offers if o.free_now]
    assert free, "a clean sandbox has a free place"
    assert all(o.fits and o.wait_seconds == 0 for o in free)

    two = load_task({"run": "true", "num_nodes": 2, "resources": dict(target.cpu_resources)})
    offers = backend.probe(two)
    assert any(o.free_now for o in offers) and all(o.num_nodes == 2 for o in offers)

    never = load_task({"run": "true", "resources": {"accelerators": f"{target.accelerator}:64"}})
    offers = backend.probe(never)
    assert offers, "an impossible shape still gets an answer per location"
    for o in offers:
        assert not o.fits and not o.free_now
        assert "64" in o.reason, o.reason


def test_capacity_rows_have_the_show_gpus_shape(target):
    rows = target.backend().capacity()
    assert rows and all(r.connection == target.conn_id and r.location for r in rows)
    mine = [r for r in rows if r.accelerator == target.accelerator]
    assert mine, [r.accelerator for r in rows]
    assert all(r.free is None or r.free >= 1 for r in mine)  # a clean sandbox
    for r in rows:
        keys = set(json.loads(json.dumps(r.to_json())))
        assert keys >= {"connection", "location", "accelerator", "total", "free", "pending",
                        "price_per_hour"}
        # a clean sandbox's queue is empty; a backend without one says so with None, not 0
        assert r.pending == (0 if target.has_queue else None), r


def test_capacity_counts_a_job_that_must_wait(queued_target):
    """Fill every node of the accelerator at one location, then one more job of a whole node
    must wait: the location's capacity row counts it in ``pending`` (show-gpus' queue depth)."""
    target = queued_target
    backend = target.backend()
    task = _task(target, "sleep 120", gpus=target.gpus_per_node)
    offer = _offer(backend, task)
    row = {(r.location, r.accelerator): r for r in backend.capacity()}[
        (offer.location, target.accelerator)]
    assert row.total and row.total % target.gpus_per_node == 0, row
    assert row.pending == 0, row
    fillers = [_submit(target, backend, task, _name(f"fill{i}"), offer)[0]
               for i in range(row.total // target.gpus_per_node)]
    for handle in fillers:
        assert _wait(target, backend, handle, {JobState.RUNNING, *TERMINAL}).state \
            == JobState.RUNNING
    full = {(r.location, r.accelerator): r for r in backend.capacity()}[
        (offer.location, target.accelerator)]
    assert (full.free, full.pending) == (0, 0), full  # running jobs are not the queue
    waiting, _ = _submit(target, backend, task, _name("waits"), offer)
    time.sleep(3)  # a scheduling pass or two: it still waits, as it must
    assert backend.status([waiting])[waiting.job_id].state == JobState.PENDING

    def counted():
        rows = [r for r in target.backend().capacity()
                if (r.location, r.accelerator) == (offer.location, target.accelerator)]
        return rows if rows and rows[0].pending else None

    rows = _until(counted, 15, "the capacity row counts the waiting job")
    assert len(rows) == 1 and rows[0].pending >= 1 and rows[0].free == 0, rows


# --- jobs ---------------------------------------------------------------------------------------


def test_submit_gives_a_handle_that_survives_json_and_runs_to_success(target):
    backend = target.backend()
    task = _task(target, "echo started-ok; sleep 4; echo finished-ok")
    offer = _offer(backend, task)
    name = _name("ok")
    handle, _ = _submit(target, backend, task, name, offer)
    assert isinstance(handle, JobHandle) and not handle.adopted
    assert (handle.backend, handle.connection, handle.job_name) == (backend.name,
                                                                    target.conn_id, name)
    assert handle.location == offer.location and handle.num_nodes == 1
    assert handle.infra.split("/")[0] == backend.name and handle.key.startswith(target.conn_id)
    same = _roundtrip(handle)  # it travels through XCom and the triggerer
    assert same == handle
    watcher = target.backend()  # another process: only the handle in hand
    running = _wait(target, watcher, same, {JobState.RUNNING, *TERMINAL})
    assert running.state == JobState.RUNNING, running
    done = _wait(target, watcher, same)
    text, _ = watcher.read_log(same)
    assert done.state == JobState.SUCCEEDED, (done, text)
    assert done.exit_code == 0 and not done.state.infra_failure
    _same_end(watcher, same, done)
    assert "started-ok" in text and "finished-ok" in text
    again = _async(watcher, lambda: watcher.astatus([same]))  # the triggerer's path agrees
    assert set(again) == {same.job_id}
    assert (again[same.job_id].state, again[same.job_id].exit_code) == (done.state,
                                                                        done.exit_code)
    assert JobStatus.from_dict(json.loads(json.dumps(done.to_dict()))) == done


def test_find_and_a_second_submit_adopt_the_same_job(target):
    backend = target.backend()
    task = _task(target, "sleep 30")
    offer = _offer(backend, task)
    name = _name("twice")
    first, _ = _submit(target, backend, task, name, offer)
    found = target.backend().find(name)
    assert found is not None and found.adopted
    assert (found.job_id, found.job_name, found.connection) == (first.job_id, name,
                                                                target.conn_id)
    assert found.submitted_at == first.submitted_at  # the original, not when it was found
    second, _ = _submit(target, target.backend(), task, name, offer)  # a restarted worker
    assert second.adopted and not first.adopted
    assert (second.job_id, second.key) == (first.job_id, first.key)
    assert target.submissions(name) == 1
    assert target.backend().find(_name("never")) is None
    status = backend.status([second])[second.job_id]
    assert status.state in ACTIVE, status


def test_a_probe_names_the_live_jobs_it_counts(target):
    # the placement ledger's check (ledger.hold): a job the probe counts is not held twice
    backend = target.backend()
    task = _task(target, "sleep 30")
    handle, _ = _submit(target, backend, task, _name("seen"))
    _wait(target, backend, handle, {JobState.RUNNING, *TERMINAL})
    offers = [o for o in target.backend().probe(task) if o.fits]
    assert offers
    for offer in offers:
        if target.probe_lists_jobs:
            assert offer.jobs_seen is not None and handle.job_name in offer.jobs_seen, offer
        else:
            assert offer.jobs_seen is None
    backend.cancel(handle)
    _wait(target, backend, handle)
    if target.probe_lists_jobs:  # a job that ended takes no room and is not named (once
        # its pods have ended: a cancelled pod holds its room while its program stops)
        deadline = time.monotonic() + 30
        while backend.status([handle])[handle.job_id].still_up and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(handle.job_name not in (o.jobs_seen or ())
                   for o in target.backend().probe(task))


def test_exit_code_3_is_a_user_failure_with_its_code(target):
    backend = target.backend()
    handle, _ = _submit(target, backend, _task(target, "echo about-to-fail; exit 3"))
    status = _wait(target, backend, handle)
    assert status.state == JobState.FAILED, status
    assert status.exit_code == 3 and "3" in status.reason
    assert not status.state.infra_failure
    assert "about-to-fail" in backend.read_log(handle)[0]
    again = _async(backend, lambda: backend.astatus([handle]))[handle.job_id]
    assert (again.state, again.exit_code) == (JobState.FAILED, 3)
    _same_end(backend, handle, status)
    backend.cancel(handle)  # a job that had ended keeps what happened to it
    after = backend.status([handle])[handle.job_id]
    assert (after.state, after.exit_code, after.ended_at) == (JobState.FAILED, 3,
                                                              status.ended_at), after


def test_cancel_stops_everything_and_is_safe_twice(target):
    backend = target.backend()
    task = _task(target, "echo cancel-me; sleep 120",
                 secrets={"CT_TOKEN": f"tok-{uuid.uuid4().hex}"})
    handle, task_id = _submit(target, backend, task)
    _wait(target, backend, handle, {JobState.RUNNING})
    _until(lambda: target.running(handle, task_id), 30, "the job's processes start")
    assert target.secret_store(handle)
    backend.cancel(handle)
    # cancel releases everything the job holds, its secrets too (no cleanup call needed)
    _until_none(lambda: target.leftovers(handle, task_id), 30, "what the job held")
    status = _wait(target, backend, handle)
    backend.cancel(handle)  # twice, and from another process: no error
    target.backend().cancel(handle)
    later = _async(backend, lambda: backend.astatus([handle]))[handle.job_id]
    assert target.leftovers(handle, task_id) == []
    # our own cancel reads CANCELLED (not LOST: that is an infrastructure failure, which the
    # operator would place again), before and after the second cancel
    assert status.state == JobState.CANCELLED, status
    assert later.state == JobState.CANCELLED, later
    assert not status.state.infra_failure
    _same_end(backend, handle, status)


def test_status_of_many_jobs_is_one_batched_request(target):
    backend = target.backend()
    task = _task(target, "sleep 60")
    offer = _offer(backend, task)
    handles = [_submit(target, backend, task, _name(f"many{i}"), offer)[0] for i in range(5)]
    for h in handles:
        _wait(target, backend, h, {JobState.RUNNING})
    poller = target.backend()
    _async(poller, lambda: poller.astatus(handles[:1]))  # connection set-up is not counted

    def counted(call: Callable[[], dict[str, JobStatus]]) -> tuple[dict, int, int]:
        target.reset_requests()
        result = call()
        return result, target.status_queries(), target.all_requests()

    _, q1, all1 = counted(lambda: _async(poller, lambda: poller.astatus(handles[:1])))
    many, q5, all5 = counted(lambda: _async(poller, lambda: poller.astatus(handles)))
    assert set(many) == {h.job_id for h in handles}
    assert {s.state for s in many.values()} == {JobState.RUNNING}
    assert 1 <= q5 == q1 <= target.max_status_queries, (q1, q5)
    synced, q5s, _ = counted(lambda: poller.status(handles))  # the worker's path
    assert {s.state for s in synced.values()} == {JobState.RUNNING}
    assert 1 <= q5s <= target.max_status_queries, q5s
    # nothing else per job either (markers, logs...): the count does not grow with the jobs
    assert all5 == all1, f"a poll of 5 jobs made {all5} requests, of 1 job {all1}"


# --- logs ---------------------------------------------------------------------------------------


def test_log_offsets_give_only_new_text(target):
    backend = target.backend()
    handle, _ = _submit(target, backend,
                        _task(target, "echo first-line; sleep 6; echo second-line"))

    def first() -> tuple[str, int] | None:
        text, offset = backend.read_log(handle, 0)
        return (text, offset) if "first-line" in text else None

    text1, off1 = _until(first, target.job_timeout, "the first line is readable")
    assert "second-line" not in text1, "the job should still be sleeping"
    assert off1 == len(text1.encode())
    status = _wait(target, backend, handle)
    assert status.state == JobState.SUCCEEDED, status
    text2, off2 = backend.read_log(handle, off1)
    assert "second-line" in text2 and "first-line" not in text2
    assert off2 == off1 + len(text2.encode())
    assert _async(backend, lambda: backend.aread_log(handle, off1)) == (text2, off2)
    whole, end = backend.read_log(handle, 0)
    assert (whole, end) == (text1 + text2, off2)
    assert backend.read_log(handle, end) == ("", end)
    middle = whole.encode().index(b"second-line")
    rest, end2 = backend.read_log(handle, middle)
    assert rest.startswith("second-line") and end2 == end


def test_output_reaches_the_log_as_written_progress_bars_and_stderr_in_order(target):
    """SkyPilot's own tests/test_yamls/cr_progress_bar.yaml: frames drawn with a carriage
    return stay one line (tqdm's), and stderr comes in its place among the stdout lines
    (SkyPilot's stderr=STDOUT: a ``set -x`` trace before what it traces)."""
    backend = target.backend()
    handle, _ = _submit(target, backend, _task(
        target, "printf 'frame-1\\rframe-2\\rframe-3\\n'; echo to-stderr >&2; echo to-stdout"))
    status = _wait(target, backend, handle)
    assert status.state == JobState.SUCCEEDED, status
    text, _ = backend.read_log(handle, 0)
    assert "frame-1\rframe-2\rframe-3\nto-stderr\nto-stdout\n" in text, repr(text)


def test_logs_of_several_jobs_in_one_call(target):
    backend = target.backend()
    handles = [_submit(target, backend, _task(target, f"echo log-of-job-{i}-end"))[0]
               for i in range(3)]
    for h in handles:
        assert _wait(target, backend, h).state == JobState.SUCCEEDED
    reader = target.backend()
    got = _async(reader, lambda: reader.aread_logs([(h, 0) for h in handles]))
    assert set(got) == {h.job_id for h in handles}
    for i, h in enumerate(handles):
        text, offset = got[h.job_id]
        assert f"log-of-job-{i}-end" in text
        assert not any(f"log-of-job-{j}-" in text for j in range(3) if j != i)
        assert offset == len(text.encode()) and (text, offset) == backend.read_log(h, 0)
    later = _async(reader, lambda: reader.aread_logs(
        [(h, got[h.job_id][1]) for h in handles]))
    assert later == {h.job_id: ("", got[h.job_id][1]) for h in handles}
    mixed = _async(reader, lambda: reader.aread_logs(
        [(handles[0], 0), (handles[1], got[handles[1].job_id][1])]))
    assert mixed == {handles[0].job_id: got[handles[0].job_id],
                     handles[1].job_id: ("", got[handles[1].job_id][1])}


def test_read_tail_gives_the_end_of_a_log_longer_than_a_read(target):
    """A failure quotes the end of the output: with streaming off there is no offset near
    it, and a read from 0 gives only the first MiB (about 2.6 MB here)."""
    backend = target.backend()
    handle, _ = _submit(target, backend, _task(
        target, "seq 1 400000; echo ct-tail-marker; exit 1"))
    status = _wait(target, backend, handle)
    assert status.state == JobState.FAILED, status
    head, _ = backend.read_log(handle, 0)
    assert "\n1000\n" in head and "ct-tail-marker" not in head  # a read is not the whole log

    def is_the_end(tail: str, max_bytes: int) -> None:
        lines = tail.splitlines()
        assert "ct-tail-marker" in lines, tail[-300:]
        end = lines.index("ct-tail-marker")
        assert lines[end - 1] == "400000", tail[-300:]
        # after the job's last line, only what the job's wrapper says of its end
        assert all(line.startswith("airflow-skypilot:") for line in lines[end + 1:]), lines
        assert len(tail.encode()) <= max_bytes and "\n1000\n" not in tail, tail[:200]
        first = tail.splitlines()[0]  # whole lines: its first is a number after a cut
        assert first.isdigit() and int(first) > 390000, tail[:200]

    is_the_end(backend.read_tail(handle), 32768)
    is_the_end(backend.read_tail(handle, 200), 200)
    reader = target.backend()  # the triggerer's: a fresh backend, on its event loop
    is_the_end(_async(reader, lambda: reader.aread_tail(handle)), 32768)


# --- cleanup, nodes, secrets --------------------------------------------------------------------


def test_cleanup_removes_what_the_job_left_and_is_safe_twice(target):
    backend = target.backend()
    task = _task(target, "echo cleanup-me; sleep 2",
                 secrets={"CT_TOKEN": f"tok-{uuid.uuid4().hex}"})
    handle, task_id = _submit(target, backend, task)
    assert target.secret_store(handle), "the secret is stored while the job may run"
    assert _wait(target, backend, handle).state == JobState.SUCCEEDED
    backend.cleanup(handle)
    _until_none(lambda: target.leftovers(handle, task_id), 30, "what the job held")
    backend.cleanup(handle)  # twice, and from another process
    target.backend().cleanup(handle)
    assert target.leftovers(handle, task_id) == []


LINE = re.compile(r"rank=(\d) nodes=(\S*) gpus=(\S*) task=(\S*) my=<(.*)> ipcount=(\d+) "
                  r"ips=(\S*) sha=(\w*) me=(\S*)")


def test_setup_and_run_run_as_skypilot_runs_them(target):
    """SkyPilot's prologue on every backend: ``bash -i`` after ``source ~/.bashrc`` (a setup
    hands run a value by appending an export to it, SkyPilot's ``env_check.yaml``; a guarded
    Debian .bashrc reads it only in an interactive shell), ``PYTHONUNBUFFERED=1``, the task's
    envs over the .bashrc's."""
    backend = target.backend()
    var = f"CT_BASHRC_{uuid.uuid4().hex[:10]}"
    task = _task(
        target, envs={"CT_ENV": "from-envs"},
        setup=f'echo "export {var}=from-setup CT_ENV=from-bashrc" >> ~/.bashrc',
        # the job user's home may be shared by other jobs (Slurm): the line goes again
        run=f'echo "got=${var} env=$CT_ENV interactive=${{-//[^i]/}} '
            f'unbuffered=$PYTHONUNBUFFERED"; sed -i "/{var}/d" ~/.bashrc')
    handle, _ = _submit(target, backend, task)
    status = _wait(target, backend, handle)
    log, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, (status, log)
    assert "got=from-setup env=from-envs interactive=i unbuffered=1" in log, log
    assert "no job control" not in log and "terminal process group" not in log, log


def test_a_git_workdir_travels_as_skypilots_rsync_sends_it(target, tmp_path):
    """Without a .skyignore, SkyPilot leaves out what the .gitignore files (each from its own
    folder, rsync's patterns) and .git/info/exclude list, and sends .git: a workdir's .venv
    and data travelled here, and git did not work in the job."""
    files = {".gitignore": ".venv/\n/data\n*.log\n", ".git/HEAD": "ref: refs/heads/main\n",
             ".git/info/exclude": "secret.txt\n", "secret.txt": "s", ".venv/bin/py": "",
             "data/big.bin": "", "src/data/keep.py": "", "run.log": "", "src/a.py": "",
             "src/.gitignore": "/gen\n", "src/gen/out.py": "", "gen/top.py": ""}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    sent = ["src/data/keep.py", "src/a.py", "gen/top.py"]
    left = ["secret.txt", ".venv", "data", "run.log", "src/gen"]
    (sent if target.ships_git else left).append(".git/HEAD")
    check = " && ".join([*(f"test -e {p}" for p in sent), *(f"test ! -e {p}" for p in left)])
    backend = target.backend()
    handle, _ = _submit(target, backend, _task(target, f"{check} && echo tree-as-sent",
                                               workdir=str(tmp_path)))
    status = _wait(target, backend, handle)
    log, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED and "tree-as-sent" in log, (status, log)


def test_symbolic_links_travel_as_links_as_skypilots_rsync_sends_them(target, tmp_path):
    """SkyPilot's ``rsync -a`` sends a link as a link, its target text unchanged (SkyPilot's
    symlink_playground.yaml): Slurm made a link to a folder an empty folder, copied a link to
    a file, and refused the whole job on a dangling link ("[Errno 2]"; under the operator every
    partition then refused it, and the task waited for ever). Every rank (each works in its
    own copy of the workdir on Slurm) sees the links of the workdir and of a file-mount folder,
    and the user's code runs once per rank."""
    marks = Path(shared_dir())
    src = tmp_path / "src"
    (src / "v3").mkdir(parents=True)
    (src / "v3" / "model.bin").write_text("weights-v3\n")
    (src / "configs").mkdir()
    (src / "configs" / "base.yaml").write_text("lr: 1\n")
    outside = f"/opt/ct-outside-{uuid.uuid4().hex[:8]}/data"  # out of the tree, absent
    links = {"latest": "v3", "cfg.yaml": "configs/base.yaml", "outside": outside,
             "gone": "missing/nothing-here"}
    for name, to in links.items():
        (src / name).symlink_to(to)
    checks = [f'test -L {d}{name} && [ "$(readlink {d}{name})" = "{to}" ]'
              for d in ("", "mnt/") for name, to in links.items()]
    run = "\n".join([
        'for l in latest cfg.yaml outside gone mnt/latest; do echo "link $l -> $(readlink $l)";'
        " done",
        f"echo ran >> {marks}/runs-$SKYPILOT_NODE_RANK",
        " && ".join([*checks, '[ "$(cat latest/model.bin)" = weights-v3 ]',
                     '[ "$(cat cfg.yaml)" = "lr: 1" ]', "test -d latest/ && test ! -e gone",
                     'echo "rank $SKYPILOT_NODE_RANK links-as-sent"'])])
    backend = target.backend()
    task = _task(target, run, num_nodes=2, workdir=str(src), file_mounts={"mnt": str(src)})
    handle, _ = _submit(target, backend, task)
    status = _wait(target, backend, handle)
    log, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, (status, log)
    for rank in (0, 1):
        assert f"rank {rank} links-as-sent" in log, log
        assert (marks / f"runs-{rank}").read_text() == "ran\n", "the user's code ran once"


def test_a_workdir_or_mount_source_that_is_a_link_sends_what_it_points_to(target, tmp_path):
    """SkyPilot resolves a local source before its rsync (``Path.resolve()``, then ``src/``
    for a folder): a workdir or file mount given as a link (SkyPilot's symlink_playground.yaml,
    ``workdir: ~/Downloads/temp1``, a link to the data) sends the folder or file it points
    to, and the links inside it as links."""
    real = tmp_path / "real"
    (real / "v3").mkdir(parents=True)
    (real / "v3" / "model.bin").write_text("weights-v3\n")
    (real / "latest").symlink_to("v3")
    (tmp_path / "base.yaml").write_text("lr: 1\n")
    (tmp_path / "wd").symlink_to(real)  # absolute
    (tmp_path / "cfg.yaml").symlink_to("base.yaml")  # relative: dangles anywhere else
    run = " && ".join([
        '[ "$(cat v3/model.bin)" = weights-v3 ] && [ "$(readlink latest)" = v3 ]',
        '[ "$(cat mnt/latest/model.bin)" = weights-v3 ] && [ "$(readlink mnt/latest)" = v3 ]',
        'test ! -L cfg.yaml && [ "$(cat cfg.yaml)" = "lr: 1" ]', "echo sources-resolved"])
    backend = target.backend()
    task = _task(target, run, workdir=str(tmp_path / "wd"),
                 file_mounts={"mnt": str(tmp_path / "wd"), "cfg.yaml": str(tmp_path / "cfg.yaml")})
    handle, _ = _submit(target, backend, task)
    status = _wait(target, backend, handle)
    log, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED and "sources-resolved" in log, (status, log)


def test_a_rank_whose_run_ends_first_keeps_its_node_until_the_job_ends(keeping_target):
    """SkyPilot keeps every node of a job until the job ends: a worker rank that starts a
    daemon (``ray start``, an MPI target) and exits leaves it to the ranks still running.
    AWS powered the node off at once; Slurm's proctrack/cgroup kills a task's leftovers when
    it ends (the sandbox's proctrack/linuxproc does not, so only AWS fails without it here)."""
    target = keeping_target
    backend = target.backend()
    beat = Path(shared_dir()) / f"beat-{uuid.uuid4().hex[:10]}"
    task = _task(target, gpus=1, num_nodes=2, run=(
        'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then\n'
        # a daemon as `ray start` leaves one: its output elsewhere (a pipe to srun it held
        # would keep Slurm's step up regardless), and here a life of its own of a minute
        f'  (for i in $(seq 60); do date +%s > {beat}; sleep 1; done) >/dev/null 2>&1 '
        '</dev/null &\n'
        '  exit 0\n'
        'fi\n'
        f'sleep 15; age=$(( $(date +%s) - $(cat {beat} 2>/dev/null || echo 0) ))\n'
        'echo "rank 1 daemon last beat ${age}s ago"; [ "$age" -le 5 ]'))
    handle, _ = _submit(target, backend, task)
    status = _wait(target, backend, handle)
    log, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, (status, log)
    assert "daemon last beat" in log, log


def test_two_node_job_sees_the_skypilot_env_on_every_rank(target):
    backend = target.backend()
    secret = f"two-{uuid.uuid4().hex}"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    task = _task(
        target, gpus=1, num_nodes=2, envs={"MY_ENV": "x y"}, secrets={"CT_TOKEN": secret},
        setup='echo "setup-rank=$SKYPILOT_SETUP_NODE_RANK '
              'setup-gpus=$SKYPILOT_SETUP_NUM_GPUS_PER_NODE"',
        run=f'me=$({target.own_address})\n'
            'echo "rank=$SKYPILOT_NODE_RANK nodes=$SKYPILOT_NUM_NODES '
            'gpus=$SKYPILOT_NUM_GPUS_PER_NODE task=$SKYPILOT_TASK_ID my=<$MY_ENV> '
            'ipcount=$(printf "%s\\n" "$SKYPILOT_NODE_IPS" | grep -c .) '
            'ips=$(printf "%s" "$SKYPILOT_NODE_IPS" | tr "\\n" ,) '
            'sha=$(printf %s "$CT_TOKEN" | sha256sum | cut -d" " -f1) me=$me"')
    handle, task_id = _submit(target, backend, task)
    assert handle.num_nodes == 2
    status = _wait(target, backend, handle)
    log, end = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, (status, log)
    ranks = {int(m.group(1)): m.groups()[1:] for m in LINE.finditer(log)}
    assert sorted(ranks) == [0, 1], f"the job's log has every rank's output:\n{log}"
    for rank, (nodes, gpus, tid, my, ipcount, ips, sha, me) in ranks.items():
        assert (nodes, gpus, tid, my, ipcount, sha) == ("2", "1", task_id, "x y", "2", digest)
        assert len(set(filter(None, ips.split(",")))) == 2, ips
        assert f"setup-rank={rank} setup-gpus=1" in log
        # rank order: line `rank` of SKYPILOT_NODE_IPS is the address of this rank's own node
        listed = ips.split(",")[rank]
        assert me and target.is_own_address(listed, me), (rank, listed, me, log)
    assert ranks[0][5] == ranks[1][5], "every rank sees the same SKYPILOT_NODE_IPS"
    assert secret not in log
    assert end == len(log.encode())
    reader = target.backend()  # the triggerer's path, in another process: the same text
    assert _async(reader, lambda: reader.aread_log(handle, 0)) == (log, end)


def test_every_node_of_a_job_has_a_workdir_of_its_own(target, tmp_path):
    """SkyPilot's nodes each have their ~/sky_workdir: a setup that makes a folder there
    (``[ -d repo ] || git clone``, ``uv venv``) runs once per node. On Slurm the ranks shared
    one folder on the shared file system: the second ``mkdir`` failed, and so did the job."""
    (tmp_path / "train.py").write_text("print('shipped')\n")
    backend = target.backend()
    task = _task(target, gpus=1, num_nodes=2, workdir=str(tmp_path),
                 setup="mkdir made-by-setup && touch made-by-setup/$SKYPILOT_NODE_RANK",
                 run='test -f train.py && [ "$(ls made-by-setup)" = "$SKYPILOT_NODE_RANK" ] '
                     '&& echo "own-workdir-$SKYPILOT_NODE_RANK"')
    handle, _ = _submit(target, backend, task)
    status = _wait(target, backend, handle)
    log, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, (status, log)
    assert "own-workdir-0" in log and "own-workdir-1" in log, log


def test_secret_reaches_the_job_but_is_never_in_clear(target, caplog, capfd):
    caplog.set_level(logging.INFO)  # what a task log shows (DEBUG adds this test's own calls)
    token = f"ct-secret-{uuid.uuid4().hex[:12]}"
    secret = f"{token} with 'quotes' \"dq\" $(echo subst) `tick`\nsecond line"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    backend = target.backend()
    task = _task(target, 'printf %s "$API_TOKEN" | sha256sum; echo "leak:$API_TOKEN:end"; sleep 3',
                 secrets={"API_TOKEN": secret})
    handle, _ = _submit(target, backend, task)
    assert target.secret_store(handle)
    while_running = target.stored_texts(handle)
    status = _wait(target, backend, handle)
    log, _ = backend.read_log(handle)
    assert status.state == JobState.SUCCEEDED, (status, log)
    assert digest in log, "the job saw the secret's exact bytes"
    assert "leak:***" in log, "a secret the job prints itself is masked in its log"
    after = target.stored_texts(handle)
    # an ended job's instance may already be gone (terminated, its user-data with it): the
    # texts read while it ran are the ones that must hold its script
    assert any("sha256sum" in text for text in [*while_running.values(), *after.values()]), \
        f"the stored texts include the job's own script (else this test sees nothing): " \
        f"{ {k: v[:200] for k, v in while_running.items()} } {sorted(after)}"
    # Airflow's structlog writes the backends' records (self.log) to stdout, not through the
    # stdlib handlers caplog sees: the task log is both
    airflow_log = caplog.text + "".join(capfd.readouterr())
    assert handle.job_name in airflow_log, "the backend's log records are captured"
    texts = {**{f"{k} (running)": v for k, v in while_running.items()}, **after,
             "job log": log, "airflow log": airflow_log,
             "handle": json.dumps(handle.to_dict()), "status": json.dumps(status.to_dict())}
    leaks = sorted(name for name, text in texts.items() if token in text)
    assert not leaks, f"the secret is in clear in: {leaks}"


# --- finding the jobs of earlier tries ----------------------------------------------------------


def test_find_all_lists_exactly_the_prefix_with_the_original_submit_times(target):
    """Every try of a task lists the jobs earlier tries left by prefix: all of them, finished
    ones too, nothing else, each with when it was submitted (a job submitted before the run
    started is never adopted: that rule needs the original time)."""
    backend = target.backend()
    stem = _name("fa")
    prefix = f"{stem}-a-"
    quick, slow = _task(target, "echo done"), _task(target, "sleep 60")
    done, _ = _submit(target, backend, quick, prefix + "0")
    offer = _offer(backend, slow)
    live, _ = _submit(target, backend, slow, prefix + "1", offer)
    other, _ = _submit(target, backend, slow, f"{stem}-b-0", offer)  # same stem, not ours
    assert _wait(target, backend, done).state == JobState.SUCCEEDED
    for lister in (backend, target.backend()):  # this process, and another one
        found = lister.find_all(prefix)
        assert [h.job_name for h in found] == [prefix + "0", prefix + "1"], found
        for got, submitted in zip(found, (done, live), strict=True):
            assert (got.job_id, got.connection, got.backend) == (
                submitted.job_id, target.conn_id, backend.name)
            assert got.submitted_at == submitted.submitted_at, (got, submitted)
            assert got.adopted
        assert lister.find(prefix + "1").submitted_at == live.submitted_at
    statuses = backend.status(found)
    assert statuses[done.job_id].state == JobState.SUCCEEDED
    assert statuses[live.job_id].state in ACTIVE
    assert [h.job_name for h in backend.find_all(f"{stem}-b-")] == [other.job_name]
    assert backend.find_all(f"{stem}-c-") == []


# --- a silent backend -------------------------------------------------------------------------


def _could_not_ask(target: Target, handle: JobHandle, prefix: str, *, strict: bool,
                   cancel: JobHandle | None = None) -> list[str]:
    """Ask a fresh backend (as a worker or triggerer would) everything about ``handle`` while
    its backend is silent: each call says "could not ask" (BackendUnreachable), within
    ``target.silent_within`` seconds; never LOST, never None, never an empty list. Not
    ``strict``: a status may be UNKNOWN, and find may answer from a record it could read
    (the same job). Returns how each call went, for the failure message."""
    seen: list[str] = []

    def ask(what: str, call: Callable[[], Any]) -> Any:
        start = time.monotonic()
        try:
            result = call()
        except BackendUnreachable as exc:
            result = exc
        took = time.monotonic() - start
        seen.append(f"{what}: {type(result).__name__} in {took:.1f}s")
        assert took <= target.silent_within, f"{what} took {took:.1f}s: {seen}"
        return result

    backend = target.backend()
    for what, call in (("status", lambda: backend.status([handle])),
                       ("astatus", lambda: _async(backend, lambda: backend.astatus([handle])))):
        result = ask(what, call)
        if not isinstance(result, BackendUnreachable):
            assert not strict, f"{what} answered {result} for a backend that cannot be asked"
            assert result[handle.job_id].state == JobState.UNKNOWN, (what, result, seen)
    found = ask("find", lambda: backend.find(handle.job_name))
    if not isinstance(found, BackendUnreachable):
        assert not strict and found is not None and found.job_id == handle.job_id, (found, seen)
    listed = ask("find_all", lambda: backend.find_all(prefix))
    assert isinstance(listed, BackendUnreachable), (listed, seen)
    if cancel is not None:
        outcome = ask("cancel", lambda: backend.cancel(cancel))
        assert isinstance(outcome, BackendUnreachable), (outcome, seen)
    return seen


def test_a_silent_backend_is_could_not_ask_never_gone(target):
    """With its backend silent (its address a closed port; the sandbox's real faults) every
    call says BackendUnreachable in bounded time; when the backend is back, the job is still
    there and completes once, and a job whose cancel could not be sent is cancelled for
    real."""
    target.quicken()
    backend = target.backend()
    marks = Path(shared_dir())
    stem = _name("silent")
    wait_go = f"i=0; while [ ! -e {marks}/go ] && [ $i -lt 900 ]; do sleep 1; i=$((i+1)); done"
    job_a = _task(target, f"{wait_go}; echo ran >> {marks}/runs-a")
    job_b = _task(target, f"{wait_go}; echo ran >> {marks}/runs-b")
    offer = _offer(backend, job_a)
    a, task_a = _submit(target, backend, job_a, f"{stem}-a-0", offer)
    b, task_b = _submit(target, backend, job_b, f"{stem}-b-0", offer)
    for handle in (a, b):
        _wait(target, backend, handle, {JobState.RUNNING})

    with target.unreachable():
        seen = _could_not_ask(target, a, f"{stem}-a-", strict=True, cancel=b)
    logging.getLogger(__name__).info("closed port: %s", seen)
    for name, fault in target.faults():
        with fault():
            seen = _could_not_ask(target, a, f"{stem}-a-", strict=False)
        logging.getLogger(__name__).info("%s: %s", name, seen)

    watcher = target.backend()  # the backend is back: nothing was lost, nothing doubled
    now = watcher.status([a, b])
    assert {now[a.job_id].state, now[b.job_id].state} <= ACTIVE, now
    assert watcher.find(a.job_name).job_id == a.job_id
    assert [h.job_id for h in watcher.find_all(f"{stem}-a-")] == [a.job_id]
    assert target.submissions(a.job_name) == 1
    watcher.cancel(b)  # the cancel that could not be sent, now that it can
    (marks / "go").touch()
    done = _wait(target, watcher, a)
    assert done.state == JobState.SUCCEEDED, done
    cancelled = _wait(target, watcher, b)
    assert cancelled.state == JobState.CANCELLED, cancelled
    assert _async(watcher, lambda: watcher.astatus([b]))[b.job_id].state == JobState.CANCELLED
    _until_none(lambda: target.running(b, task_b), 30, "what the cancelled job held")
    assert (marks / "runs-a").read_text() == "ran\n", "the job ran exactly once"
    assert not (marks / "runs-b").exists(), "the cancelled job never went on"
