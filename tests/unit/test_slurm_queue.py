"""The queue ahead and how jobs end, as the Slurm probe reads them: which idle GPUs are really
free for a new job, MaxTime in the fit, the estimate per shape and its discount, a pending
job's own start, CPU-only jobs on GPU nodes. Probe outputs are in the shape Slurm 22.05 prints
(the sandbox's facts are in tests/integration/test_slurm_estimates.py)."""

from __future__ import annotations

import math

import pytest

from airflow_skypilot.backends.base import JobHandle, JobState
from airflow_skypilot.backends.slurm import SlurmBackend, offers
from airflow_skypilot.backends.slurm.backfill import RUNNING_FIELDS
from airflow_skypilot.backends.slurm.cluster import PROBE_SCRIPT, parse_cluster, probe_script
from airflow_skypilot.backends.slurm.queue import (
    PENDING_FIELDS,
    array_tasks,
    duration_s,
    expand_hostlist,
    history_ratio,
    memory_mb,
    parse_pending,
    parse_reservation,
    tres_gpus,
)
from airflow_skypilot.backends.slurm.settings import SlurmSettings
from airflow_skypilot.backends.slurm.status import parse_status
from airflow_skypilot.exceptions import ConfigurationError
from airflow_skypilot.spec import load_task

NOW = 1796095149
SETTINGS = SlurmSettings.from_extra("c", {"cluster": "alpha"})


def probe(pending: list[str] = (), testonly: list[str] = (), history: list[str] | None = None,
          a1_used: int = 4, a2_used: int = 0, cpu_nodes: bool = False,
          a2_state: str = "") -> str:
    """alpha as the sandbox has it: a1, a2 with 4 A100 each; batch = both (no MaxTime), short
    = a2 (MaxTime 10 min); optionally a CPU partition ``cpu`` (c1)."""
    lines = ["@@now", str(NOW), "@@home", "/home/skyuser", "@@user", "skyuser", "@@nodes"]
    for name, used in (("a1", a1_used), ("a2", a2_used)):
        state = "idle" if not used else "mixed"
        if name == "a2" and a2_state:
            state = a2_state
        parts = ["batch*"] + (["short"] if name == "a2" else [])
        for part in parts:
            lines.append(f"{name}|{part}|{state}|{used}/{8 - used}/0/8|16000|{1000 * used}|"
                         f"gpu:a100:4(S:0)|gpu:a100:{used}(IDX:0)|127.0.1.{name[1]}|")
    if cpu_nodes:
        lines.append("c1|cpu|idle|0/8/0/8|16000|0|(null)|gpu:0|127.0.1.9|")
    lines += ["@@nodes_rc", "0", "@@partitions", "batch|up|infinite|n/a", "short|up|10:00|n/a"]
    if cpu_nodes:
        lines.append("cpu|up|infinite|n/a")
    lines += ["@@partitions_rc", "0", "@@pending", *pending, "@@pending_rc", "0"]
    lines.append("@@history")
    if history is not None:
        lines += [*history, "@@history_rc", "0"]
    lines += ["@@testonly", *testonly]
    return "\n".join(lines) + "\n"


def task_of(resources=None, options=None, num_nodes=1):
    spec = {"run": "x", "num_nodes": num_nodes, "resources": resources or {}}
    if options:
        spec["config"] = {"slurm": {"sbatch_options": options}}
    return load_task(spec)


def offers_of(out: str, task, settings=SETTINGS) -> dict[tuple[str, int], object]:
    st = parse_cluster(out)
    got = offers.offers(task, st, settings, "c", SlurmBackend("c", settings).unsupported)
    return {(o.location, o.request.index): o for o in got}


# --- parsing --------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("10:00", 600), ("1:00:00", 3600), ("2-12", 216000), ("1-00:00:00", 86400),
    ("1-2:30", 95400), ("UNLIMITED", math.inf), ("infinite", math.inf), ("n/a", None),
    ("NONE", None), ("", None), ("x:y", None),
])
def test_slurm_durations(text, seconds):
    assert duration_s(text) == seconds


def test_host_lists_gres_and_memory():
    assert expand_hostlist("a[1-2]") == ["a1", "a2"]
    assert expand_hostlist("gpu[01-02,05],login") == ["gpu01", "gpu02", "gpu05", "login"]
    assert expand_hostlist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    assert expand_hostlist("(null)") == []
    assert tres_gpus("gres:gpu:a100:4") == {"a100": 4}  # 22.05
    assert tres_gpus("gres/gpu:h100=2") == {"h100": 2}  # newer
    assert tres_gpus("gres:gpu:2") == {"": 2} and tres_gpus("N/A") == {}
    assert (memory_mb("1000M"), memory_mb("4G"), memory_mb("")) == (1000, 4096, 0)


