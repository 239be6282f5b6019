# Sourced by scripts/*.sh: make ./.venv with porch and its test tools installed.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "porch needs Python 3.11 or newer (set PYTHON=/path/to/python3.11)" >&2
    exit 2
fi
if [ ! -x .venv/bin/python ]; then
    echo "creating .venv with $("$PYTHON" --version)" >&2
    "$PYTHON" -m venv .venv
fi
STAMP=.venv/.porch-installed
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "installing porch and its test tools into .venv" >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]" >&2
    echo "$WANT" > "$STAMP"
fi
export PATH="$ROOT/.venv/bin:$PATH"
