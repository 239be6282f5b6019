#!/usr/bin/env bash
# The whole suite under load: ./scripts/loaded.sh [RUNS] [COMMIT]
# Runs CI (.ci/run) RUNS times (default 5) in a row, each in a fresh clone of COMMIT
# (default HEAD), while one busy process per core keeps every core busy: a test that
# hangs or races only on a slow machine shows here. Stops at the first failure (within a
# run too: pytest -x, so its report comes at once); one line per run in
# $PORCH_LOADED_DIR/summary, each run's output beside it.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RUNS="${1:-5}"
COMMIT="$(git -C "$ROOT" rev-parse --short "${2:-HEAD}")"
OUT="${PORCH_LOADED_DIR:-$(mktemp -d -t porch-loaded-XXXXXX)}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
BUSY=()
for _ in $(seq "$(nproc)"); do
    "$PYTHON" -c 'while True: pass' & BUSY+=($!)
done
trap 'kill "${BUSY[@]}" 2>/dev/null' EXIT
for k in $(seq "$RUNS"); do
    CLONE="$OUT/run$k-$COMMIT"
    rm -rf "$CLONE"
    git clone -q "$ROOT" "$CLONE" && git -C "$CLONE" checkout -q "$COMMIT" || exit 2
    START=$(date +%s)
    (cd "$CLONE" && PYTEST_ADDOPTS="-x" bash .ci/run) > "$CLONE.log" 2>&1
    RC=$?
    LINE="run $k of $RUNS, $COMMIT: exit $RC after $(( $(date +%s) - START )) s;"
    LINE="$LINE $(grep -E '[0-9]+ (passed|failed)' "$CLONE.log" | head -1)"
    echo "$LINE" | tee -a "$OUT/summary"
    [ "$RC" -eq 0 ] || exit "$RC"
done
echo "$RUNS runs passed in a row: $OUT/summary"
