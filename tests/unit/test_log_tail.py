"""The tail a failure quotes is the end of the job's output, however long it is and whether it
was streamed or not (a read from offset 0 gives only its first MiB)."""

from __future__ import annotations

import logging

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_skypilot import polling
from airflow_skypilot.backends.base import Backend, JobHandle, JobState, JobStatus, tail_text
from airflow_skypilot.sensors import SkyPilotJobSensor
from airflow_skypilot.triggers.skypilot import SkyPilotJobTrigger
from tests.fakes import FakeBackend, registered

#: about 2.6 MB: well over what one read returns
BIG = "".join(f"{i}\n" for i in range(1, 400_001)) + "final-marker: boom\n"


_fake = pytest.fixture(autouse=True)(registered)


def _failed(log: str = BIG) -> JobHandle:
    FakeBackend.jobs["1"] = {"name": "n1", "conn": "c1", "location": "p", "env": {}, "log": log,
                             "status": JobStatus(JobState.FAILED, reason="exit code 1",
                                                 exit_code=1)}
    return JobHandle(backend="fake", connection="c1", job_id="1", job_name="n1",
                     location="p", infra="fake/c1/p")


def _is_the_end(tail: str) -> None:
    lines = tail.splitlines()
    assert lines[-1] == "final-marker: boom", lines[-3:]
    assert lines[-2] == "400000" and len(lines) == 40, lines[:3]


async def test_the_trigger_event_carries_the_end_of_a_long_log():
    """Not streamed: its offset stays 0 (streamed, the 400,000 lines would go through the task
    log first, a minute and more of this test for what the offset already gave)."""
    handle = _failed()
    trigger = SkyPilotJobTrigger(handle.to_dict(), poll_interval=0.01, stream_logs=False)
    events = trigger.run()
    event = await anext(events)
    await events.aclose()  # unsubscribes from the shared poller
    assert event.payload["status"] == "done"
    _is_the_end(event.payload["log_tail"])


def test_the_worker_watch_quotes_the_end_of_a_long_log():
    status, tail, offset = polling.until_done(
        FakeBackend("c1"), _failed(), poll_interval=0.01, silence=5, offset=0,
        stream_logs=False, log=logging.getLogger(__name__))
    assert status.state == JobState.FAILED and offset == 0
    _is_the_end(tail)


def test_the_poking_sensor_quotes_the_end_of_a_long_log():
    handle = _failed()
    with pytest.raises(AirflowFailException) as info:
        SkyPilotJobSensor(task_id="wait", handle=handle.to_dict(), deferrable=False).poke({})
    _is_the_end(str(info.value).partition("Last lines of its log:\n")[2])


def test_the_default_read_tail_follows_the_reads_to_the_end(monkeypatch):
    """A backend without its own read_tail still quotes the end (within a few reads)."""
    monkeypatch.setattr(FakeBackend, "read_limit", 1 << 19)
    tail = Backend.read_tail(FakeBackend("c1"), _failed(), 1000)
    assert tail.endswith("399999\n400000\nfinal-marker: boom\n") and len(tail) <= 1000
    assert tail.startswith(f"{400_000 - tail.count(chr(10)) + 2}\n")  # whole lines


def test_tail_text_cuts_whole_lines_and_joins_ranks_as_the_log_does():
    assert tail_text([(0, b"a\nb\n", True)], 100) == "a\nb\n"
    assert tail_text([(0, b"xyz\nb\nc\n", False)], 100) == "b\nc\n"  # its start was cut
    assert tail_text([(0, b"aaaa\nbb\ncc\n", True)], 6) == "bb\ncc\n"  # cut at a line
    assert tail_text([(0, b"aaaa\nbb\ncc\n", True)], 5) == "cc\n"
    assert tail_text([(0, "\u00e9\u00e9\n".encode(), True)], 4) == "\u00e9\n"
    # ranks follow rank 0, each line prefixed; a rank cut at its start ends what is shown
    assert tail_text([(0, b"r0", True), (1, b"one\n", True)], 100) == "r0\n(rank 1) one\n"
    assert tail_text([(0, b"r0\n", True), (1, b"cut\nend\n", False), (2, b"x\n", True)],
                     100) == "(rank 1) end\n(rank 2) x\n"
