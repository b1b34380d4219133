"""Speed and scale of the parts that grow with users: ``python benchmarks/run.py [--quick]
[NAME ...]``.

Without names it runs the in-process benchmarks below (spec ... scheduling). Named entries
that need the sandbox (``python -m tests.sandbox up``) run only when asked for, each a ratio
measured side by side in one run (``benchmarks/backends.py``,
``benchmarks/triggerer_memory.py``):

- probe: all sandbox connections probed at once vs the slowest single one;
- submit: submit-to-running of ``SlurmBackend.submit`` vs a raw ``sbatch`` over SSH;
- failover: the real operator's reaction to a node failure (failure reported -> next job
  submitted) vs a fresh placement;
- sweep: placement latency of 100 mapped tasks placing at once vs one alone;
- triggerer-memory: RSS of the real ``airflow triggerer`` with 100 and 1000 deferred SkyPilot
  tasks vs as many DateTimeTriggers and vs none.

In-process (the default):

- spec: loading and validating a realistic task YAML (the operator does it on every resume);
- placement: ranking offers from many connections and candidates;
- slurm-parse: parsing a big cluster's probe output (thousands of nodes);
- poller: one triggerer watching thousands of jobs across connections: requests per interval
  (must stay one status + one log request per connection) and the loop's own CPU time;
- slurm-probe (only when the sandbox is up): a real probe round trip over SSH;
- scheduling: a burst of GPU jobs over loaded clusters, placed by the real placement code in a
  simulator (``benchmarks/scheduling.py``; run it alone for the full tables): mean wait against
  SkyPilot's rule and one cluster.

Results go to stdout as a Markdown table; benchmarks/README.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airflow_skypilot import placement  # noqa: E402
from airflow_skypilot.backends import registry  # noqa: E402
from airflow_skypilot.backends.base import JobHandle, JobState, JobStatus  # noqa: E402
from airflow_skypilot.backends.slurm import offers as slurm_offers  # noqa: E402
from airflow_skypilot.backends.slurm.cluster import parse_cluster  # noqa: E402
from airflow_skypilot.backends.slurm.settings import SlurmSettings  # noqa: E402
from airflow_skypilot.spec import load_task  # noqa: E402
from tests.fakes import FakeBackend, offer  # noqa: E402

ROWS: list[tuple[str, str, str]] = []


def timeit(fn, repeat: int) -> tuple[float, float]:
    """(median, p95) seconds per call."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))]


def bench_spec(quick: bool) -> None:
    path = REPO / "dags" / "tasks" / "train.yaml"
    med, p95 = timeit(lambda: load_task(str(path), envs={"DATA_DIR": "/d", "CKPT_DIR": "/c"}),
                      50 if quick else 300)
    ROWS.append(("spec: load + validate train.yaml", f"{med * 1e3:.2f} ms",
                 f"p95 {p95 * 1e3:.2f} ms"))
    big = {"resources": {"any_of": [{"accelerators": f"{a}:{n}", "infra": i}
                                    for a in ("A100", "H100", "L4", "A10G")
                                    for n in (1, 2, 4, 8)
                                    for i in ("slurm", "k8s", "aws")]}, "run": "x"}
    med, p95 = timeit(lambda: load_task(big), 20 if quick else 100)
    ROWS.append(("spec: 48 any_of candidates", f"{med * 1e3:.2f} ms", f"p95 {p95 * 1e3:.2f} ms"))


def bench_placement(quick: bool) -> None:
    rnd = random.Random(1)
    for n in (100, 1000, 10000):
        offers = [offer(f"c{i % 20}", f"p{i}", gpus_free=rnd.randint(0, 8),
                        nodes_free=rnd.randint(0, 2), est_in=rnd.choice([None, 60, 3600]),
                        price=rnd.choice([0, 1.2, 32.8]), index=i % 4,
                        fits=rnd.random() > 0.2, reason="no fit")
                  for i in range(n)]
        blocked = [placement.Blocked(f"c{i}/p{i}", "node failure") for i in range(20)]
        med, p95 = timeit(lambda o=offers, b=blocked: placement.rank(o, blocked=b).table(),
                          5 if quick else 20)
        ROWS.append((f"placement: rank + table, {n} offers", f"{med * 1e3:.1f} ms",
                     f"p95 {p95 * 1e3:.1f} ms"))


def _tres(nodes: int) -> str:
    """The last fields of the probe's squeue -O line of a job of ``nodes`` nodes with 8 GPUs,
    8 CPUs and 64000M on each: no GPUs per job or task, its tasks, what it asks in all."""
    return f"N/A|N/A|{nodes}|cpu={8 * nodes},mem={64000 * nodes}M,node={nodes}|"


