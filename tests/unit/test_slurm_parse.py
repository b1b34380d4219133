"""Parsing Slurm's portable -o/-O output (captured from Slurm 22.05) and mapping its states."""

from __future__ import annotations

import pytest

from airflow_skypilot.backends.base import JobHandle, JobState
from airflow_skypilot.backends.slurm.cluster import parse_cluster, parse_gres
from airflow_skypilot.backends.slurm.settings import SlurmSettings
from airflow_skypilot.backends.slurm.status import epoch, parse_status

PROBE = """\
@@now
1795988258
@@home
/home/skyuser
@@nodes
a1|batch*|mixed|2/6/0/8|16000|2000|gpu:a100:4|gpu:a100:2(IDX:0-1)|127.0.1.1|
a2|short|idle|0/8/0/8|16000|0|gpu:a100:4(S:0)|gpu:a100:0(IDX:N/A)|127.0.1.2|
a2|batch*|idle|0/8/0/8|16000|0|gpu:a100:4(S:0)|gpu:a100:0(IDX:N/A)|127.0.1.2|
a3|batch*|down*|0/0/8/8|16000|0|gpu:a100:4|gpu:a100:0(IDX:N/A)|127.0.1.3|
@@partitions
batch|up|infinite
short|up|10:00
@@pending
1001|batch|1|Resources
1002|batch,short|1|Priority
@@testonly
batch|a100|2|1|0|0|1795988258
short|a100|8|1|0|0|allocation failure: Requested node configuration is not available
"""


def test_cluster_parse_counts_a_node_in_two_partitions_once():
    st = parse_cluster(PROBE)
    assert set(st.nodes) == {"a1", "a2", "a3"}
    assert st.nodes["a2"].partitions == ["short", "batch"]
    assert st.partitions["batch"].default and not st.partitions["short"].default
    assert st.partitions["short"].time_limit == "10:00"
    assert st.partitions["batch"].pending == 2 and st.partitions["short"].pending == 1
    assert st.nodes["a1"].gpus_free("a100") == 2 and st.nodes["a1"].cpus_free == 6
    assert st.nodes["a1"].mem_free_mb == 14000
    assert not st.nodes["a3"].usable and st.nodes["a2"].usable
    assert st.starts[("batch", "a100", 2, 1, 0, 0)] == 1795988258.0
    assert "not available" in st.starts[("short", "a100", 8, 1, 0, 0)]
    assert st.home == "/home/skyuser" and st.now == 1795988258.0


def test_the_probe_lists_its_users_jobs_by_name_before_it_reads_the_capacity():
    from airflow_skypilot.backends.slurm.cluster import PROBE_SCRIPT

    # a job listed here was in slurmctld before the nodes and the queue were read: in their
    # counts (ledger.hold relies on that order)
    assert PROBE_SCRIPT.index("@@ours") < PROBE_SCRIPT.index("@@nodes")
    head, _, rest = PROBE.partition("@@nodes\n")
    st = parse_cluster(head + "@@ours\nsky-a-c0-t1-a0\n\nsky-b-c0-t1-a0\n@@ours_rc\n0\n"
                       "@@nodes\n" + rest)
    assert st.our_jobs == {"sky-a-c0-t1-a0", "sky-b-c0-t1-a0"}
    # a listing that failed says nothing (not: "none of our jobs is there")
    st = parse_cluster(head + "@@ours\n@@ours_rc\n1\n@@nodes\n" + rest)
    assert st.our_jobs is None
    assert parse_cluster(PROBE).our_jobs is None
    # the login node's clock with its fraction: the probe's time is not truncated
    assert parse_cluster(PROBE.replace("1795988258\n@@home", "1795988258.25\n@@home")).now \
        == 1795988258.25
    # a date without %N (busybox) prints it as it is: the whole seconds
    assert parse_cluster(PROBE.replace("1795988258\n@@home", "1795988258.%N\n@@home")).now \
        == 1795988258.0


