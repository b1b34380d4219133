"""`make test` and `make demo`: the Makefile, tests/run_suite.sh and tests/sandbox/demo.py.

run_suite.sh runs for real here, with a stand-in for the venv's Python: ``-m tests.sandbox
up|down`` are only noted, and ``pytest`` (the script's own wrapper code, run by the real Python)
is a fake module that notes its arguments, waits or returns the exit code it is told to. No
sandbox starts, no test runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_SUITE = REPO / "tests" / "run_suite.sh"

FAKE_PY = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = tests.sandbox ]; then
    echo "sandbox $3 ${SKYPILOT_SANDBOX_DIR:-.sandbox}" >>"$FAKE_LOG"
    if [ "$3" = up ] && [ "${SKYPILOT_SANDBOX_DIR:-.sandbox}" = "${FAKE_UP_FAILS:-none}" ]; then
        exit 1
    fi
    exit 0
fi
exec "$REAL_PY" "$@"
"""

FAKE_PYTEST = """
import os, sys, time

def note(text):
    with open(os.environ["FAKE_LOG"], "a") as fh:
        fh.write(text + "\\n")

def main():  # pytest.main(): the arguments from sys.argv
    args = sys.argv[1:]
    shard = "e2e" if "tests/e2e" in args else "rest"
    note(f"pytest {shard} start {' '.join(args)}")
    try:
        if os.environ.get("FAKE_PYTEST_WAIT"):
            note(f"pytest {shard} waiting")
            time.sleep(60)
    except KeyboardInterrupt:
        note(f"pytest {shard} interrupted")
        return 2
    rc = int(os.environ.get(f"FAKE_RC_{shard.upper()}", "0"))
    note(f"pytest {shard} end {rc}")
    return rc

if __name__ == "__main__":  # python -m pytest
    sys.exit(main())
"""


