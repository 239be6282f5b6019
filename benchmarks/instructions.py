"""Instructions per request of hotpath.py's in-process path, counted by valgrind.

    python benchmarks/instructions.py [--requests 1280] [hotpath.py's arguments]
    e.g. python benchmarks/instructions.py --idempotency first

CPU time on a shared machine drifts by tens of percent from one minute to the next;
the instructions a path executes do not. This runs benchmarks/hotpath.py (one round,
metrics off) under callgrind twice, with N and 4N requests, and prints
(instructions(4N) - instructions(N)) / 3N: the interpreter's start-up and the round's
set-up cancel out. Every thread of the process is counted (the SQLite writer's too), a
store server's are not. A change that removes work shows here in one run each
(``PYTHONPATH=other/src`` counts another tree). Needs valgrind (``apt install valgrind``);
about a minute a run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HOTPATH = Path(__file__).resolve().parent / "hotpath.py"


def instructions(requests: int, rest: list[str]) -> int:
    """Instructions callgrind counted in one hotpath.py run of ``requests`` requests."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={tmp}/callgrind.out",
                sys.executable,
                str(HOTPATH),
                "--rounds",
                "1",
                "--no-metrics",
                "--requests",
                str(requests),
                *rest,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"hotpath.py under callgrind failed:\n{done.stdout}{done.stderr}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=1280, help="N (a multiple of 64)")
    args, rest = parser.parse_known_args()
    if shutil.which("valgrind") is None:
        print("instructions.py needs valgrind: apt install valgrind", file=sys.stderr)
        return 1
    n = args.requests
    per_request = (instructions(4 * n, rest) - instructions(n, rest)) / (3 * n)
    print(f"{' '.join(rest) or 'limiter'}: {per_request:,.0f} instructions a request")
    return 0


if __name__ == "__main__":
    sys.exit(main())
