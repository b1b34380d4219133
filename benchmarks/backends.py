"""Benchmarks against the sandbox's real backends: ``python benchmarks/backends.py NAME...``.

Every number is a ratio of two things measured side by side in one run (interleaved rounds;
see ``common.py``). Needs the sandbox up (``python -m tests.sandbox up``).

probe
    ``SkyPilotCapacityHook.probe`` of every default sandbox connection at once (two Slurm
    clusters over SSH, the Kubernetes API, the AWS endpoint) vs the slowest of the same
    connections probed one by one, in the same round. Warm: each hook keeps its connections
    (as within one worker), and cold: a new hook per probe (a new worker: SSH handshakes,
    clients built).
submit
    ``SlurmBackend.submit`` (the project's submission: lookup, job files over SFTP, sbatch
    under flock) until the user code runs, vs a raw ``sbatch --wrap`` over the same SSH
    connection until its command runs; both jobs write ``date +%s.%N`` as their first act,
    which is the "running" instant.
failover
    The real operator in ``airflow dags test`` (tests/e2e/dags/e2e.py, poll_interval 1 s): its
    Slurm job's node is set DOWN; from slurmctld's "Killing JobId=... on failed node" to the
    next ``sbatch`` that reaches a slurmctld (both from slurmctld's log, to the millisecond),
    vs a fresh placement of the same task by the same code (probe every connection, rank,
    submit) measured in the same round.
sweep
    A sweep of 100 mapped tasks: each member runs the operator's worker-side placement
    (``Placer.reconcile`` then ``Placer.place``: list earlier tries' jobs, probe the two Slurm
    clusters and Kubernetes, rank, submit) in a thread with its own hook (its own
    connections, as a fresh worker), at most 16 at a time (Airflow's default
    ``max_active_tasks_per_dag``); per-member placement latency vs one task placed alone
    (median of 3) in the same round. Airflow's own scheduling and worker start are not in it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("AIRFLOW_HOME", str(REPO / ".sandbox" / "airflow-home"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__LOGGING__LOGGING_LEVEL", "WARNING")

from common import (  # noqa: E402
    DEFAULT_CONNECTIONS,
    Machine,
    interleaved,
    ratios,
    slurm_cmd,
    slurmctld_events,
    spread,
    use_sandbox,
)

ROWS: list[tuple[str, str, str]] = []
LOG = logging.getLogger("benchmarks")

#: what the probe asks for: the demo's training shape (fits every sandbox connection)
PROBE_TASK = {"resources": {"accelerators": {"A100": 1, "H100": 1}}, "run": "true"}


def _quiet() -> None:
    for name in ("airflow", "paramiko", "botocore", "kubernetes", "urllib3", "asyncssh"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("airflow.task").setLevel(logging.ERROR)


# --- probe -----------------------------------------------------------------------------------

def bench_probe(rounds: int) -> None:
    from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
    from airflow_skypilot.spec import load_task

    use_sandbox()
    task = load_task(PROBE_TASK)
    conns = list(DEFAULT_CONNECTIONS)
    warm_all = SkyPilotCapacityHook(conns)
    warm_one = {c: SkyPilotCapacityHook([c]) for c in conns}

    failed: list[str] = []

    def timed(hook: SkyPilotCapacityHook) -> float:
        """One probe's seconds; a probe where a connection failed is noted and taken again
        (a failed connection answers sooner: it would flatter the time)."""
        for _ in range(3):
            start = time.perf_counter()
            result = hook.probe(task)
            elapsed = time.perf_counter() - start
            if not (result.errors or result.config_errors):
                return elapsed
            failed.extend(f"{c}: {e}" for c, e in result.errors.items())
        raise RuntimeError(f"probe failed 3 times: {failed[-3:]}")

    for hook in (warm_all, *warm_one.values()):
        timed(hook)  # connect once

    def singles(make) -> dict[str, float]:
        return {c: timed(make(c)) for c in conns}

    for label, all_hook, one_hook in (
        ("warm", lambda: warm_all, lambda c: warm_one[c]),
        ("cold", lambda: SkyPilotCapacityHook(conns), lambda c: SkyPilotCapacityHook([c])),
    ):
        got = interleaved(rounds, {"all": lambda h=all_hook: timed(h()),
                                   "each": lambda h=one_hook: singles(h)})
        slowest = [max(each.values()) for each in got["each"]]
        which = {c: sum(max(each, key=each.get) == c for each in got["each"]) for c in conns}
        per_conn = {c: spread([each[c] for each in got["each"]]).median for c in conns}
        r = spread(ratios(got["all"], slowest))
        summed = spread(ratios(got["all"], [sum(each.values()) for each in got["each"]]))
        ROWS.append((
            f"probe ({label}): all {len(conns)} connections at once / slowest single one",
            r.fmt(),
            f"all {spread(got['all']).median * 1e3:.0f} ms, slowest single "
            f"{spread(slowest).median * 1e3:.0f} ms (slowest: "
            + ", ".join(f"{c} {n}x" for c, n in which.items() if n)
            + "); singles: " + ", ".join(f"{c} {v * 1e3:.0f}" for c, v in per_conn.items())
            + f" ms; all / the singles' sum: {summed.fmt()}; probes taken again after a "
            f"connection failed: {len(failed)}" + (f" ({failed[0]})" if failed else "")))
        failed.clear()


# --- submit ----------------------------------------------------------------------------------

SUBMIT_CLUSTER = "alpha"


def _wait_marker(remote, path: str, timeout: float = 60) -> float:
    """The epoch the job wrote into ``path`` (waited for on the login node)."""
    rc, out, err = remote.run(
        f"for i in $(seq {int(timeout * 50)}); do [ -s {path} ] && cat {path} && exit 0; "
        f"sleep 0.02; done; exit 1", timeout + 10)
    if rc != 0:
        raise RuntimeError(f"{path} never written: {err}")
    return float(out.strip().splitlines()[0])


def bench_submit(rounds: int) -> None:
    from airflow_skypilot.backends.slurm import SlurmBackend
    from airflow_skypilot.spec import load_task

    use_sandbox()
    backend = SlurmBackend(f"slurm_{SUBMIT_CLUSTER}")
    remote = backend.remote
    _, home, _ = remote.run("echo $HOME")
    home = home.strip()
    bench_dir = f"{home}/bench-submit-{uuid.uuid4().hex[:8]}"
    remote.run(f"mkdir -p {bench_dir}")
    marker_run = 'date +%s.%N > "$MARKER"; sleep 60'
    task_spec = {"resources": {"infra": "slurm", "cpus": 1}, "envs": {"MARKER": None},
                 "run": marker_run}
    offer = next(o for o in backend.probe(load_task(task_spec, envs={"MARKER": "/x"}))
                 if o.fits and o.location == "batch")
    jobs: list[tuple[str, Any]] = []

    def ours() -> tuple[float, float]:
        marker = f"{bench_dir}/ours-{uuid.uuid4().hex[:8]}"
        task = load_task(task_spec, envs={"MARKER": marker})
        name = f"sky-bench-submit-{uuid.uuid4().hex[:10]}"
        start = time.time()
        handle = backend.submit(task, offer, name, {"SKYPILOT_TASK_ID": name,
                                                    "SKYPILOT_ATTEMPT": "1"})
        returned = time.time()
        jobs.append(("ours", handle))
        running = _wait_marker(remote, marker)
        backend.cancel(handle)
        return returned - start, running - start

    def raw() -> tuple[float, float]:
        marker = f"{bench_dir}/raw-{uuid.uuid4().hex[:8]}"
        start = time.time()
        rc, out, err = remote.run(
            f"sbatch --parsable -p batch -c 1 -J bench-raw -o {bench_dir}/%j.log "
            f"--wrap 'date +%s.%N > {marker}; sleep 60'")
        returned = time.time()
        if rc != 0:
            raise RuntimeError(err)
        job_id = out.strip().split(";")[0]
        jobs.append(("raw", job_id))
        running = _wait_marker(remote, marker)
        remote.run(f"scancel {job_id}")
        return returned - start, running - start

    try:
        raw(), ours()  # warm up: connections, first SFTP session
        got = interleaved(rounds, {"ours": ours, "raw": raw})
    finally:
        slurm_cmd(SUBMIT_CLUSTER, "scancel", "-u", "skyuser", check=False)
        remote.run(f"rm -rf {bench_dir}")
    ours_run = [r for _, r in got["ours"]]
    raw_run = [r for _, r in got["raw"]]
    ours_ret = [s for s, _ in got["ours"]]
    raw_ret = [s for s, _ in got["raw"]]
    ROWS.append(("submit-to-running: SlurmBackend.submit / raw sbatch over SSH",
                 spread(ratios(ours_run, raw_run)).fmt(),
                 f"submit to user code running: ours {spread(ours_run).median * 1e3:.0f} ms, "
                 f"raw {spread(raw_run).median * 1e3:.0f} ms; the submit call alone: "
                 f"{spread(ratios(ours_ret, raw_ret)).fmt()} ({spread(ours_ret).median * 1e3:.0f}"
                 f" vs {spread(raw_ret).median * 1e3:.0f} ms)"))


# --- failover --------------------------------------------------------------------------------

FAILOVER_TASK = """\
name: failover-bench
resources:
  infra: slurm
  cpus: 1
  job_recovery:
    strategy: EAGER_NEXT_REGION