@pytest.mark.parametrize(("text", "expected"), [
    ("gpu:a100:4", {"a100": 4}),
    ("gpu:a100:4(S:0-1)", {"a100": 4}),
    ("gpu:4", {"": 4}),
    ("gpu:a100:2,gpu:h100:4(S:1)", {"a100": 2, "h100": 4}),
    ("gpu:a100:2(IDX:0-1),shard:8", {"a100": 2}),
    ("(null)", {}),
    ("", {}),
])
def test_gres(text, expected):
    assert parse_gres(text) == expected


@pytest.mark.parametrize("state", ["down*", "drained", "draining", "idle*", "mixed+drain",
                                   "maint", "fail", "inval", "unknown"])
def test_unusable_node_states(state):
    st = parse_cluster(PROBE.replace("a2|short|idle", f"a2|short|{state}"))
    assert not st.nodes["a2"].usable


def _handle(job_id: str) -> JobHandle:
    return JobHandle(backend="slurm", connection="c", job_id=job_id, job_name="n",
                     location="batch", infra="slurm/c/batch", extra={"job_dir": "/d"})


@pytest.mark.parametrize(("raw", "reason", "exit_file", "state", "code"), [
    ("PENDING", "Resources", "", JobState.PENDING, None),
    ("RUNNING", "None", "", JobState.RUNNING, None),
    ("COMPLETING", "None", "", JobState.RUNNING, None),
    ("COMPLETING", "None", "0", JobState.SUCCEEDED, 0),  # its exit file: Slurm cleans up
    ("COMPLETING", "None", "2", JobState.FAILED, 2),
    # a node of a multi-node job went down: srun exited non-zero; Slurm ends it NODE_FAIL
    ("COMPLETING", "NodeDown", "1", JobState.RUNNING, 1),
    ("COMPLETED", "None", "0", JobState.SUCCEEDED, 0),
    ("FAILED", "NonZeroExitCode", "3", JobState.FAILED, 3),
    ("OUT_OF_MEMORY", "OutOfMemory", "", JobState.FAILED, None),
    ("TIMEOUT", "TimeLimit", "", JobState.FAILED, None),
    ("NODE_FAIL", "NodeDown", "", JobState.INFRA_FAILED, None),
    ("BOOT_FAIL", "None", "", JobState.INFRA_FAILED, None),
    ("PREEMPTED", "None", "", JobState.PREEMPTED, None),
    ("CANCELLED", "None", "", JobState.CANCELLED, None),
    ("CANCELLED+", "None", "", JobState.CANCELLED, None),
])
def test_state_mapping(raw, reason, exit_file, state, code):
    out = (f"@@squeue\n7|n|{raw}|{reason}|a1|2026-11-29T21:00:00|N/A\n@@squeue_rc\n0\n"
           "@@sacct\n@@sacct_rc\n1\n@@exits\n" + (f"7|{exit_file}\n" if exit_file else ""))
    status = parse_status(out, [_handle("7")])["7"]
    assert status.state == state
    assert status.exit_code == code
    if state == JobState.PENDING:
        assert status.reason == "Resources"


def test_sacct_and_exit_files_cover_jobs_that_left_the_queue():
    out = ("@@squeue\n@@squeue_rc\n0\n@@sacct\n8|NODE_FAIL|0:0|1796000000|1796000100||n\n"
           "8.batch|CANCELLED|0:15|||batch\n@@sacct_rc\n0\n@@exits\n9|0\n")
    got = parse_status(out, [_handle("8"), _handle("9"), _handle("10")])
    assert got["8"].state == JobState.INFRA_FAILED
    assert (got["8"].started_at, got["8"].ended_at) == (1796000000.0, 1796000100.0)
    assert got["9"].state == JobState.SUCCEEDED
    assert got["10"].state == JobState.LOST  # squeue answered, no record of it anywhere


