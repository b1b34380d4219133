#!/usr/bin/env bash
# `make test`'s runner: the suite in two shards at once, each against sandboxes of its own
# (ports SKYPILOT_SANDBOX_PORT_BASE and +500, state .sandbox and .sandbox-b): the e2e tests
# and the Slurm fault tests (real Airflow and real daemons, mostly waiting on jobs), and
# everything else. Both sets of sandboxes are up
# before either shard starts and down after both end; munged, shared by both, is stopped by
# the set that started it, last. pytest's exit 5 (no tests collected) is not a failure.
#
# With arguments (`make test PYTEST_ARGS=...`): one pytest run with them, on one sandbox set.
#
# Interrupted (Ctrl-C, SIGTERM), it stops the pytest runs (as Ctrl-C does: their fixtures tear
# down), then the sandboxes, and exits 130 or 143; any other early exit stops the sandboxes too.
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
# pytest, with SIGINT and SIGTERM both a KeyboardInterrupt (once: the terminal's Ctrl-C and the
# one this script passes on are one interruption). The runs go in the background, so that
# `wait` returns to the traps at once (a background job of a script would ignore SIGINT; its
# stdin is kept where it was the terminal's, for --pdb).
PYTEST=("$PY" -c '
import signal, sys
import pytest

def interrupt(signum, frame):
    if not getattr(interrupt, "seen", False):
        interrupt.seen = True
        raise KeyboardInterrupt

for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, interrupt)
sys.argv[0] = "pytest"
sys.exit(int(pytest.main()))
' -q -p no:cacheprovider --durations=15)
base=${SKYPILOT_SANDBOX_PORT_BASE:-28000}
second=(env SKYPILOT_SANDBOX_PORT_BASE=$((base + 500)) SKYPILOT_SANDBOX_DIR="$PWD/.sandbox-b")
sets=0        # how many sandbox sets are (maybe) up: 1 the first, 2 both; down() stops them
running=()    # the pytest runs under way
e2e_log=""    # the e2e shard's output, shown after the other shard's

ok() {  # a pytest exit code as a pass/fail exit code
    if [ "$1" -eq 5 ]; then echo "pytest: no tests were collected (exit 5)"; return 0; fi
    return "$1"
}

down() {  # stop the sandbox sets started (the second first: munged belongs to the first)
    local rc=0
    if [ "$sets" -ge 2 ]; then "${second[@]}" "$PY" -m tests.sandbox down || rc=1; fi
    if [ "$sets" -ge 1 ]; then "$PY" -m tests.sandbox down || rc=1; fi
    sets=0
    return $rc
}

interrupted() {  # SIGNAL EXIT_STATUS
    trap '' INT TERM  # a second Ctrl-C does not cut the clean-up short
    echo "run_suite: $1: stopping the tests, then the sandboxes" >&2
    if [ "${#running[@]}" -gt 0 ]; then
        kill -TERM "${running[@]}" 2>/dev/null
        wait "${running[@]}" 2>/dev/null
    fi
    if [ -s "$e2e_log" ]; then
        echo "=================================== tests/e2e (interrupted) ====================="
        cat "$e2e_log"
    fi
    down
    exit "$2"
}
finish() {  # on any exit: what is still up goes down (a no-op after the normal path's down)
    down
    if [ -n "$e2e_log" ]; then rm -f "$e2e_log"; fi
}
trap 'interrupted SIGINT 130' INT
trap 'interrupted SIGTERM 143' TERM
trap finish EXIT

if [ "$#" -gt 0 ]; then
    sets=1
    "$PY" -m tests.sandbox up || { down; exit 1; }
    "${PYTEST[@]}" "$@" <&0 &
    running=($!)
    wait "${running[0]}"; rc=$?
    running=()
    down || { [ "$rc" -eq 0 ] && rc=1; }
    ok "$rc"; exit $?
fi

sets=1
"$PY" -m tests.sandbox up || { down; exit 1; }
sets=2
"${second[@]}" "$PY" -m tests.sandbox up || { down; exit 1; }

# The shards' lengths, as measured: the e2e tests 17.5 min, the rest 25.7; the Slurm fault
# tests (about 4 min, mostly waiting on jobs) go with the e2e tests
first_shard=(tests/e2e tests/integration/test_slurm_faults.py)
e2e_log=$(mktemp)
"${PYTEST[@]}" "${first_shard[@]}" > "$e2e_log" 2>&1 &
e2e=$!
"${second[@]}" "${PYTEST[@]}" "${first_shard[@]/#/--ignore=}" <&0 &
others=$!
running=("$e2e" "$others")
wait "$others"; rest=$?
wait "$e2e"; e2e_rc=$?
running=()
echo
echo "=================================== tests/e2e (and the Slurm fault tests) ========="
cat "$e2e_log"
down; down_rc=$?

ok "$rest"; rest=$?
ok "$e2e_rc"; e2e_rc=$?
echo "make test: tests/e2e exit $e2e_rc, the rest exit $rest"
[ "$rest" -eq 0 ] && [ "$e2e_rc" -eq 0 ] && [ "$down_rc" -eq 0 ]
