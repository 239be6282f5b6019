#!/usr/bin/env bash
# Lint, type-check and run the whole suite: ./scripts/test.sh [pytest options]
source "$(dirname "$0")/_env.sh"
# apt_install PACKAGE... : install with apt as root (after an update if the lists are stale).
apt_install() {
    apt-get install -y -qq "$@" >/dev/null 2>&1 || \
        (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq "$@" >/dev/null 2>&1)
}
CAN_APT=""
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then CAN_APT=1; fi
# The wall-clock leg of the gate moves a real server's clock with libfaketime.
if ! command -v faketime >/dev/null 2>&1 && [ -n "$CAN_APT" ]; then
    echo "installing faketime (apt) for the wall-clock leg" >&2
    apt_install faketime || echo "could not install faketime; that leg will be skipped" >&2
fi
# The PostgreSQL and Redis stores are tested against real servers (tests/servers.py
# starts throwaway ones); without them those tests skip, or fail under PORCH_REQUIRE_BACKENDS.
if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && ! command -v initdb >/dev/null \
    && [ -n "$CAN_APT" ]; then
    echo "installing postgresql (apt) for the PostgreSQL store's tests" >&2
    apt_install postgresql || echo "could not install postgresql; its tests will not run" >&2
fi
if ! command -v redis-server >/dev/null 2>&1 && [ -n "$CAN_APT" ]; then
    echo "installing redis-server (apt) for the Redis store's tests" >&2
    apt_install redis-server || echo "could not install redis-server; its tests will not run" >&2
fi
# The Redis Cluster of tests/servers.py is joined by redis-cli (redis-tools, which
# redis-server's package depends on): installed apart if it is missing.
if ! command -v redis-cli >/dev/null 2>&1 && [ -n "$CAN_APT" ]; then
    echo "installing redis-tools (apt) for the Redis Cluster tests" >&2
    apt_install redis-tools || echo "could not install redis-cli; the cluster tests will not run" >&2
fi
# The deployment recipes are run behind a real nginx (tests/e2e/test_deployment.py).
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ] && [ -n "$CAN_APT" ]; then
    echo "installing nginx (apt) for the deployment recipes' tests" >&2
    apt_install nginx-light || apt_install nginx || echo "could not install nginx; those tests will skip" >&2
fi
echo "== ruff" >&2
ruff check src tests benchmarks examples
ruff format --check src tests benchmarks examples
echo "== mypy --strict" >&2
mypy
echo "== pytest" >&2
if [ $# -eq 0 ] || [ "$*" = "-q" ]; then
    # The whole suite: with coverage (every process it starts), then the integrations on
    # the oldest supported frameworks.
    rm -rf .coverage && mkdir .coverage
    # The 25 slowest tests, listed at the end: where the suite's time goes.
    python -m coverage run -m pytest --durations=25 "$@"
    python -m coverage combine -q
    echo "== coverage of src/porch (lines and branches; python -m coverage report for each file)" >&2
    python -m coverage report --format=total | sed 's/$/%/'
    ./scripts/oldest.sh -q
else
    exec python -m pytest "$@"
fi