def test_the_probe_asks_squeue_for_the_fields_the_parsers_read_in_their_order():
    script = PROBE_SCRIPT.replace("'\\\n'", "")  # the -O lists are split over lines
    for state, names in (("PENDING", PENDING_FIELDS), ("RUNNING,COMPLETING", RUNNING_FIELDS)):
        wanted = f"squeue -h -t {state} -O \\\n  '" + ",".join(f"{n}:|" for n in names) + "'"
        assert wanted in script, wanted


def test_pending_lines_and_the_probes_new_sections():
    job = parse_pending("1002|batch|2|Resources|gres:gpu:a100:4|2|1000M|1796096947|a[1-2]|"
                        "skyuser|4294901757|1:00:00")
    assert (job.nodes, job.gpus, job.cpus_per_node, job.mem_mb) == (2, {"a100": 4}, 1, 1000)
    assert (job.start, job.sched_nodes, job.time_limit_s) == (1796096947, ["a1", "a2"], 3600)
    assert job.runnable and job.user == "skyuser"
    unplanned = parse_pending("1011|short|1|PartitionTimeLimit|N/A|1|1000M|N/A|(null)|u|1|20:00")
    assert unplanned.start is None and not unplanned.runnable
    assert parse_pending("1001|batch|1|Resources").gpus == {}  # an older probe's line
    # the -O line as the probe prints it on 22.05 (copied from the sandbox): GPUs per job, per
    # task, memory in all (tres-alloc) where %m is per CPU (DefMemPerCPU, --mem-per-cpu)
    per_job = parse_pending("1002|batch|1|Resources|N/A|1|1000M|1796132882|a1|skyuser|"
                            "4294901757|20:00|gres:gpu:2|N/A|1|cpu=1,mem=1000M,node=1,billing=1|")
    assert (per_job.gpus, per_job.mem_mb, per_job.gpus_guessed) == ({"": 2}, 1000, False)
    per_task = parse_pending("1003|batch|1|Priority|N/A|3|1000M|1796132882|a2|skyuser|"
                             "4294901756|20:00|N/A|gres:gpu:1|3|cpu=3,mem=3000M,node=1,billing=3|")
    assert (per_task.gpus, per_task.cpus_per_node, per_task.mem_mb) == ({"": 3}, 3, 3000)
    per_cpu = parse_pending("1004|batch|1|Priority|gres:gpu:1|3|1500M|1796134080|a1|skyuser|"
                            "4294901755|20:00|N/A|N/A|1|cpu=3,mem=4500M,node=1,billing=3|")
    assert (per_cpu.gpus, per_cpu.mem_mb) == ({"": 1}, 4500)  # 3 CPUs x 1500M, not 1500M
    spread = parse_pending("1005|batch|2|Resources|N/A|2|1000M|N/A|(null)|u|1|20:00|"
                           "gres:gpu:a100:3|N/A|2|cpu=2,mem=8G,node=2|")
    assert (spread.gpus, spread.gpus_guessed, spread.mem_mb) == ({"a100": 2}, True, 4096)
    st = parse_cluster(probe(pending=["1002|batch|2|Resources|gres:gpu:a100:4|2|1000M|"
                                      "1796096947|a[1-2]|skyuser|9|1:00:00"],
                             history=["1800|3600|COMPLETED"],
                             testonly=["batch|a100|1|1|2|2048|1796098749"]))
    assert st.user == "skyuser" and st.history == ["1800|3600|COMPLETED"]
    assert st.partitions["short"].max_time_s == 600 and st.partitions["batch"].max_time_s == \
        math.inf and st.partitions["short"].default_time_s == 600
    assert st.partitions["batch"].pending == 1 and st.pending_jobs[0].job_id == "1002"
    assert st.starts[("batch", "a100", 1, 1, 2, 2048)] == 1796098749
    assert parse_cluster(probe()).history is None  # no @@history_rc: no history read


def test_the_probe_passes_the_tasks_own_options_and_keeps_the_history_on_the_login_node():
    script = probe_script(["--account=ml"], None, [(1, 1, 2, 0)], 20,
                          task_args=["--time=30", "--mail-type=END", "--comment=a b"],
                          history_file="~/.airflow-skypilot/probe-history-alpha")
    assert "TASKOPTS=(--time=30 --mail-type=END '--comment=a b')" in script
    assert '"${TASKOPTS[@]}" "${COMMON[@]}" -p "$1"' in script  # as the job script orders them
    assert 'HIST="$HOME"/.airflow-skypilot/probe-history-alpha' in script
    assert "sacct -a -X" in script and "sacct -c -a -X" in script
    assert "HIST=''" in probe_script([], None, [], 20)