def bench_slurm_parse(quick: bool) -> None:
    nodes = 500 if quick else 4000
    lines = ["@@now", "1795988258", "@@home", "/home/u", "@@nodes"]
    for i in range(nodes):
        for part in ("batch", "gpu") if i % 2 else ("batch",):
            lines.append(f"n{i}|{part}|mixed|8/56/0/64|512000|64000|gpu:a100:8(S:0-1)|"
                         f"gpu:a100:3(IDX:0-2)|10.0.{i // 250}.{i % 250}|")
    lines += ["@@partitions", "batch|up|2-00:00:00|n/a", "gpu|up|infinite|n/a"]
    history = ["@@history", *[f"{600 + i}|3600|COMPLETED" for i in range(500)],
               "@@history_rc", "0"]
    # half planned by backfill (start, nodes), half not (bf_max_job_test reached)
    pending = [f"{i}|batch|2|Resources|gres:gpu:a100:8|16|64000M|{1795988258 + 60 * i}|"
               f"n[{2 * i}-{2 * i + 1}]|u{i % 50}|{10**6 - i}|12:00:00|{_tres(2)}" if i % 2 else
               f"{i}|batch|1|Priority|gres:gpu:a100:8|8|64000M|N/A|(null)|u{i % 50}|"
               f"{10**6 - i}|12:00:00|{_tres(1)}" for i in range(2000)]
    text = "\n".join(lines + ["@@pending", *pending] + history)
    task = load_task({"resources": {"accelerators": "A100:4"}, "run": "x",
                      "config": {"slurm": {"sbatch_options": {"time": "120"}}}})
    settings = SlurmSettings.from_extra("c", {"cluster": "c"})

    def parse_and_offer() -> None:  # the free-now check holds GPUs for the 2000 jobs ahead
        slurm_offers.offers(task, parse_cluster(text), settings, "c", lambda _t, _r: "")

    med, p95 = timeit(parse_and_offer, 5 if quick else 20)
    ROWS.append((f"slurm-parse: {nodes} nodes, 2000 pending (parse + offers)",
                 f"{med * 1e3:.1f} ms", f"p95 {p95 * 1e3:.1f} ms"))

    # backfill's hole: every pending job planned (within the new job's time limit, so no node
    # is free now and the hole is planned on every one), a running job on every node
    planned = [f"{i}|batch|2|Resources|gres:gpu:a100:8|16|64000M|{1795988258 + i}|"
               f"n[{2 * i}-{2 * i + 1}]|u{i % 50}|{10**6 - i}|12:00:00|{_tres(2)}"
               for i in range(2000)]
    running = [f"r{i}|n{i}|gres:gpu:a100:3|{1795988258 + 600 + 7 * i}|8|64000M|{_tres(1)}"
               for i in range(nodes)]
    text = "\n".join(lines + ["@@pending", *planned, "@@running", *running, "@@running_rc",
                                "0"] + history)

    def with_the_plan() -> None:
        got = slurm_offers.offers(task, parse_cluster(text), settings, "c", lambda _t, _r: "")
        assert any("backfill_start" in o.details for o in got)

    med, p95 = timeit(with_the_plan, 5 if quick else 20)
    ROWS.append((f"slurm-parse: {nodes} nodes, 2000 pending all planned, {nodes} running "
                 f"(parse + offers with backfill's hole)", f"{med * 1e3:.1f} ms",
                 f"p95 {p95 * 1e3:.1f} ms"))


async def _watch(handles: list[JobHandle], interval: float, periods: int
                 ) -> tuple[int, int, float, int]:
    """Watch every handle with its own trigger; count requests over ``periods`` intervals."""
    from airflow_skypilot.triggers import skypilot as trig

    tracemalloc.start()
    triggers = [trig.SkyPilotJobTrigger(h.to_dict(), poll_interval=interval) for h in handles]
    runs = [asyncio.ensure_future(t.run().__anext__()) for t in triggers]
    await asyncio.sleep(interval * 1.5)  # every trigger subscribed, first poll done
    pollers = trig.pollers_in_this_loop()
    status0 = sum(p.status_polls for p in pollers.values())
    logs0 = sum(p.log_polls for p in pollers.values())
    cpu0 = time.process_time()
    await asyncio.sleep(interval * periods)
    cpu = time.process_time() - cpu0
    status = sum(p.status_polls for p in pollers.values()) - status0
    logs = sum(p.log_polls for p in pollers.values()) - logs0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    for r in runs:
        r.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    return status, logs, cpu, peak


