#!/usr/bin/env bash
# `make test`'s runner: the suite in two shards at once, each against sandboxes of its own
# (ports SKYPILOT_SANDBOX_PORT_BASE and +500, state .sandbox and .sandbox-b): the e2e tests
# (real Airflow, mostly waiting on jobs) and everything else. Both sets of sandboxes are up
# before either shard starts and down after both end; munged, shared by both, is stopped by
# the set that started it, last. pytest's exit 5 (no tests collected) is not a failure.
#
# With arguments (`make test PYTEST_ARGS=...`): one pytest run with them, on one sandbox set.
set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PY:-.venv/bin/python}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --durations=15)
base=${SKYPILOT_SANDBOX_PORT_BASE:-28000}
second=(env SKYPILOT_SANDBOX_PORT_BASE=$((base + 500)) SKYPILOT_SANDBOX_DIR="$PWD/.sandbox-b")

ok() {  # a pytest exit code as a pass/fail exit code
    if [ "$1" -eq 5 ]; then echo "pytest: no tests were collected (exit 5)"; return 0; fi
    return "$1"
}

if [ "$#" -gt 0 ]; then
    "$PY" -m tests.sandbox up || { "$PY" -m tests.sandbox down; exit 1; }
    "${PYTEST[@]}" "$@"; rc=$?
    "$PY" -m tests.sandbox down || { [ "$rc" -eq 0 ] && rc=1; }
    ok "$rc"; exit $?
fi

down() {
    local rc=0
    "${second[@]}" "$PY" -m tests.sandbox down || rc=1
    "$PY" -m tests.sandbox down || rc=1
    return $rc
}
{ "$PY" -m tests.sandbox up && "${second[@]}" "$PY" -m tests.sandbox up; } || { down; exit 1; }

e2e_log=$(mktemp)
"${PYTEST[@]}" tests/e2e > "$e2e_log" 2>&1 &
e2e=$!
"${second[@]}" "${PYTEST[@]}" --ignore=tests/e2e; rest=$?
wait "$e2e"; e2e_rc=$?
echo
echo "=================================== tests/e2e ==================================="
cat "$e2e_log"
rm -f "$e2e_log"
down; down_rc=$?

ok "$rest"; rest=$?
ok "$e2e_rc"; e2e_rc=$?
echo "make test: tests/e2e exit $e2e_rc, the rest exit $rest"
[ "$rest" -eq 0 ] && [ "$e2e_rc" -eq 0 ] && [ "$down_rc" -eq 0 ]