def test_a_step_that_srun_could_not_launch_is_an_infra_failure():
    # the job script's verdict "nostep <phase> <srun's exit>" (submit._sbatch_script), whether
    # squeue, sacct or only the exit file still knows the job; a plain exit code stays the
    # user's
    out = ("@@squeue\n7|n|FAILED|NonZeroExitCode|a1|1|2\n@@squeue_rc\n0\n"
           "@@sacct\n8|FAILED|1:0|1796000000|1796000100||n\n@@sacct_rc\n0\n"
           "@@exits\n7|nostep run 1\n8|nostep setup 1\n9|nostep run 1\n10|1\n")
    got = parse_status(out, [_handle(j) for j in ("7", "8", "9", "10")])
    for job, phase in (("7", "run"), ("8", "setup"), ("9", "run")):
        assert (got[job].state, got[job].exit_code) == (JobState.INFRA_FAILED, 1), got[job]
        assert f"could not launch the job's {phase} step" in got[job].reason
    assert got["10"].state == JobState.FAILED


_LISTED_FAILED = [  # squeue or sacct still knows the failed job (its exit file is written)
    ("7|n|FAILED|NonZeroExitCode|n[1-2]|100|200\n", "", 1),  # squeue's MinJobAge window
    ("7|n|COMPLETING|None|n[1-2]|100|200\n", "", 1),  # Slurm's clean-up after the exit file
    ("", "7|FAILED|1:0|100|200||n\n", 0),  # left the queue, accounting remembers it
]


def _listed(squeue: str, sacct: str, sacct_rc: int, exits: str):
    out = (f"@@squeue\n{squeue}@@squeue_rc\n0\n@@sacct\n{sacct}@@sacct_rc\n{sacct_rc}\n"
           f"@@exits\n7|{exits}\n")
    return parse_status(out, [_handle("7")])["7"]


@pytest.mark.parametrize(("squeue", "sacct", "sacct_rc"), _LISTED_FAILED)
def test_a_rank_whose_node_is_down_is_infra_while_slurm_still_lists_the_failed_job(
        squeue, sacct, sacct_rc):
    """Rank 0 exited 1 (its collective broke), rank 1's node is down: not the user's, from
    the first poll that sees the job failed, not only once Slurm forgot it."""
    status = _listed(squeue, sacct, sacct_rc, "1 ranks run 0=1 1=down")
    assert status.state == JobState.INFRA_FAILED and "rank 1" in status.reason, status
    assert (status.exit_code, status.exit_codes) == (1, [1])
    assert (status.started_at, status.ended_at) == (100.0, 200.0)  # Slurm's times stay


@pytest.mark.parametrize(("squeue", "sacct", "sacct_rc"), _LISTED_FAILED)
def test_every_failed_ranks_code_is_read_while_slurm_still_lists_the_failed_job(
        squeue, sacct, sacct_rc):
    """recover_on_exit_codes sees every rank's code, not srun's highest one."""
    status = _listed(squeue, sacct, sacct_rc, "100 ranks run 0=33 1=100")
    assert status.state == JobState.FAILED, status
    assert (status.exit_code, status.exit_codes) == (33, [33, 100])
    assert status.reason == "exit code 33 on rank 0"
    # rank 1's setup failed, srun stopped rank 0's (TERM: 143): rank 1's code is the failure
    stopped = _listed(squeue, sacct, sacct_rc, "143 ranks setup 0=143 1=3")
    assert (stopped.reason, stopped.exit_code, stopped.exit_codes) == \
        ("exit code 3 on rank 1", 3, [143, 3])
    lost = _listed(squeue, sacct, sacct_rc, "137 ranks run 0=0 1=-")  # no rank failed
    assert lost.state == JobState.INFRA_FAILED and "rank 1" in lost.reason, lost


def test_a_ranks_line_judges_only_a_job_slurm_says_failed():
    """Not one Slurm says timed out (its ranks were stopped, none wrote a code: the user's
    time limit), nor one still completing because of a node (NODE_FAIL follows)."""
    ended = "7|n|{}|None|n[1-2]|100|200\n"
    assert _listed(ended.format("FAILED"), "", 1, "143 ranks run 0=- 1=-").state \
        == JobState.INFRA_FAILED
    status = _listed(ended.format("TIMEOUT"), "", 1, "143 ranks run 0=- 1=-")
    assert (status.state, status.reason) == (JobState.FAILED, "time limit reached")
    node_down = "7|n|COMPLETING|NodeDown|n[1-2]|100|N/A\n"  # NODE_FAIL comes after it
    assert _listed(node_down, "", 1, "1 ranks run 0=1 1=down").state == JobState.RUNNING