envs:
  MARK: null
run: |
  if [ -e "$MARK" ]; then echo second copy; exit 0; fi
  touch "$MARK"
  sleep 300
"""


def _airflow():
    """``airflow dags test`` with the e2e DAGs against a throwaway SQLite home."""
    import tempfile

    from tests.e2e.conftest import Airflow

    home = Path(tempfile.mkdtemp(prefix="bench-airflow-"))
    af = Airflow(home)
    af.env["AIRFLOW__LOGGING__LOGGING_LEVEL"] = "WARNING"
    af.migrate()
    return af


def _slurm_jobs(prefix: str) -> list[tuple[str, str, str, str]]:
    """(cluster, job id, state, nodes) of every job named ``prefix``... on both clusters."""
    out = []
    for cluster in ("alpha", "beta"):
        lines = slurm_cmd(cluster, "squeue", "-h", "-t", "all", "-o", "%i|%j|%T|%N",
                          check=False).stdout.splitlines()
        for line in lines:
            job, name, state, nodes = line.split("|")
            if name.startswith(prefix):
                out.append((cluster, job, state, nodes))
    return out


def bench_failover(rounds: int) -> None:
    from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
    from airflow_skypilot.spec import load_task
    from tests.e2e.conftest import shared_dir

    conns = use_sandbox()
    slurm_conns = {c: conns[c] for c in ("slurm_alpha", "slurm_beta")}
    af = _airflow()
    af.connect(slurm_conns, list(slurm_conns))
    reactions: list[float] = []
    fresh: list[float] = []
    details: list[str] = []

    def failover() -> float:
        mark = f"{shared_dir()}/mark"
        running = af.start("e2e_task", {"task": FAILOVER_TASK, "envs": {"MARK": mark}})
        down = None
        try:
            deadline = time.time() + 90
            job = None
            while time.time() < deadline and job is None:
                found = [j for j in _slurm_jobs("sky-e2e-task-run") if j[2] == "RUNNING"]
                job = found[0] if found else None
                if running.poll() is not None:
                    raise RuntimeError(f"dags test ended early:\n{running.output()[-3000:]}")
                time.sleep(0.5)
            if job is None:
                raise RuntimeError(f"no job running:\n{running.output()[-3000:]}")
            cluster, job_id, _, node = job
            time.sleep(1)  # the trigger is watching it
            fault = time.time() - 1
            slurm_cmd(cluster, "scontrol", "update", f"NodeName={node}", "State=DOWN",
                      "Reason=benchmark", as_root=True)
            down = (cluster, node)
            if not running.wait(180):
                raise RuntimeError(f"dags test did not end:\n{running.output()[-3000:]}")
            killed = slurmctld_events(cluster, f"Killing JobId={job_id} ", fault)
            submits = sorted((t, c) for c in ("alpha", "beta")
                             for t, _ in slurmctld_events(c, "_slurm_rpc_submit_batch_job",
                                                          fault))
            if not killed or not submits:
                raise RuntimeError(f"no kill ({killed}) or no new submission ({submits})\n"
                                   + running.output()[-3000:])
            t0 = killed[0][0]
            t1, to = next((t, c) for t, c in submits if t >= t0)
            details.append(f"{cluster}/{node} -> {to}")
            return t1 - t0
        finally:
            if running.poll() is None:
                running.kill()
            if down is not None:
                slurm_cmd(down[0], "scontrol", "update", f"NodeName={down[1]}",
                          "State=RESUME", check=False, as_root=True)
            for cluster in ("alpha", "beta"):
                slurm_cmd(cluster, "scancel", "-u", "skyuser", check=False)
            time.sleep(2)

    def placement() -> float:
        """A fresh placement's probe + rank + submit, by the operator's own Placer."""
        from airflow_skypilot.placer import Placer
        from airflow_skypilot.runstate import RunState

        mark = f"{shared_dir()}/mark"
        task = load_task(FAILOVER_TASK, envs={"MARK": mark})
        key = f"sky-bench-fresh-{uuid.uuid4().hex[:8]}-"
        run = RunState(prefix=key, task_env_id=key + "t", try_number=1)
        placer = Placer(SkyPilotCapacityHook(list(slurm_conns)), "fastest", cooldown=600,
                        confirm_timeout=30, log=LOG)
        start = time.time()
        handle = placer.place(task, run)
        took = time.time() - start
        placer.hook.backend(handle.connection).cancel(handle)
        return took

    got = interleaved(rounds, {"failover": failover, "fresh": placement})
    reactions, fresh = got["failover"], got["fresh"]
    ROWS.append(("failover reaction: failure reported -> next job submitted / a fresh "
                 "placement (probe + rank + submit)",
                 spread(ratios(reactions, fresh)).fmt(),
                 f"reaction {spread(reactions).fmt('s')}; fresh placement "
                 f"{spread(fresh).fmt('s')}; poll_interval 1 s; "
                 f"rounds: {'; '.join(details)}"))


# --- sweep -----------------------------------------------------------------------------------

SWEEP_TASK = """\
name: sweep-bench
resources:
  accelerators: {A100: 1, H100: 1}
  cpus: 1