# --- free now: only when Slurm would start it now -----------------------------------------------

#: a 2-node job of 4 A100 each that backfill plans on a1 and a2 in 30 minutes (when a1's
#: running job reaches its limit): the sandbox's own answer (squeue %S %Y)
RESERVED = (f"1002|batch|2|Resources|gres:gpu:a100:4|2|1000M|{NOW + 1800}|a[1-2]|other|9|"
            "1:00:00")


def test_idle_gpus_held_for_a_pending_job_ahead_are_not_free():
    out = probe(pending=[RESERVED], testonly=[f"batch|a100|1|1|0|0|{NOW + 3600}"])
    long = offers_of(out, task_of({"accelerators": "A100:1"}, {"time": "60"}))[("batch", 0)]
    assert long.fits and not long.free_now  # it would still run when 1002 starts
    assert long.details["gpus_idle"] == 4 and long.gpus_free == 0
    assert long.details["reserved_by_pending"] == 4 and long.details["held_for"] == ["1002"]
    assert long.notes[0] == "4 idle A100 held for 1 pending job(s) ahead"
    assert long.est_start == NOW + 3600  # Slurm's own estimate (no history to discount it)
    short = offers_of(out, task_of({"accelerators": "A100:1"}, {"time": "10"}))[("batch", 0)]
    assert short.free_now and short.est_start == NOW  # ends before 1002 starts: backfill
    assert "reserved_by_pending" not in short.details


def test_jobs_that_wait_for_other_reasons_hold_nothing():
    begin = f"5000|batch|1|BeginTime|gres:gpu:a100:4|1|1000M|{NOW + 60}|(null)|other|9|10:00"
    held = "5001|batch|1|JobHeldUser|gres:gpu:a100:4|1|1000M|N/A|(null)|other|9|10:00"
    got = offers_of(probe(pending=[begin, held]), task_of({"accelerators": "A100:4"}))
    assert got[("batch", 0)].free_now  # Slurm started such a job at once on the sandbox


def test_a_submission_made_moments_ago_takes_the_free_gpus_of_the_next_placement():
    # our first placement's job: pending, not scheduled yet (no plan), fits a2 now
    ours = "1010|batch|1|None|gres:gpu:a100:3|1|1000M|N/A|(null)|skyuser|9|1:00:00"
    got = offers_of(probe(pending=[ours]), task_of({"accelerators": "A100:2"}))[("batch", 0)]
    assert not got.free_now and got.gpus_free == 1
    assert got.details["reserved_by_pending"] == 3 and got.details["pending_ours"] == 1
    assert got.notes[0] == "3 idle A100 held for 1 pending job(s) ahead, 1 of them ours"
    one = offers_of(probe(pending=[ours]), task_of({"accelerators": "A100:1"}))[("batch", 0)]
    assert one.free_now  # the GPU it leaves is free


def test_a_planned_node_is_idle_for_jobs_that_end_first_and_held_when_nobody_says_for_whom():
    # Slurm 22.05 shows a node backfill plans a job on as PLANNED: idle, not down
    out = probe(pending=[RESERVED], a2_state="planned")
    short = offers_of(out, task_of({"accelerators": "A100:1"}, {"time": "10"}))[("batch", 0)]
    assert short.free_now and short.details["gpus_idle"] == 4
    unnamed = offers_of(probe(a2_state="planned"), task_of({"accelerators": "A100:1"}))
    assert not unnamed[("batch", 0)].free_now
    assert unnamed[("batch", 0)].details["held_for"] == ["(planned on a2)"]


def _resv(name, start, end, nodes="a2", state="INACTIVE", flags="MAINT,SPEC_NODES"):
    """A line of ``scontrol show res -o`` as 22.05 prints it with SLURM_TIME_FORMAT=%s (from
    the sandbox)."""
    return (f"ReservationName={name} StartTime={int(start)} EndTime={int(end)} "
            f"Duration=01:00:00 Nodes={nodes} NodeCnt=1 CoreCnt=8 Features=(null) "
            f"PartitionName=(null) Flags={flags} TRES=cpu=8 Users=root Groups=(null) "
            f"Accounts=(null) Licenses=(null) State={state} BurstBuffer=(null) Watts=n/a "
            "MaxStartDelay=(null)")


def _with(out: str, *lines: str) -> str:
    return out.replace("@@testonly", "@@reservations\n" + "".join(f"{x}\n" for x in lines)
                       + "@@reservations_rc\n0\n@@testonly")