@pytest.mark.parametrize("squeue", [
    "@@squeue\n@@squeue_rc\n1\n",  # slurm_load_jobs error: Socket timed out
    "@@squeue\n7|n|RUNNING|None|a1|1|N/A\n@@squeue_rc\n124\n",  # killed by timeout, half out
    "@@squeue\n",  # the script stopped before squeue's exit status
])
def test_a_squeue_that_did_not_answer_is_unknown_never_lost(squeue):
    out = squeue + "@@sacct\n@@sacct_rc\n1\n@@exits\n9|3\n"
    got = parse_status(out, [_handle("7"), _handle("9")])
    assert got["7"].state == JobState.UNKNOWN and "squeue" in got["7"].reason
    assert (got["9"].state, got["9"].exit_code) == (JobState.FAILED, 3)  # its exit file speaks


def test_a_failed_sacct_is_not_read_and_an_empty_state_is_unknown():
    out = ("@@squeue\n@@squeue_rc\n0\n@@sacct\n8|NODE_FAIL|0:0||||n\n@@sacct_rc\n1\n"
           "@@exits\n")
    assert parse_status(out, [_handle("8")])["8"].state == JobState.LOST
    out = "@@squeue\n@@squeue_rc\n0\n@@sacct\n8||0:0||||n\n@@sacct_rc\n0\n@@exits\n"
    assert parse_status(out, [_handle("8")])["8"].state == JobState.UNKNOWN
    out = "@@squeue\n8|n|SOMETHING_NEW|x|a1|1|2\n@@squeue_rc\n0\n@@sacct\n@@exits\n"
    assert parse_status(out, [_handle("8")])["8"].state == JobState.UNKNOWN


def test_times_are_epoch_seconds_or_the_clusters_own_local_time():
    assert epoch("1796000000") == 1796000000.0
    # a cluster at +05:30 that printed its local time: 2026-11-29T21:00:00+05:30
    assert epoch("2026-11-29T21:00:00", 5.5 * 3600) == 1795986000.0 - 5.5 * 3600
    for none in ("", "N/A", "Unknown", "None", "0"):
        assert epoch(none) is None
    out = ("@@tz\n+0530\n@@squeue\n7|n|COMPLETED|None|a1|2026-11-29T21:00:00|"
           "2026-11-29T21:10:00\n@@squeue_rc\n0\n@@sacct\n@@exits\n7|0\n")
    status = parse_status(out, [_handle("7")])["7"]
    assert (status.started_at, status.ended_at) == (1795986000.0 - 19800, 1795986600.0 - 19800)
    pending = "@@squeue\n7|n|PENDING|Priority||1796999999|N/A\n@@squeue_rc\n0\n@@exits\n"
    assert parse_status(pending, [_handle("7")])["7"].started_at is None  # an estimate


def test_settings_from_connection_extras():
    s = SlurmSettings.from_extra("conn", {
        "cluster": "hpc1", "partitions": "gpu, debug", "account": "ml", "qos": "high",
        "sbatch_options": "--exclusive --comment='a b'", "time_limit": "1:00:00",
        "price_per_gpu_hour": "2.5"})
    assert s.partitions == ["gpu", "debug"]
    assert s.common_sbatch_args() == ["--account=ml", "--qos=high", "--time=1:00:00",
                                      "--exclusive", "--comment=a b"]
    assert s.price_per_gpu_hour == 2.5
    assert SlurmSettings.from_extra("conn", {}).cluster == "conn"


