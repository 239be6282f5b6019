# Sourced by scripts/*.sh: make ./.venv with porch and its test tools installed.
# Re-installs only when pyproject.toml changed since the last install.
# PORCH_VENV / PORCH_EXTRAS: another venv and extras (bench.sh: its pins would change the
# test tools' versions, e.g. redis <8 for slowapi, so it gets a venv of its own).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV="${PORCH_VENV:-.venv}"
EXTRAS="${PORCH_EXTRAS:-test}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "porch needs Python 3.11 or newer (set PYTHON=/path/to/python3.11)" >&2
    exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $("$PYTHON" --version)" >&2
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.porch-installed"
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "installing porch[$EXTRAS] into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$EXTRAS]" >&2
    echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/$VENV/bin:$PATH"