def test_a_reservation_to_come_holds_its_nodes_for_jobs_that_would_still_run_at_its_start():
    line = _resv("maint-a2", NOW + 600, NOW + 4200)
    resv = parse_reservation(line)
    assert (resv.name, resv.active, resv.start, resv.end, resv.nodes) == (
        "maint-a2", False, NOW + 600, NOW + 4200, ("a2",))
    assert parse_reservation("No reservations in the system") is None
    assert parse_reservation(_resv("d", NOW + 600, NOW + 900, flags="MAINT,DAILY")).end == \
        math.inf  # it comes back tomorrow: scontrol shows its next window only
    # a start not given as epoch (a Slurm ignoring SLURM_TIME_FORMAT): held now, for ever
    unread = parse_reservation("ReservationName=m StartTime=Unknown EndTime=Unknown Nodes=a2 "
                               "State=INACTIVE")
    assert (unread.start, unread.end, unread.nodes) == (0.0, math.inf, ("a2",))
    assert parse_pending("1|batch|inf|None|N/A|1|1000M|N/A|(null)|u|9|1:00").nodes == 1
    out = _with(probe(a1_used=4), line)
    long = offers_of(out, task_of({"accelerators": "A100:1"}, {"time": "60"}))[("batch", 0)]
    assert not long.free_now and long.gpus_free == 0
    assert long.details["held_for_reservations"] == ["maint-a2"]
    assert long.notes[0] == "4 idle A100 held for reservation(s) maint-a2 starting before it " \
        "would end" and "reserved_by_pending" not in long.details
    short = offers_of(out, task_of({"accelerators": "A100:1"}, {"time": "5"}))[("batch", 0)]
    assert short.free_now  # ends before the maintenance begins
    assert offers_of(probe(a1_used=4), task_of({"accelerators": "A100:1"}, {"time": "60"}))[
        ("batch", 0)].free_now  # without it
    over = _with(probe(a1_used=4), _resv("old", NOW - 7200, NOW - 60, state="ACTIVE"))
    assert offers_of(over, task_of({"accelerators": "A100:1"}, {"time": "60"}))[
        ("batch", 0)].free_now  # one that has ended holds nothing


def test_a_connection_whose_jobs_run_in_a_reservation_is_free_only_inside_it_once_it_began():
    inside = SlurmSettings.from_extra("c", {"cluster": "alpha", "reservation": "grp"})
    task = task_of({"accelerators": "A100:1"}, {"time": "60"})
    # grp (a2) begins in 2 hours: a1 and a2 idle, but its jobs wait for it
    later = offers_of(_with(probe(a1_used=0), _resv("grp", NOW + 7200, NOW + 14400,
                                                    flags="SPEC_NODES")), task, inside)
    got = later[("batch", 0)]
    assert not got.free_now and got.details["held_for_reservations"] == [
        "outside grp", "grp until it begins"]
    # not listed (a typo, or deleted): nowhere is free for it
    gone = offers_of(probe(a1_used=0), task, inside)[("batch", 0)]
    assert not gone.free_now and gone.details["held_for_reservations"] == ["grp (not listed)"]
    # grp (a2) active and idle: Slurm shows a2 RESERVED to all; its jobs may start there now
    active = _with(probe(a1_used=4, a2_state="reserved"),
                   _resv("grp", NOW - 60, NOW + 14400, state="ACTIVE", flags="SPEC_NODES"))
    now = offers_of(active, task, inside)[("batch", 0)]
    assert now.free_now and now.gpus_free == 4
    assert not offers_of(active, task)[("batch", 0)].free_now  # a connection without it
    # another reservation (a maintenance of a2) still keeps it off a2
    both = offers_of(_with(probe(a1_used=0), _resv("grp", NOW - 60, NOW + 14400, nodes="a1",
                                                   state="ACTIVE", flags="SPEC_NODES"),
                           _resv("maint-a2", NOW + 600, NOW + 4200)), task, inside)
    assert both[("batch", 0)].details["held_for_reservations"] == ["maint-a2", "outside grp"]
    # the reservation given among the connection's sbatch_options confines its jobs alike
    # (read as no reservation before: a1, outside grp, was "free now" for them)
    for options in (["--reservation=grp"], ["--res", "grp"]):
        via = SlurmSettings.from_extra("c", {"cluster": "alpha", "sbatch_options": options})
        assert via.reservation == "grp" and via.common_sbatch_args() == options
        got = offers_of(_with(probe(a1_used=0, a2_used=4, a2_state="reserved"),
                              _resv("grp", NOW - 60, NOW + 14400, nodes="a2", state="ACTIVE",
                                    flags="SPEC_NODES")), task, via)[("batch", 0)]
        assert not got.free_now and "outside grp" in got.details["held_for_reservations"]
    with pytest.raises(ConfigurationError, match="'reservation' is 'grp' but extra "
                       "'sbatch_options' asks --reservation=other"):
        SlurmSettings.from_extra("c", {"reservation": "grp",
                                       "sbatch_options": ["--reservation=other"]})