def test_a_row_under_our_id_but_another_name_and_later_is_not_our_job():
    """Slurm gave our old job's id to another job, submitted after ours: its queue and
    accounting rows are not ours; our job's own exit file still speaks, and without one it
    is lost (never the other job's RUNNING or FAILED). A row by another name submitted when
    ours was is ours, renamed (a site's job_submit plugin, an scontrol update)."""
    from dataclasses import replace as with_

    mine = [with_(_handle(j), submitted_at=1000.0) for j in ("7", "8")]
    later = ("@@squeue\n7|sky-other|RUNNING|None|a1|100|N/A|5000\n@@squeue_rc\n0\n"
             "@@sacct\n8|FAILED|1:0|5000|5100|5000|sky-other\n@@sacct_rc\n0\n@@exits\n")
    got = parse_status(later, mine)
    assert got["7"].state == got["8"].state == JobState.LOST, got
    got = parse_status(later + "7|0\n8|0\n", mine)
    assert got["7"].state == got["8"].state == JobState.SUCCEEDED, got
    renamed = later.replace("|5000", "|1030")  # submitted when ours was: ours, renamed
    got = parse_status(renamed, mine)
    assert (got["7"].state, got["8"].state) == (JobState.RUNNING, JobState.FAILED), got
    unknown = parse_status(later, [_handle("7"), _handle("8")])  # no submit time of ours
    assert (unknown["7"].state, unknown["8"].state) == (JobState.RUNNING, JobState.FAILED)


def test_a_cancel_leaves_a_job_that_only_holds_our_id(tmp_path):
    """The cancel script, run against a stub squeue and scancel: another job submitted later
    under our id is not cancelled (and says so), ours and ours renamed are."""
    import subprocess
    from dataclasses import replace as with_

    from airflow_skypilot.backends.slurm.submit import cancel_script

    script = cancel_script(with_(_handle("7"), submitted_at=1000.0))

    def cancelled(row: str) -> tuple[bool, str]:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "squeue").write_text(f"#!/bin/sh\nprintf '%s\\n' '{row}'\n")
        (bin_dir / "scancel").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/scancelled\n")
        for tool in ("squeue", "scancel"):
            (bin_dir / tool).chmod(0o755)
        (tmp_path / "scancelled").unlink(missing_ok=True)
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, timeout=30)
        assert done.returncode == 0, done.stderr
        return (tmp_path / "scancelled").exists(), done.stdout

    assert cancelled("n|1001") == (True, "")
    assert cancelled("renamed|1030")[0]
    assert cancelled("")[0]  # not listed (ended), or squeue silent: scancel says
    assert cancelled("sky-other|5000") == (
        False, "airflow-skypilot: id 7 is held by another job now (sky-other|5000): not "
               "cancelled\n")


def test_the_status_script_reads_sacct_and_picks_our_record_of_an_id_given_again(tmp_path):
    """The generated script against stub Slurm commands: sacct is asked for every job that
    held the id (-D) with its submit time and name, its answer reaches the parser, and our
    record is the one read, not the newer job's (a missing space once sent sacct's output to
    /dev/null and asked for a field "JobName2": no test ran the script)."""
    import subprocess
    from dataclasses import replace as with_

    from airflow_skypilot.backends.slurm.status import status_script

    ours = with_(_handle("7"), submitted_at=1000.0, extra={})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "squeue": "exit 0",
        "sacct": f'echo "$@" > {tmp_path}/sacct.args\n'
                 "printf '7|COMPLETED|0:0|1000|1100|1000|n\\n7|RUNNING|0:0|5000|Unknown|5000|"
                 "sky-other\\n'",
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(["bash", "-c", status_script([ours])], capture_output=True, text=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "USER": "u"}, timeout=30)
    assert done.returncode == 0, done.stderr
    args = (tmp_path / "sacct.args").read_text().split()
    assert "-D" in args and "JobIDRaw,State,ExitCode,Start,End,Submit,JobName" in args, args
    got = parse_status(done.stdout, [ours])["7"]
    assert got.state == JobState.SUCCEEDED, got  # our record, not the other job's RUNNING
