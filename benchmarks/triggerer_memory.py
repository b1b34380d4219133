"""Triggerer memory: RSS of the real ``airflow triggerer`` with N deferred SkyPilot tasks.

``python benchmarks/triggerer_memory.py [--counts 100,1000] [--rounds 2]`` (sandbox up).

What runs: the real Airflow 3 triggerer (``airflow triggerer``, its supervisor and the trigger
runner subprocess it starts) on a throwaway SQLite home. Nothing schedules tasks: the benchmark
writes N deferred task instances of a mapped SkyPilot task (``benchmarks/dags``) and their
trigger rows straight into the metadata DB, as a worker's deferral would leave them:

- ``skypilot``: each a :class:`SkyPilotJobTrigger` serialized as the operator defers (its handle,
  a run state with one attempt, the operator's default poll interval 10 s, streamed logs; no
  rebalancing looks) for a real Slurm job of its own on the sandbox (half on each cluster;
  ``sleep`` jobs, submitted with ``sbatch`` in one SSH command, each with its own job dir and
  ``slurm.log`` as the backend lays them out; those that do not fit wait in the queue);
- ``datetime``: each Airflow's own ``DateTimeTrigger`` for a moment a year away: the baseline
  of a trivial trigger;
- ``none``: the same triggerer with no trigger.

Each variant is a fresh triggerer on a fresh copy of the DB; once every trigger is assigned to
it, the benchmark waits two poll intervals (the SkyPilot triggers' pollers have asked both
clusters) and reads VmRSS of both processes from /proc (median of 5 readings 1 s apart).
Variants run interleaved (reversed every other round). Ratios: SkyPilot / DateTime triggerer
RSS at the same N, and the per-trigger increments over the empty triggerer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from common import Machine, ratios, spread, use_sandbox  # noqa: E402

AIRFLOW = str(Path(sys.executable).parent / "airflow")
DAG_ID = "bench_triggerer"
POLL_INTERVAL = 10.0  # the operator's default
RUN_ID = "bench_triggerer_run"


# --- the Airflow home ------------------------------------------------------------------------

def airflow_env(home: Path, db: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(home),
        "PYTHONPATH": str(REPO),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{db}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(HERE / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__CORE__FERNET_KEY": "tK3mfK0Dyl6Ga4qHrCFLkQ6nFjMR-QdNZ6LQ-Oe1oVY=",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "AIRFLOW__TRIGGERER__CAPACITY": "2000",
    })
    # the SkyPilot triggers find the sandbox's connections as env vars (as in the e2e tests)
    env.update({k: v for k, v in os.environ.items() if k.startswith("AIRFLOW_CONN_")})
    return env


def prepare_home(home: Path) -> Path:
    """Migrate a DB and serialize the benchmark DAG; the base DB's path."""
    db = home / "base.db"
    env = airflow_env(home, db)
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True,
                   timeout=300)
    subprocess.run([AIRFLOW, "dags", "reserialize"], env=env, check=True, capture_output=True,
                   timeout=300)
    return db


# --- real Slurm jobs for the SkyPilot triggers -------------------------------------------------

def submit_jobs(count: int) -> list[dict]:
    """``count`` sleeping Slurm jobs (half per cluster), each with a job dir and ``slurm.log``
    as the backend makes them; their JobHandles as dicts."""
    from airflow_skypilot.backends.base import JobHandle
    from airflow_skypilot.backends.slurm import SlurmBackend

    per_conn: list[list[dict]] = []
    for n, conn in enumerate(("slurm_alpha", "slurm_beta")):
        handles: list[dict] = []
        per_conn.append(handles)
        share = count // 2 + (count % 2 if n == 0 else 0)
        backend = SlurmBackend(conn)
        _, home, _ = backend.remote.run("echo $HOME")
        base = f"{home.strip()}/bench-triggerer"
        script = "\n".join([
            f"mkdir -p {base}",
            f"for i in $(seq 1 {share}); do",
            f"  d={base}/{conn}-$i; mkdir -p $d",
            "  j=$(sbatch --parsable -c 1 --mem=20M -J sky-bench-triggerer-$i "
            "-o $d/slurm.log --chdir=$d --no-requeue "
            "--wrap 'echo started on $(hostname); sleep 3600') || exit 1",
            '  echo "$i|${j%%;*}|$d"',
            "done",
        ])
        rc, out, err = backend.remote.run(script, 600)
        if rc != 0:
            raise RuntimeError(f"sbatch on {conn} failed: {err[-500:]}")
        for line in out.splitlines():
            i, job_id, job_dir = line.split("|")
            handles.append(JobHandle(
                backend="slurm", connection=conn, job_id=job_id,
                job_name=f"sky-bench-triggerer-{i}", location="batch" if n == 0 else "main",
                infra=f"slurm/{backend.settings.cluster or conn}",
                extra={"job_dir": job_dir, "log": f"{job_dir}/slurm.log"},
            ).to_dict())
        backend.close()
    alpha, beta = per_conn  # alternate: any first N are spread over both clusters
    return [h for pair in zip(alpha, beta, strict=False) for h in pair] + alpha[len(beta):]