def test_a_job_that_would_outlast_the_reservation_its_connection_runs_in_does_not_fit():
    # Slurm starts it all the same and ends it with the reservation (TIMEOUT): the sandbox
    inside = SlurmSettings.from_extra("c", {"cluster": "alpha", "reservation": "grp"})
    active = _with(probe(a1_used=4, a2_state="reserved"),
                   _resv("grp", NOW - 60, NOW + 1800, state="ACTIVE", flags="SPEC_NODES"))
    long = offers_of(active, task_of({"accelerators": "A100:1"}, {"time": "60"}), inside)
    assert not long[("batch", 0)].fits
    assert long[("batch", 0)].reason == ("time limit 1h00m; reservation grp ends in 30m: "
                                         "Slurm would end the job then (TIMEOUT)")
    short = offers_of(active, task_of({"accelerators": "A100:1"}, {"time": "20"}), inside)
    assert short[("batch", 0)].fits and short[("batch", 0)].free_now
    # no time limit (the partition's default is unlimited): it may end before; said in the table
    free = offers_of(active, task_of({"accelerators": "A100:1"}), inside)[("batch", 0)]
    assert free.fits and "reservation grp ends in 30m: Slurm ends the job then" in free.notes
    # one to come: the time left is counted from its start
    later = _with(probe(a1_used=4), _resv("grp", NOW + 600, NOW + 2400, flags="SPEC_NODES"))
    assert offers_of(later, task_of({"accelerators": "A100:1"}, {"time": "30"}), inside)[
        ("batch", 0)].fits
    assert not offers_of(later, task_of({"accelerators": "A100:1"}, {"time": "40"}), inside)[
        ("batch", 0)].fits
    # a connection without the extra is not confined to it
    assert offers_of(active, task_of({"accelerators": "A100:1"}, {"time": "60"}))[
        ("batch", 0)].fits


def test_a_pending_job_arrays_tasks_each_take_what_fits_them():
    assert [array_tasks(t) for t in ("N/A", "0-9", "1,3,5-11:2", "0-99%4", "7", "")] == \
        [1, 10, 6, 4, 1, 1]
    # squeue (22.05, no -r) shows a pending array as one line, the first task's plan on it
    line = ("1002|batch|1|Priority|gres:gpu:a100:2|2|1000M|N/A|(null)|other|9|20:00|N/A|N/A|1|"
            "cpu=2,mem=2000M,node=1|0-3|")
    job = parse_pending(line)
    assert (job.job_id, job.array_more, job.gpus) == ("1002", 3, {"a100": 2})
    got = offers_of(probe(a1_used=0, pending=[line]),
                    task_of({"accelerators": "A100:1"}, {"time": "60"}))[("batch", 0)]
    # four tasks of 2 GPUs take both idle nodes (one line read as one job took 2 of 8)
    assert not got.free_now and got.details["reserved_by_pending"] == 8
    assert got.details["held_for"] == ["1002"] and got.pending_jobs == 4


def test_gpus_asked_per_job_without_a_plan_are_taken_over_as_many_nodes_as_they_need():
    # both nodes idle; a --gpus=8 job (NumNodes 1: the least it may take) just submitted, no
    # plan yet: it takes a1 and a2 at the next pass (4 A100 each)
    job = ("2001|batch|1|None|N/A|1|1000M|N/A|(null)|other|9|1:00:00|gres:gpu:8|N/A|1|"
           "cpu=1,mem=1000M,node=1|")
    assert parse_pending(job).gpus_whole == {"": 8}
    got = offers_of(probe(a1_used=0, pending=[job]),
                    task_of({"accelerators": "A100:1"}, {"time": "60"}))[("batch", 0)]
    assert not got.free_now and got.details["reserved_by_pending"] == 8
    # planned on two nodes: split over both
    planned = ("2002|batch|1|Resources|N/A|1|1000M|1796096947|a[1-2]|other|9|1:00:00|"
               "gres:gpu:6|N/A|1|cpu=1,mem=1000M,node=1|")
    assert (parse_pending(planned).gpus, parse_pending(planned).gpus_guessed) == ({"": 3}, True)
    # --gres=gpu (no count) is one GPU
    assert tres_gpus("gres:gpu") == {"": 1} and tres_gpus("gres:gpu:a100") == {"a100": 1}
    assert tres_gpus("gres/gpumem=4G,gres/gpu=2") == {"": 2}