run: sleep 600
"""


#: the sweep's connections: not AWS (see the README: a cold AWS client costs each member
#: ~2 s of CPU in botocore, and 100 members in one process would wait on one GIL for it)
SWEEP_CONNECTIONS = ("slurm_alpha", "slurm_beta", "k8s_sandbox")


def bench_sweep(rounds: int, members: int = 100, slots: int = 16) -> None:
    from airflow_skypilot import identity
    from airflow_skypilot.hooks.capacity import SkyPilotCapacityHook
    from airflow_skypilot.placer import Placer
    from airflow_skypilot.runstate import RunState
    from airflow_skypilot.spec import load_task

    use_sandbox()
    conns = list(SWEEP_CONNECTIONS)
    # the placement ledger as the operator uses it (one file for the workers of a machine)
    from airflow_skypilot.ledger import PlacementLedger

    ledger_file = os.path.join(tempfile.mkdtemp(prefix="bench-ledger-"), "placements.json")

    def place_one(run_id: str, map_index: int, out: dict[int, tuple[float, float, str]],
                  gate: threading.Event | None) -> None:
        if gate is not None:
            gate.wait()
        start = time.time()
        task = load_task(SWEEP_TASK)
        key = identity.TaskKey("bench_sweep", "train", run_id, map_index, "bench")
        run = RunState(prefix=key.prefix, task_env_id=key.skypilot_task_id, try_number=1)
        placer = Placer(SkyPilotCapacityHook(conns), "fastest", cooldown=600,
                        confirm_timeout=30, log=LOG, ledger=PlacementLedger(ledger_file))
        placer.reconcile(run, start)
        handle = placer.place(task, run)
        out[map_index] = (start, time.time(), handle.connection if handle else "none")
        for backend in placer.hook._backends.values():
            close = getattr(backend, "close", None)
            if close:
                close()

    placed: dict[str, list[str]] = {"single": [], "sweep": []}

    def single() -> float:
        """One task placed alone (the median of three, one after the other)."""
        took = []
        for _ in range(3):
            out: dict[int, tuple[float, float, str]] = {}
            place_one(f"single_{uuid.uuid4().hex[:8]}", -1, out, None)
            _clean_all()
            start, end, where = out[-1]
            placed["single"].append(where)
            took.append(end - start)
        return statistics_median(took)

    def sweep() -> list[float]:
        """``members`` mapped tasks, at most ``slots`` placing at a time (Airflow's default
        ``max_active_tasks_per_dag``), the next starting as one ends."""
        out: dict[int, tuple[float, float, str]] = {}
        run_id = f"sweep_{uuid.uuid4().hex[:8]}"
        t0 = time.time()
        with ThreadPoolExecutor(slots) as pool:
            list(pool.map(lambda i: place_one(run_id, i, out, None), range(members)))
        _clean_all()
        if len(out) != members:
            raise RuntimeError(f"only {len(out)} of {members} members placed")
        placed["sweep"].extend(w for _, _, w in out.values())
        lat = sorted(end - start for start, end, _ in out.values())
        makespan = max(end for _, end, _ in out.values()) - t0
        return [statistics_median(lat), lat[int(0.95 * (len(lat) - 1))], makespan]

    got = interleaved(rounds, {"single": single, "sweep": sweep})
    single_s = got["single"]
    med = [m for m, _, _ in got["sweep"]]
    p95 = [p for _, p, _ in got["sweep"]]
    span = [s for _, _, s in got["sweep"]]
    where = {w: placed["sweep"].count(w) for w in sorted(set(placed["sweep"]))}
    ROWS.append((f"sweep placement: median member of {members} mapped tasks ({slots} at a "
                 f"time, {len(conns)} connections) / one task placed alone",
                 spread(ratios(med, single_s)).fmt(),
                 f"alone {spread(single_s).fmt('s')}; member median {spread(med).fmt('s')}, "
                 f"p95 {spread(p95).fmt('s')}; the whole sweep placed in "
                 f"{spread(span).fmt('s')} ({spread(ratios(span, single_s)).fmt()} one alone); "
                 f"placed on: " + ", ".join(f"{k} {v}" for k, v in where.items())))


def statistics_median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def _clean_all() -> None:
    """Cancel every sandbox job the benchmark left (Slurm; Kubernetes and AWS by their
    sandbox's reset)."""
    for cluster in ("alpha", "beta"):
        slurm_cmd(cluster, "scancel", "-u", "skyuser", check=False)
    from tests.sandbox.__main__ import sandbox

    for name in ("kubernetes", "aws"):
        box = sandbox(name)
        if box.is_up():
            box.reset()


BENCHES = {"probe": bench_probe, "submit": bench_submit, "failover": bench_failover,
           "sweep": bench_sweep}
DEFAULT_ROUNDS = {"probe": 25, "submit": 16, "failover": 5, "sweep": 5}


def run(names: list[str], rounds: int | None = None, members: int = 100
        ) -> list[tuple[str, str, str]]:
    _quiet()
    for name in names:
        done = len(ROWS)
        if name == "sweep":
            bench_sweep(rounds or DEFAULT_ROUNDS[name], members)
        else:
            BENCHES[name](rounds or DEFAULT_ROUNDS[name])
        for row in ROWS[done:]:
            print("row: " + " | ".join(row), flush=True)
    return ROWS


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", default=list(BENCHES), choices=list(BENCHES))
    parser.add_argument("--rounds", type=int, help="rounds per benchmark (default: per name)")
    parser.add_argument("--members", type=int, default=100, help="sweep size")
    args = parser.parse_args()
    print(f"machine: {Machine().line()}", flush=True)
    run(args.names, args.rounds, args.members)
    print("| benchmark | ratio: median (range, rounds) | what was measured |\n|---|---|---|")
    for name, result, spread_ in ROWS:
        print(f"| {name} | {result} | {spread_} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
