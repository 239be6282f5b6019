#!/usr/bin/env bash
# Re-measure everything in one run and redraw the tables and charts:
#   ./scripts/bench.sh             # bench.py (every row of results.json), curves.py,
#                                  # cpu.py, capacity.py, then render.py (README block,
#                                  # docs/benchmarks.md)
#   ./scripts/bench.sh --rounds 5  # options go to bench.py
# With the defaults (3 rounds × 5 s of every row) it takes about 25 minutes on 2 cores,
# more on a busy machine; each script records its own time and docs/benchmarks.md states it.
# A venv of its own: the benchmarks' pins (redis <8 for slowapi) would change the test tools'.
export PORCH_VENV=.venv-bench PORCH_EXTRAS=test,bench
source "$(dirname "$0")/_env.sh"
missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v redis-server >/dev/null || missing+=(redis-server)
# The PostgreSQL rows start a throwaway cluster (benchmarks/_harness.py finds initdb).
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null \
    || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]} (apt)" >&2
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || \
        (apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null)
fi
SECONDS=0
python benchmarks/bench.py "$@"
python benchmarks/curves.py
python benchmarks/cpu.py
python benchmarks/capacity.py
python benchmarks/render.py
echo "bench.sh: measured and drawn in $((SECONDS / 60)) min $((SECONDS % 60)) s" >&2