@pytest.fixture
def suite(tmp_path):
    """Run run_suite.sh with the stand-ins; returns (start(args, **env) -> Popen, log lines)."""
    fake_py = tmp_path / "python"
    fake_py.write_text(FAKE_PY)
    fake_py.chmod(0o755)
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "pytest.py").write_text(FAKE_PYTEST)
    log = tmp_path / "log"
    log.touch()
    procs: list[subprocess.Popen] = []

    def start(*args: str, **env: str) -> subprocess.Popen:
        run_env = {**os.environ, "PY": str(fake_py), "REAL_PY": sys.executable,
                   "PYTHONPATH": str(tmp_path / "mods"), "FAKE_LOG": str(log),
                   "SKYPILOT_SANDBOX_PORT_BASE": "28000", **env}
        run_env.pop("SKYPILOT_SANDBOX_DIR", None)
        proc = subprocess.Popen(["bash", str(RUN_SUITE), *args], env=run_env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(proc)
        return proc

    def lines() -> list[str]:
        return log.read_text().splitlines()

    yield start, lines
    for proc in procs:  # the script's session: nothing it started outlives the test
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


def wait_for(lines, predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(lines()):
        assert time.monotonic() < deadline, lines()
        time.sleep(0.05)


SECOND = str(REPO / ".sandbox-b")
UP_BOTH = ["sandbox up .sandbox", f"sandbox up {SECOND}"]
DOWN_BOTH = [f"sandbox down {SECOND}", "sandbox down .sandbox"]


def sandbox_calls(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("sandbox ")]


def test_run_suite_script_is_sound():
    proc = subprocess.run(["bash", "-n", str(RUN_SUITE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(RUN_SUITE, os.X_OK)


@pytest.mark.parametrize("rest, e2e, expected", [(0, 0, 0), (1, 0, 1), (0, 1, 1), (5, 5, 0)])
def test_suite_runs_both_shards_and_stops_both_sandbox_sets(suite, rest, e2e, expected):
    start, lines = suite
    rc, out = finish(start(FAKE_RC_REST=str(rest), FAKE_RC_E2E=str(e2e)))
    assert rc == expected, out
    assert sandbox_calls(lines()) == UP_BOTH + DOWN_BOTH, "each set up once and down once"
    assert f"tests/e2e exit {0 if e2e == 5 else e2e}, the rest exit {0 if rest == 5 else rest}" \
        in out
    assert "pytest e2e start -q -p no:cacheprovider --durations=15 tests/e2e " \
        "tests/integration/test_slurm_faults.py" in lines()
    assert "pytest rest start -q -p no:cacheprovider --durations=15 --ignore=tests/e2e " \
        "--ignore=tests/integration/test_slurm_faults.py" in lines()


def test_suite_with_arguments_runs_once_on_one_set(suite):
    start, lines = suite
    rc, out = finish(start("tests/unit", "-k", "x", FAKE_RC_REST="1"))
    assert rc == 1, out
    assert sandbox_calls(lines()) == ["sandbox up .sandbox", "sandbox down .sandbox"]
    rc, out = finish(start("tests/unit", FAKE_RC_REST="5"))
    assert rc == 0, out


def test_suite_stops_what_is_up_when_the_second_set_fails_to_start(suite):
    start, lines = suite
    rc, out = finish(start(FAKE_UP_FAILS=SECOND))
    assert rc == 1, out
    assert sandbox_calls(lines()) == UP_BOTH + DOWN_BOTH
    assert not [line for line in lines() if line.startswith("pytest")]


@pytest.mark.parametrize("how, status", [("term", 143), ("ctrl-c", 130)])
def test_an_interrupted_suite_stops_pytest_and_the_sandboxes(suite, how, status):
    """SIGTERM to the script (make passes its own on), or Ctrl-C (SIGINT to the whole process
    group): both pytest runs end as on Ctrl-C (once each), then both sandbox sets go down."""
    start, lines = suite
    proc = start(FAKE_PYTEST_WAIT="1")
    wait_for(lines, lambda ls: {"pytest e2e waiting", "pytest rest waiting"} <= set(ls))
    if how == "term":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    rc, out = finish(proc)
    assert rc == status, out
    got = lines()
    assert sandbox_calls(got) == UP_BOTH + DOWN_BOTH, got
    for shard in ("e2e", "rest"):
        assert got.count(f"pytest {shard} interrupted") == 1, got
        # both runs had ended before the sandboxes went down
        assert got.index(f"pytest {shard} interrupted") < got.index(DOWN_BOTH[0]), got


def test_an_interrupted_single_run_stops_its_sandbox(suite):
    start, lines = suite
    proc = start("tests/unit", FAKE_PYTEST_WAIT="1")
    wait_for(lines, lambda ls: "pytest rest waiting" in ls)
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc)
    assert rc == 143, out
    assert sandbox_calls(lines()) == ["sandbox up .sandbox", "sandbox down .sandbox"]
    assert "pytest rest interrupted" in lines()


# --------------------------------------------------------------------------- Makefile


def makefile_rules() -> dict[str, tuple[list[str], list[str], list[str]]]:
    """target -> (prerequisites, order-only prerequisites, recipe lines)."""
    rules: dict[str, tuple[list[str], list[str], list[str]]] = {}
    current = None
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith("\t") and current is not None:
            rules[current][2].append(line.strip())
            continue
        match = re.match(r"^([^\s:=#][^:=]*):(?!=)(.*)$", line)
        if match:
            current = match.group(1).strip()
            normal, _, order_only = match.group(2).partition("|")
            rules[current] = (normal.split(), order_only.split(), [])
        elif line.strip() and not line.startswith("#"):
            current = None
    return rules


def test_debian_packages_are_checked_even_where_a_venv_exists():
    """The venv stamp names pyproject.toml and the constraints only: a package added to DEBS
    must still be installed on a machine whose venv is up to date."""
    rules = makefile_rules()
    stamp_prereqs, stamp_order_only, _ = rules["$(STAMP)"]
    for target in ("test", "demo", "lint", "unit", "sandbox"):
        assert "venv" in rules[target][0] or target == "venv", target
    assert rules["venv"][0] == ["$(STAMP)"]
    # system-deps runs whether or not the stamp is current (it is phony)...
    assert "system-deps" in stamp_order_only + stamp_prereqs + rules["venv"][0] + \
        rules["venv"][1], "system-deps only runs when the venv is (re)made"
    text = (REPO / "Makefile").read_text()
    assert re.search(r"^\.PHONY:.*\bsystem-deps\b", text, re.M)
    # ...and before the venv is made on a fresh machine (python3-venv comes from it)
    assert "system-deps" in stamp_order_only + stamp_prereqs
    assert "dpkg-query" in " ".join(rules["system-deps"][2])


def test_test_and_demo_hand_signals_to_their_runner():
    """make passes a SIGTERM to its recipe's shell only: the runner must be that process."""
    rules = makefile_rules()
    assert rules["test"][2] == ["@export PY=$(PY); exec tests/run_suite.sh $(PYTEST_ARGS)"]
    assert rules["demo"][2] == ["@exec $(PY) -m tests.sandbox.demo --sandbox"]


# --------------------------------------------------------------------------- the demo


@pytest.fixture
def demo(monkeypatch, tmp_path):
    from tests.sandbox import demo as module

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    calls: list[str] = []

    def fake_sandboxes(argv):
        calls.append(f"sandbox {argv[0]}")
        return 0

    monkeypatch.setattr(module.sandboxes, "main", fake_sandboxes)
    monkeypatch.setattr(module, "say", lambda text="": None)
    yield module, calls
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("ending, status", [
    ("ok", 0), ("failed", 1), ("ctrl-c", 130), ("sigterm", 143), ("error", None)])
def test_demo_with_sandbox_always_stops_it(demo, monkeypatch, ending, status):
    module, calls = demo

    def run():
        calls.append("demo")
        if ending == "failed":
            return 1
        if ending == "ctrl-c":
            raise KeyboardInterrupt
        if ending == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        if ending == "error":
            raise RuntimeError("boom")
        return 0

    monkeypatch.setattr(module, "run", run)
    if status is None:
        with pytest.raises(RuntimeError):
            module.main(["--sandbox"])
    elif ending == "sigterm":
        with pytest.raises(SystemExit) as exc:
            module.main(["--sandbox"])
        assert exc.value.code == status
    else:
        assert module.main(["--sandbox"]) == status
    assert calls == ["sandbox up", "demo", "sandbox down"]


def test_demo_without_sandbox_leaves_it_alone(demo, monkeypatch):
    module, calls = demo
    monkeypatch.setattr(module, "run", lambda: calls.append("demo") or 0)
    assert module.main([]) == 0
    assert calls == ["demo"]


def test_demo_does_not_run_when_the_sandbox_does_not_start(demo, monkeypatch):
    module, calls = demo
    monkeypatch.setattr(module.sandboxes, "main",
                        lambda argv: calls.append(f"sandbox {argv[0]}") or int(argv[0] == "up"))
    monkeypatch.setattr(module, "run", lambda: calls.append("demo") or 0)
    assert module.main(["--sandbox"]) == 1
    assert calls == ["sandbox up", "sandbox down"]


def test_demo_migrates_an_existing_database(demo, monkeypatch, tmp_path):
    """`airflow db migrate` every time: an existing airflow.db may predate an Airflow upgrade."""
    module, _ = demo
    home = tmp_path / "airflow-home"
    home.mkdir()
    (home / "airflow.db").write_bytes(b"")
    monkeypatch.setattr(module, "HOME", home)
    monkeypatch.setattr(module, "connections", lambda: {"slurm_alpha": {"conn_type": "slurm"}})

    class Box:
        def is_up(self):
            return False

    monkeypatch.setattr(module, "sandbox", lambda name: Box())
    ran: list[list[str]] = []

    class Stop(Exception):
        pass

    def fake_run(argv, **kwargs):
        ran.append(list(argv))
        if argv[1:3] != ["db", "migrate"]:
            raise Stop
        assert kwargs["env"]["AIRFLOW_HOME"] == str(home)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    with pytest.raises(Stop):
        module.run()
    assert ran[0][1:] == ["db", "migrate"], ran