def test_gpu_types_that_start_with_a_digit_are_read_and_held():
    # common on university clusters (2080ti, 3090) and MIG slices (1g.5gb); a bare number
    # after gpu is a count, as Slurm reads --gres=gpu:4
    assert tres_gpus("gres:gpu:2080ti:2") == {"2080ti": 2}
    assert tres_gpus("gres/gpu:2080ti=2") == {"2080ti": 2}
    assert tres_gpus("gres:gpu:1g.5gb:1,gres:gpu:3090:2") == {"1g.5gb": 1, "3090": 2}
    assert tres_gpus("gres:gpu:2080ti") == {"2080ti": 1} and tres_gpus("gres:gpu:4") == {"": 4}
    # a 4-GPU job ahead holds a2's four idle 2080ti (read as no GPU: all four "free now")
    ahead = ("1010|batch|1|None|gres:gpu:2080ti:4|1|1000M|N/A|(null)|other|9|1:00:00|N/A|N/A|"
             "1|cpu=1,mem=1000M,node=1|N/A|")
    out = probe(a1_used=4, pending=[ahead],
                testonly=[f"batch|2080ti|1|1|0|0|{NOW + 3600}"]).replace("gpu:a100", "gpu:2080ti")
    got = offers_of(out, task_of({"accelerators": "2080ti:1"}, {"time": "60"}))[("batch", 0)]
    assert (got.free_now, got.gpus_free, got.details["reserved_by_pending"]) == (False, 0, 4)


def test_a_pending_job_that_does_not_fit_the_idle_nodes_and_has_no_plan_holds_nothing():
    big = "1020|batch|2|Resources|gres:gpu:a100:4|2|1000M|N/A|(null)|other|9|1:00:00"
    got = offers_of(probe(pending=[big]), task_of({"accelerators": "A100:4"}))[("batch", 0)]
    assert got.free_now


def test_test_onlys_later_counts_where_the_task_itself_or_nothing_queued_explains_it():
    later = [f"batch|a100|4|1|0|0|{NOW + 1800}"]
    pinned = task_of({"accelerators": "A100:4"}, {"nodelist": "a1"})  # a1 is busy
    got = offers_of(probe(testonly=later), pinned)[("batch", 0)]
    assert not got.free_now and got.est_start == NOW + 1800
    assert got.details["estimate"] == "sbatch --test-only with the task's --nodelist=a1"
    # only a1 counts for it (--nodelist): nothing idle there
    assert (got.nodes_total, got.gpus_free, got.gpus_total) == (1, 0, 4)
    begin = task_of({"accelerators": "A100:4"}, {"begin": "now+30minutes"})
    got = offers_of(probe(testonly=later), begin)[("batch", 0)]
    assert not got.free_now and got.est_start == NOW + 1800
    assert "idle, but sbatch --test-only says later (the task's --begin=now+30minutes)" \
        in got.notes
    plain = task_of({"accelerators": "A100:4"})
    assert not offers_of(probe(testonly=later), plain)[("batch", 0)].free_now
    # a pending job is queued there: test-only's "later" is its view of the queue ahead
    begin = f"5000|batch|1|BeginTime|gres:gpu:a100:4|1|1000M|{NOW + 60}|(null)|other|9|10:00"
    assert offers_of(probe(pending=[begin], testonly=later), plain)[("batch", 0)].free_now


def test_the_connections_node_options_count_as_the_tasks_own_do():
    # a job is queued in batch, so test-only's "later" beside idle a2 was read as its view
    # of the queue ahead, even when the connection's own options (sbatch runs with them)
    # keep the job off a2: the table said free now, and the job waited
    later = [f"batch|a100|4|1|0|0|{NOW + 1800}"]
    begin = f"5000|batch|1|BeginTime|gres:gpu:a100:4|1|1000M|{NOW + 60}|(null)|other|9|10:00"
    out = probe(pending=[begin], testonly=later)  # a1 busy, a2 idle
    plain = task_of({"accelerators": "A100:4"})

    def batch(**extra):
        settings = SlurmSettings.from_extra("c", {"cluster": "alpha", **extra})
        return offers_of(out, plain, settings)

    assert batch()[("batch", 0)].free_now
    assert batch(account="lab", qos="normal")[("batch", 0)].free_now  # limits, not nodes
    # node features are not probed: test-only's answer, with them, counts
    got = batch(constraint="ib")[("batch", 0)]
    assert not got.free_now and got.est_start == NOW + 1800
    assert got.details["estimate"] == "sbatch --test-only with the connection's --constraint=ib"
    assert "idle, but sbatch --test-only says later (the connection's --constraint=ib)" \
        in got.notes
    # --exclude/--nodelist: the nodes they rule out are not counted at all
    for options in ("--exclude=a2", "-w a1", "--nodelist=a[1]"):
        got = batch(sbatch_options=options)
        assert not got[("batch", 0)].free_now and got[("batch", 0)].est_start == NOW + 1800
        assert (got[("batch", 0)].nodes_total, got[("batch", 0)].gpus_free) == (1, 0)
        assert not got[("short", 0)].fits  # short is a2 alone
        assert got[("short", 0)].reason == f"{options} leaves no node of partition short"
    # and they pin nothing more: idle a2 beside the queue is free, as without them
    got = batch(sbatch_options="--exclude=a1")[("batch", 0)]
    assert (got.free_now, got.nodes_total) == (True, 1)
    got = batch(sbatch_options=["--exclude=a1", "--constraint=ib"])[("batch", 0)]
    assert not got.free_now and got.details["estimate"] == (
        "sbatch --test-only with the connection's --constraint=ib")
    # the task's own --exclude counts the same way
    excluding = task_of({"accelerators": "A100:4"}, ["--exclude", "a2"])
    got = offers_of(out, excluding)[("batch", 0)]
    assert (got.free_now, got.nodes_total, got.gpus_free) == (False, 1, 0)