def cancel_jobs() -> None:
    """Cancel every job this benchmark submitted (by id: ``scancel --name`` takes one name)."""
    from common import slurm_cmd

    for cluster in ("alpha", "beta"):
        out = slurm_cmd(cluster, "squeue", "-h", "-u", "skyuser", "-o", "%i|%j",
                        check=False).stdout
        ids = [i for i, _, name in (line.partition("|") for line in out.splitlines())
               if name.startswith("sky-bench-triggerer-")]
        for start in range(0, len(ids), 200):
            slurm_cmd(cluster, "scancel", *ids[start:start + 200], check=False)
        slurm_cmd(cluster, "bash", "-c", "rm -rf $HOME/bench-triggerer", check=False)


# --- writing deferred task instances (runs in a child with the Airflow env) -------------------

def populate(kind: str, count: int, handles_file: str) -> None:
    """Write ``count`` deferred task instances of ``watch`` and their triggers (``kind``)."""
    from datetime import timedelta

    from airflow.models.dag_version import DagVersion
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.trigger import Trigger
    from airflow.utils import timezone
    from airflow.utils.session import create_session
    from airflow.utils.state import DagRunState, TaskInstanceState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType

    handles = json.loads(Path(handles_file).read_text()) if kind == "skypilot" else []
    with create_session() as session:
        dag = SerializedDagModel.get_dag(DAG_ID, session=session)
        version = DagVersion.get_latest_version(DAG_ID, session=session)
        now = timezone.utcnow()
        dr = dag.create_dagrun(run_id=RUN_ID, run_after=now, run_type=DagRunType.MANUAL,
                               triggered_by=DagRunTriggeredByType.TEST,
                               state=DagRunState.RUNNING, start_date=now, session=session)
        session.flush()
        for ti in dr.get_task_instances(session=session):
            session.delete(ti)
        session.flush()
        task = dag.get_task("watch")
        for i in range(count):
            trigger = _trigger(kind, i, handles, now + timedelta(days=365))
            row = Trigger.from_object(trigger)
            session.add(row)
            session.flush()
            ti = TaskInstance(task=task, run_id=dr.run_id, map_index=i,
                              dag_version_id=version.id)
            ti.state = TaskInstanceState.DEFERRED
            ti.try_number = 1
            ti.start_date = now
            ti.trigger_id = row.id
            ti.next_method = "execute_complete"
            ti.next_kwargs = {}
            session.add(ti)
        session.commit()


def _trigger(kind: str, i: int, handles: list[dict], moment):
    if kind == "datetime":
        from airflow.providers.standard.triggers.temporal import DateTimeTrigger

        return DateTimeTrigger(moment=moment)
    from airflow_skypilot import identity
    from airflow_skypilot.backends.base import JobHandle
    from airflow_skypilot.runstate import RunState
    from airflow_skypilot.triggers.skypilot import SkyPilotJobTrigger

    handle = handles[i]
    key = identity.TaskKey(DAG_ID, "watch", RUN_ID, i, "bench")
    run = RunState(prefix=key.prefix, task_env_id=key.skypilot_task_id, try_number=1)
    run.record(JobHandle.from_dict(handle))
    return SkyPilotJobTrigger(handle, poll_interval=POLL_INTERVAL, unreachable_timeout=300,
                              state=run.to_dict(), reconsider=None)