def bench_poller(quick: bool) -> None:
    registry.register_backend(FakeBackend)
    real_poll = FakeBackend.astatus

    async def slow_poll(self, handles, _real=real_poll, latency=0.05):
        await asyncio.sleep(latency)  # a cluster's answer takes time
        return await _real(self, handles)

    FakeBackend.astatus = slow_poll
    try:
        for jobs, conns in ((100, 2), (1000, 10), (5000 if not quick else 2000, 20)):
            FakeBackend.reset()
            handles = []
            for i in range(jobs):
                conn = f"c{i % conns}"
                FakeBackend.jobs[str(i)] = {"name": f"n{i}", "conn": conn, "env": {},
                                            "status": JobStatus(JobState.RUNNING),
                                            "location": "p", "log": "x" * 100}
                handles.append(JobHandle(backend="fake", connection=conn, job_id=str(i),
                                         job_name=f"n{i}", location="p", infra="fake"))
            periods = 3
            status, logs, cpu, peak = asyncio.run(_watch(handles, 1.0, periods))
            ROWS.append((f"poller: {jobs} jobs on {conns} connections",
                         f"{status / periods:.1f} status + {logs / periods:.1f} log requests / "
                         f"interval ({conns} connections)",
                         f"CPU {cpu / periods * 1e3:.0f} ms per 1 s interval, "
                         f"peak {peak / 2**20:.0f} MiB"))
    finally:
        FakeBackend.astatus = real_poll


def bench_slurm_probe(quick: bool) -> None:
    conns = REPO / ".sandbox" / "slurm" / "connections.json"
    if not conns.exists():
        return
    for conn_id, conn in json.loads(conns.read_text()).items():
        os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(conn)
    from airflow_skypilot.backends.slurm import SlurmBackend
    from airflow_skypilot.exceptions import BackendUnreachable

    task = load_task({"resources": {"accelerators": {"A100": 2, "H100": 2}}, "run": "x"})
    backend = SlurmBackend("slurm_alpha")
    try:
        backend.probe(task)  # connect once
    except BackendUnreachable:
        return
    med, p95 = timeit(lambda: backend.probe(task), 5 if quick else 20)
    ROWS.append(("slurm-probe: one cluster over SSH (sandbox)", f"{med * 1e3:.0f} ms",
                 f"p95 {p95 * 1e3:.0f} ms"))


def bench_scheduling(quick: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import scheduling

    ROWS.extend(scheduling.summary_rows(quick))


def _sandbox_bench(name: str):
    def bench(quick: bool) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import backends

        backends.ROWS.clear()
        rounds = max(2, backends.DEFAULT_ROUNDS[name] // 3) if quick else None
        ROWS.extend(backends.run([name], rounds, 20 if quick and name == "sweep" else 100))
    return bench


def bench_triggerer_memory(quick: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import triggerer_memory

    ROWS.extend(triggerer_memory.run([100] if quick else [100, 1000], 1 if quick else 2))


#: the in-process benchmarks (run without names)
DEFAULT = {"spec": bench_spec, "placement": bench_placement, "slurm-parse": bench_slurm_parse,
           "poller": bench_poller, "slurm-probe": bench_slurm_probe,
           "scheduling": bench_scheduling}
#: the sandbox benchmarks (run when named; ``sandbox`` names them all)
SANDBOX = {"probe": _sandbox_bench("probe"), "submit": _sandbox_bench("submit"),
           "failover": _sandbox_bench("failover"), "sweep": _sandbox_bench("sweep"),
           "triggerer-memory": bench_triggerer_memory}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: the in-process "
                        f"ones): {', '.join([*DEFAULT, *SANDBOX])}, sandbox (all of those "
                        "that need it), all")
    args = parser.parse_args()
    unknown = set(args.names) - {*DEFAULT, *SANDBOX, "sandbox", "all"}
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    names = args.names or list(DEFAULT)
    if "sandbox" in names or "all" in names:
        names = [*([*DEFAULT] if "all" in names else []), *SANDBOX,
                 *(n for n in names if n not in ("sandbox", "all"))]
    for name in dict.fromkeys(names):
        {**DEFAULT, **SANDBOX}[name](args.quick)
    print("| benchmark | result | spread |\n|---|---|---|")
    for name, result, spread in ROWS:
        print(f"| {name} | {result} | {spread} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