def test_a_gpu_type_under_two_gres_names_is_offered_where_it_starts_soonest():
    # a1 (busy) has gres a100, a2 (idle) nvidia_a100: the first name was taken, and a2's
    # A100s were never counted
    later, now = f"batch|a100|4|1|0|0|{NOW + 3600}", f"batch|nvidia_a100|4|1|0|0|{NOW}"
    out = probe(testonly=[later, now]).replace("gpu:a100:4(S:0)|gpu:a100:0(IDX:0)",
                                               "gpu:nvidia_a100:4(S:0)|gpu:nvidia_a100:0(IDX:0)")
    got = offers_of(out, task_of({"accelerators": "A100:4"}))[("batch", 0)]
    assert (got.free_now, got.gpus_free, got.details["gres_type"]) == (True, 4, "nvidia_a100")
    assert got.accelerator == "A100"
    # both busy: the name test-only starts sooner
    busy = probe(a2_used=4, testonly=[later, f"batch|nvidia_a100|4|1|0|0|{NOW + 600}"]).replace(
        "gpu:a100:4(S:0)|gpu:a100:4(IDX:0)|127.0.1.2",
        "gpu:nvidia_a100:4(S:0)|gpu:nvidia_a100:4(IDX:0)|127.0.1.2")
    got = offers_of(busy, task_of({"accelerators": "A100:4"}))[("batch", 0)]
    assert (got.free_now, got.details["gres_type"]) == (False, "nvidia_a100")
    assert got.est_start == NOW + 600


# --- fit: MaxTime ------------------------------------------------------------------------------


def test_a_time_limit_over_the_partitions_max_time_does_not_fit_there():
    got = offers_of(probe(), task_of({"accelerators": "A100:1"}, {"time": "20"}))
    assert got[("batch", 0)].fits
    short = got[("short", 0)]
    assert not short.fits and short.reason == (
        "asks --time=20 (20m); partition short allows at most 10m (MaxTime): Slurm would keep "
        "it pending")
    assert offers_of(probe(), task_of({"accelerators": "A100:1"}, ["-t", "5"]))[
        ("short", 0)].fits
    by_connection = SlurmSettings.from_extra("c", {"cluster": "alpha", "time_limit": "2:00:00"})
    got = offers_of(probe(), task_of({"accelerators": "A100:1"}), by_connection)
    assert "allows at most 10m" in got[("short", 0)].reason
    assert got[("batch", 0)].details["time_limit"] == "2h00m"


# --- estimates ---------------------------------------------------------------------------------


def test_candidates_differing_in_cpus_or_memory_get_their_own_estimate():
    task = load_task({"run": "x", "resources": {"any_of": [
        {"accelerators": "A100:4", "cpus": 2}, {"accelerators": "A100:4", "cpus": 8}]}})
    assert offers.probe_shapes(task, SETTINGS) == [(4, 1, 2, 0), (4, 1, 8, 0)]
    out = probe(a2_used=1, testonly=[f"batch|a100|4|1|2|0|{NOW + 600}",
                                     f"batch|a100|4|1|8|0|{NOW + 7200}"])
    got = offers_of(out, task)
    assert got[("batch", 0)].est_start == NOW + 600
    assert got[("batch", 1)].est_start == NOW + 7200


def _history(n: int, share: float) -> list[str]:
    return [f"{int(3600 * share)}|3600|COMPLETED"] * n