# --- measuring -----------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


def _kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(home: Path, base: Path, variant: str, count: int) -> dict[str, float]:
    """Start a triggerer on a copy of the variant's DB; its memory once it runs every trigger."""
    db = home / "run.db"
    shutil.rmtree(home / "logs", ignore_errors=True)
    shutil.copy(home / f"{variant}-{count}.db" if variant != "none" else base, db)
    env = airflow_env(home, db)
    log_path = home / f"triggerer-{variant}-{count}-{time.time():.0f}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([AIRFLOW, "triggerer", "--skip-serve-logs"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"triggerer exited:\n{log_path.read_text()[-3000:]}")
            con = sqlite3.connect(db, timeout=30)
            try:
                assigned = con.execute("SELECT count(*) FROM trigger WHERE triggerer_id IS NOT "
                                       "NULL").fetchone()[0]
                jobs = con.execute("SELECT count(*) FROM job WHERE job_type='TriggererJob' "
                                   "AND state='running'").fetchone()[0]
            finally:
                con.close()
            if assigned >= count and jobs:
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"{variant}-{count}: only {assigned} triggers assigned")
        time.sleep(2 * POLL_INTERVAL + 5)
        if proc.poll() is not None:
            raise RuntimeError("triggerer exited")
        sup, runner = [], []
        for _ in range(5):
            kids = [k for k in _children(proc.pid)]
            sup.append(_kib(proc.pid))
            runner.append(sum(_kib(k) for k in kids))
            time.sleep(1)
        kids = _children(proc.pid)
        pss = _pss(proc.pid) + sum(_pss(k) for k in kids)
        fired = _fired(db)
        streamed, silent = _trigger_logs(home)
        blocked = _blocked(log_path)
        return {"streamed": streamed, "no_answer": silent, "blocked_max_s": max(blocked, default=0),
                "blocked_n": len(blocked),
                "supervisor": spread(sup).median / 1024, "runner": spread(runner).median / 1024,
                "total": (spread(sup).median + spread(runner).median) / 1024,
                "pss": pss / 1024, "children": len(kids), "fired": fired}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def _trigger_logs(home: Path) -> tuple[int, int]:
    """Trigger logs that show a job's output (the poller read it over SSH), and those that
    warn of a poll without an answer."""
    streamed = silent = 0
    for path in (home / "logs").rglob("*.log.trigger.*.log"):
        text = path.read_text(errors="replace")
        streamed += "started on" in text
        silent += "No answer about job" in text
    return streamed, silent


def _blocked(log: Path) -> list[float]:
    """Seconds of every "async thread was blocked" warning of the triggerer so far."""
    import re

    return [float(m) for m in re.findall(r"async thread was blocked for ([0-9.]+) seconds",
                                         log.read_text(errors="replace"))]


def _fired(db: Path) -> int:
    """Task instances whose trigger fired (no longer deferred): should be none."""
    con = sqlite3.connect(db, timeout=30)
    try:
        return con.execute("SELECT count(*) FROM task_instance WHERE state != 'deferred'"
                           ).fetchone()[0]
    finally:
        con.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", default="100,1000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--populate", nargs=3, metavar=("KIND", "COUNT", "HANDLES"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.populate:
        populate(args.populate[0], int(args.populate[1]), args.populate[2])
        return 0
    run([int(c) for c in args.counts.split(",")], args.rounds)
    return 0


