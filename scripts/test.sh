#!/usr/bin/env bash
# Lint, type-check and run the whole suite: ./scripts/test.sh [pytest options]
source "$(dirname "$0")/_env.sh"
# The wall-clock leg of the gate moves a real server's clock with libfaketime.
if ! command -v faketime >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing faketime (apt) for the wall-clock leg" >&2
    (apt-get install -y -qq faketime >/dev/null 2>&1 || \
        (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq faketime >/dev/null 2>&1)) || \
        echo "could not install faketime; that leg will be skipped" >&2
fi
echo "== ruff" >&2
ruff check src tests benchmarks
ruff format --check src tests benchmarks
echo "== mypy --strict" >&2
mypy
echo "== pytest" >&2
exec python -m pytest "$@"