def test_the_estimate_is_discounted_by_how_jobs_really_end_when_there_is_enough_history():
    testonly = [f"batch|a100|4|1|0|0|{NOW + 4000}"]
    task = task_of({"accelerators": "A100:4"})
    got = offers_of(probe(a2_used=1, testonly=testonly, history=_history(30, 0.4)), task)
    offer = got[("batch", 0)]
    assert offer.est_start == pytest.approx(NOW + 1600)
    assert offer.details["test_only_start"] == NOW + 4000
    assert offer.details["estimate"] == ("sbatch --test-only, x0.40: recent jobs end at a "
                                         "median 40% of their time limit (30 jobs)")
    assert offer.notes == [f"est. by {offer.details['estimate']}"]
    few = offers_of(probe(a2_used=1, testonly=testonly, history=_history(5, 0.4)), task)
    assert few[("batch", 0)].est_start == NOW + 4000
    assert "not discounted: 5 finished job(s)" in few[("batch", 0)].details["estimate"]


def test_history_ratio_floor_ceiling_and_what_does_not_count():
    assert history_ratio(_history(30, 0.01)).ratio == 0.1  # floor
    assert history_ratio(["7200|3600|TIMEOUT"] * 25).ratio == 1.0  # over the limit: 1
    lines = _history(15, 0.5) + ["100|3600|NODE_FAIL"] * 10 + ["0|3600|CANCELLED by 1"] * 10
    assert history_ratio(lines).ratio is None and history_ratio(lines).jobs == 15
    assert history_ratio(_history(15, 0.5) + ["900|3600|CANCELLED by 1001"] * 5).ratio == 0.5


def test_test_only_refusals_do_not_fit():
    out = probe(testonly=["batch|a100|1|1|0|0|sbatch: error: Batch job submission failed: "
                          "Invalid qos specification"])
    got = offers_of(out, task_of({"accelerators": "A100:1"}))[("batch", 0)]
    assert not got.fits and "Invalid qos" in got.reason


# --- CPU-only on GPU nodes ---------------------------------------------------------------------


def test_cpu_only_candidates_are_marked_on_partitions_of_gpu_nodes():
    got = offers_of(probe(cpu_nodes=True), task_of({"cpus": 2}))
    assert got[("batch", 0)].details["gpu_place"] is True
    assert "CPU-only on GPU nodes" in got[("batch", 0)].notes
    assert got[("cpu", 0)].details["gpu_place"] is False and got[("cpu", 0)].free_now
    gpu = offers_of(probe(cpu_nodes=True), task_of({"accelerators": "A100:1"}))
    assert "gpu_place" not in gpu[("batch", 0)].details


# --- a pending job's own estimated start -------------------------------------------------------


def _handle(job_id: str) -> JobHandle:
    return JobHandle(backend="slurm", connection="c", job_id=job_id, job_name="n",
                     location="batch", infra="slurm/alpha/batch")


def test_a_pending_jobs_own_start_is_its_status_est_start():
    out = "\n".join(["@@tz", "+0000", "@@now", str(NOW), "@@squeue",
                     f"7|n|PENDING|Resources||{NOW + 1800}|N/A",
                     "8|n|PENDING|Priority||N/A|N/A",
                     f"9|n|PENDING|Priority||{NOW - 3600}|N/A",
                     f"10|n|RUNNING|None|a1|{NOW - 60}|{NOW + 600}",
                     "@@squeue_rc", "0", "@@sacct", "@@sacct_rc", "1", "@@exits"])
    got = parse_status(out, [_handle(i) for i in ("7", "8", "9", "10")])
    assert got["7"].state == JobState.PENDING and got["7"].est_start == NOW + 1800
    assert got["8"].est_start is None  # not planned yet
    assert got["9"].est_start is None  # a stale start (a requeued job's last one)
    assert got["10"].est_start is None and got["10"].started_at == NOW - 60


def test_a_pending_jobs_own_start_is_discounted_as_the_probes_estimates_are():
    history = _history(30, 0.5)
    out = "\n".join(["@@tz", "+0000", "@@now", str(NOW), "@@squeue",
                     f"7|n|PENDING|Resources||{NOW + 1800}|N/A", "@@squeue_rc", "0",
                     "@@sacct", "@@sacct_rc", "1", "@@exits", "@@history", *history])
    assert parse_status(out, [_handle("7")])["7"].est_start == NOW + 900
    from airflow_skypilot.backends.slurm.status import status_script

    script = status_script([_handle("7")], history_file="~/.airflow-skypilot/h-alpha")
    assert script.endswith('echo @@history\ncat "$HOME"/.airflow-skypilot/h-alpha 2>/dev/null\n'
                           "true")
    assert "sacct -a" not in script  # the probe refreshes the history, the poll only reads it