def run(counts: list[int], rounds: int) -> list[tuple[str, str, str]]:
    """Measure every variant ``rounds`` times; print the tables; rows for ``run.py``."""
    print(f"machine: {Machine().line()}", flush=True)
    use_sandbox(("slurm_alpha", "slurm_beta"))
    home = Path(tempfile.mkdtemp(prefix="bench-triggerer-"))
    started = time.time()
    base = prepare_home(home)
    cancel_jobs()
    handles = submit_jobs(max(counts))
    handles_file = home / "handles.json"
    handles_file.write_text(json.dumps(handles))
    print(f"home {home}; {len(handles)} Slurm jobs submitted "
          f"({time.time() - started:.0f}s)", flush=True)
    try:
        for kind in ("datetime", "skypilot"):
            for count in counts:
                db = home / f"{kind}-{count}.db"
                shutil.copy(base, db)
                env = airflow_env(home, db)
                subprocess.run([sys.executable, __file__, "--populate", kind, str(count),
                                str(handles_file)], env=env, check=True, timeout=600)
        variants = [("none", 0)] + [(k, c) for c in counts for k in ("datetime", "skypilot")]
        results: dict[tuple[str, int], list[dict]] = {v: [] for v in variants}
        for r in range(rounds):
            for variant, count in variants if r % 2 == 0 else variants[::-1]:
                got = measure(home, base, variant, count)
                results[(variant, count)].append(got)
                print(f"round {r} {variant} {count}: " + json.dumps(
                    {k: round(v, 1) for k, v in got.items()}), flush=True)
    finally:
        cancel_jobs()
    return report(results, counts)


def report(results: dict[tuple[str, int], list[dict]], counts: list[int]
           ) -> list[tuple[str, str, str]]:
    def series(variant: str, count: int, key: str) -> list[float]:
        return [m[key] for m in results[(variant, count)]]

    print("\n| triggerer | runner RSS MiB | supervisor RSS MiB | RSS total MiB | PSS total MiB |"
          "\n|---|---|---|---|---|")
    for (variant, count), _ in results.items():
        cells = [spread(series(variant, count, k)).fmt("", 0)
                 for k in ("runner", "supervisor", "total", "pss")]
        print(f"| {variant} x {count} | " + " | ".join(cells) + " |")
    print("\n| ratio | median (range, rounds) |\n|---|---|")
    base = series("none", 0, "total")
    rows = []
    for count in counts:
        sky = series("skypilot", count, "total")
        dt = series("datetime", count, "total")
        rows.append((f"triggerer memory: RSS with {count} deferred SkyPilot tasks / with "
                     f"{count} DateTimeTriggers", spread(ratios(sky, dt)).fmt(),
                     f"SkyPilot {spread(sky).fmt(' MiB', 0)}, DateTime "
                     f"{spread(dt).fmt(' MiB', 0)}, no trigger {spread(base).fmt(' MiB', 0)} "
                     "(supervisor + trigger runner)"))
        print(f"| RSS total, {count} SkyPilot / {count} DateTime triggers | "
              f"{spread(ratios(sky, dt)).fmt()} |")
        print(f"| RSS total, {count} SkyPilot triggers / empty triggerer | "
              f"{spread(ratios(sky, base)).fmt()} |")
        inc_sky = [(s - b) * 1024 / count for s, b in zip(sky, base, strict=True)]
        inc_dt = [(d - b) * 1024 / count for d, b in zip(dt, base, strict=True)]
        print(f"| KiB per trigger over the empty triggerer, {count}: SkyPilot | "
              f"{spread(inc_sky).fmt(' KiB', 0)} |")
        print(f"| KiB per trigger over the empty triggerer, {count}: DateTime | "
              f"{spread(inc_dt).fmt(' KiB', 0)} |")
    if len(counts) > 1:
        lo, hi = min(counts), max(counts)
        for kind in ("skypilot", "datetime"):
            slope = [(b - a) * 1024 / (hi - lo) for a, b in zip(
                series(kind, lo, "total"), series(kind, hi, "total"), strict=True)]
            print(f"| KiB per trigger from {lo} to {hi} (marginal): {kind} | "
                  f"{spread(slope).fmt(' KiB', 0)} |")
    fired = sum(m["fired"] for v in results.values() for m in v)
    print(f"\ntask instances no longer deferred at the readings (triggers fired): {fired}")
    for (variant, count), runs in results.items():
        if variant == "skypilot":
            print(f"skypilot x {count}: trigger logs with a running job's output "
                  f"{[m['streamed'] for m in runs]}, with a poll not answered "
                  f"{[m['no_answer'] for m in runs]}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
