#!/usr/bin/env bash
# Run the benchmarks and redraw their tables and charts:
#   ./scripts/bench.sh            # bench.py (peers side by side), curves.py, cpu.py, render.py
#   ./scripts/bench.sh --rounds 5 # options go to bench.py
source "$(dirname "$0")/_env.sh"
python -m pip install --quiet --disable-pip-version-check -e ".[test,bench]" >&2
missing=()
command -v wrk >/dev/null || missing+=(wrk)
command -v redis-server >/dev/null || missing+=(redis-server)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]} (apt)" >&2
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || \
        (apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null)
fi
python benchmarks/bench.py "$@"
python benchmarks/curves.py
python benchmarks/cpu.py
python benchmarks/render.py
