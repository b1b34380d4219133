"""``make demo``: the example pipeline on the sandbox, with a failure under the training job.

Runs ``airflow dags test train_pipeline`` (real Airflow, SQLite) against every sandbox that is
up. When the training job is running, it kills what it runs on: the node's slurmd on Slurm,
the pod's node on Kubernetes, a spot interruption on AWS. The operator places the job again
elsewhere; training resumes from its checkpoint (same SKYPILOT_TASK_ID). At the end it prints
each step's placement and the result.

``python -m tests.sandbox.demo --sandbox`` (``make demo``) also starts the sandboxes first and
stops them when it ends, whatever ends it: the demo's own end, an error, Ctrl-C or SIGTERM (a
signal stops the demo's ``airflow dags test`` too). Without ``--sandbox`` it runs on sandboxes
already up and leaves them up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.sandbox import __main__ as sandboxes
from tests.sandbox.__main__ import DEFAULT_CONNECTIONS, REPO, STATE, connections, sandbox

HOME = STATE / "airflow-home"
AIRFLOW = str(Path(sys.executable).parent / "airflow")
_STAMP = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z \[\w+\s*\] ")
_SUFFIX = re.compile(r"\s+\[[\w.]+\]\s+loc=\S+$")


def say(text: str = "") -> None:
    print(text, flush=True)


def airflow_env(conns: dict[str, dict]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__SKYPILOT__CONNECTIONS": ",".join(c for c in DEFAULT_CONNECTIONS if c in conns),
        "PYTHONPATH": str(REPO),
    })
    for conn_id, conn in conns.items():
        env[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(conn)
    return env


def latest_run(db: Path) -> str | None:
    with sqlite3.connect(db) as con:
        row = con.execute("SELECT run_id FROM dag_run WHERE dag_id='train_pipeline' "
                          "ORDER BY id DESC LIMIT 1").fetchone()
    return row[0] if row else None


def xcoms(db: Path, run_id: str) -> dict[tuple[str, str], object]:
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT task_id, key, value FROM xcom WHERE dag_id='train_pipeline' "
                           "AND run_id=?", (run_id,)).fetchall()
    return {(t, k): json.loads(v) for t, k, v in rows}


class Narrator:
    """Prints the parts of the Airflow output a person wants to see, without log noise."""

    KEEP = ("Placement (policy", "Submitted ", "Adopting", "ended:", "moving elsewhere",
            "same place first", "restart", "skipped for this placement", "failed:", "gave up",
            "Nothing can take", "DagRun Finished", "resuming", "epoch", "eval:", "wrote ")

    TABLE_ROWS = 10  # the full table is in the task log, XCom and the UI

    def __init__(self):
        self.in_table = False
        self.table_rows = 0
        self.lines: list[str] = []

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        self.lines.append(line)
        stamped = bool(_STAMP.match(line))
        if self.in_table and not stamped:
            if line.startswith("placed on") or line.startswith("no placement"):
                say(f"    {_SUFFIX.sub('', line)}")
                return
            self.table_rows += 1
            if self.table_rows <= self.TABLE_ROWS + 2:
                say(f"    {line}")
            elif self.table_rows == self.TABLE_ROWS + 3:
                say("    ... (the whole table: task log, XCom skypilot_placement, the UI)")
            return
        self.in_table = False
        self.table_rows = 0
        text = _SUFFIX.sub("", _STAMP.sub("", line))
        if "Placement (policy" in text:
            self.in_table = True
            say(f"  {text}")
        elif any(k in text for k in self.KEEP) and "[DAG TEST]" not in text:
            if "Submitted slurm job" in text or "Submitted kubernetes job" in text \
                    or "Submitted aws job" in text:
                return  # the backend's own line says the same
            epoch = re.search(r"epoch (\d+)/", text)
            if epoch and int(epoch.group(1)) > 2 and int(epoch.group(1)) % 10:
                return  # a few epochs tell the story
            if "DagRun Finished" in text:
                state = re.search(r"state=(\w+)", text)
                duration = re.search(r"run_duration=([\d.]+)", text)
                text = (f"DagRun finished: {state.group(1) if state else '?'} in "
                        f"{float(duration.group(1)) if duration else 0:.0f}s")
            say(f"  {text[:160]}")


def inject_failure(handle: dict) -> str:
    """Break what the job runs on, the way the real world does."""
    backend = handle["backend"]
    if backend == "slurm":
        box = sandbox("slurm")
        cluster = handle["infra"].split("/")[1]
        out = box.run(cluster, "squeue", "-h", "-j", handle["job_id"], "-o", "%N").stdout.strip()
        node = out.split(",")[0]
        box.kill_slurmd(node)
        return f"killed slurmd on node {node} of cluster {cluster} (Slurm will see NODE_FAIL)"
    if backend == "kubernetes":
        box = sandbox("kubernetes")
        namespace = handle["extra"].get("namespace", "default")
        pods = [p for p in box.processes() if p.get("namespace") == namespace
                and p.get("pod", "").startswith(handle["job_name"])]
        node = pods[0]["node"] if pods else None
        if node:
            box.fail_node(node)
            return f"took Kubernetes node {node} down under pod {pods[0]['pod']}"
        return "no pod found to fail"
    if backend == "aws":
        box = sandbox("aws")
        ids = handle["extra"].get("instance_ids") or []
        spot = {i["instance_id"] for i in box.instances() if i.get("lifecycle") == "spot"}
        if ids and set(ids) <= spot:
            for instance_id in ids:
                box.interrupt_spot(instance_id, notice_seconds=2)
            return f"interrupted spot instance(s) {', '.join(ids)} (capacity reclaimed)"
        import boto3

        region = handle["location"].split("/")[0]
        ec2 = boto3.client("ec2", region_name=region, endpoint_url=box.endpoint_url(),
                           aws_access_key_id="x", aws_secret_access_key="x")
        ec2.terminate_instances(InstanceIds=ids)
        return f"terminated instance(s) {', '.join(ids)} under the job (host failure)"
    return f"no fault for backend {backend}"


def restore(handle: dict) -> None:
    if handle["backend"] == "slurm":
        box = sandbox("slurm")
        box.reset()
    elif handle["backend"] == "kubernetes":
        sandbox("kubernetes").reset()


def run() -> int:
    conns = connections()
    if not conns:
        say("no sandbox is up: run `make demo` (or `python -m tests.sandbox up`) first")
        return 1
    env = airflow_env(conns)
    for name in ("slurm", "kubernetes", "aws"):  # a clean start: no jobs, every node up
        box = sandbox(name)
        if box.is_up():
            box.reset()
    HOME.mkdir(parents=True, exist_ok=True)
    db = HOME / "airflow.db"
    # Every time, not only for a new database: after an Airflow upgrade (or a migration cut
    # short) the schema would be stale. Up to date, it is a quick no-op.
    say("== preparing Airflow (airflow db migrate: SQLite metadata DB)")
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True)
    say(f"== connections: {env['AIRFLOW__SKYPILOT__CONNECTIONS']}")
    say("== live GPU capacity (airflow-skypilot show-gpus)")
    cli = str(Path(sys.executable).parent / "airflow-skypilot")
    ids = env["AIRFLOW__SKYPILOT__CONNECTIONS"].split(",")
    subprocess.run([cli, "show-gpus", *[a for c in ids for a in ("--conn", c)]], env=env,
                   check=False, stderr=subprocess.DEVNULL)
    say()
    say("== airflow dags test train_pipeline  (preprocess -> train -> evaluate)")
    before = latest_run(db)
    proc = subprocess.Popen([AIRFLOW, "dags", "test", "train_pipeline", "-c",
                             json.dumps({"epochs": 40})], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        return _follow(proc, db, before)
    finally:
        _stop(proc)  # interrupted (Ctrl-C, SIGTERM, an error): not left running on its own


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _follow(proc: subprocess.Popen, db: Path, before: str | None) -> int:
    narrator = Narrator()
    reader = threading.Thread(target=lambda: [narrator.feed(ln) for ln in proc.stdout],
                              daemon=True)
    reader.start()
    handle = None
    injected = False
    deadline = time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
        if injected:
            continue
        run_id = latest_run(db)
        if run_id in (None, before):
            continue
        found = xcoms(db, run_id).get(("train", "skypilot_handle"))
        epochs = sum(1 for ln in narrator.lines if "epoch " in ln and "/40" in ln)
        if found and epochs >= 3:
            handle = found
            say("")
            say(f"== !! {inject_failure(handle)}")
            say("")
            injected = True
    if proc.poll() is None:
        proc.kill()
    reader.join(10)
    rc = proc.wait()
    run_id = latest_run(db)
    if handle:
        restore(handle)
    say()
    if run_id and run_id != before:
        values = xcoms(db, run_id)
        say("== result")
        for step in ("preprocess", "train", "evaluate"):
            result = values.get((step, "return_value"))
            if not result:
                say(f"  {step:10s} (no result)")
                continue
            say(f"  {step:10s} {result['connection']}/{result['location']}  job "
                f"{result['job_id']}  attempts: {len(result['attempts'])}  "
                f"gpu-hours: {result['gpu_hours']:.4f}  cost: ${result['cost']:.4f}")
            if len(result["attempts"]) > 1:
                for i, a in enumerate(result["attempts"], 1):
                    say(f"      attempt {i}: {a['connection']}/{a['location']} job "
                        f"{a['job_id']}: {a['state']} {a.get('reason') or ''}")
    say(f"== train_pipeline {'succeeded' if rc == 0 else 'FAILED'}")
    if rc != 0:
        say("\n".join(narrator.lines[-60:]))
    return rc


def _interrupted(signum: int, frame: object) -> None:
    # SIGTERM (`kill`, make passing its SIGTERM on) unwinds like Ctrl-C: the `finally`s stop
    # `airflow dags test` and the sandboxes; the exit status says which signal.
    raise SystemExit(128 + signum)


def _sandbox_down() -> int:
    """Stop the sandboxes; a second Ctrl-C or SIGTERM does not cut that short."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    say("== stopping the sandbox")
    return sandboxes.main(["down"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sandbox.demo")
    parser.add_argument("--sandbox", action="store_true",
                        help="start the sandboxes first and stop them at the end, whatever ends "
                             "the demo (as `make demo` does)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    if not args.sandbox:
        return run()
    rc = 1
    try:
        # `up` reuses sandboxes that are already healthy; as `make demo` always has, the demo
        # stops them at the end either way.
        rc = sandboxes.main(["up"])
        if rc == 0:
            rc = run()
    except KeyboardInterrupt:
        say("\n== interrupted")
        rc = 128 + signal.SIGINT
    finally:
        down_rc = _sandbox_down()
    return rc if rc != 0 else down_rc


if __name__ == "__main__":
    sys.exit(main())
