"""Before/after of a change, in one interleaved run: this checkout against another revision.

    python benchmarks/ab.py [--base main] [--head REV] [--variants bare,limiter]
                            [--connections 1,64] [--rounds 3] [--duration 3]
                            [--env NAME=VALUE ...]

``--variants`` names bench.py cases (benchmarks/cases.py: ``bare-post,idem-first``
sends each case's requests), points of the keys curve (``keys-1,keys-1000000``:
the limiter, N distinct forwarded clients) or plain app variants (GET /, against ``bare``). A
baseline (a case that is its own baseline, such as ``bare`` or ``bare-post``) is
measured on this tree only; every other case on both, and its ratio is taken
against its baseline of the same round and tree (list the baseline first:
``bare,bare-headers,limiter``). Cases on PostgreSQL or Redis (``limiter-postgres``,
``slowapi-redis``) get throwaway servers as in bench.py, fresh tables per run.

The ``--base`` revision's ``src`` is exported (``git archive``) to a temporary
directory and put first on the servers' ``PYTHONPATH``; this checkout's runs
use its own ``src`` (or ``--head``'s, exported alike), whatever porch the venv
has installed. Every point (connections,
variant, tree) is measured in each round, interleaved, each ratio taken against
the bare app of the same round and connection count. Per request it also
reports CPU microseconds of the event loop's thread and of the others (the
SQLite writer), and cyclic-GC passes per 1000 requests, read as in
benchmarks/cpu.py. ``--env NAME=VALUE`` sets a variable for this tree's servers only
(``--base`` the same revision: a setting's A/B, such as ``BENCH_SWITCH_INTERVAL``; the
baselines run without it). Prints; writes nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _harness import ROOT, Server, load
from _stores import store_servers
from cases import CASES, GET, Case
from cpu import thread_cpu
from curves import keys_lua

_CASES = {case.name: case for case in CASES}


def case(name: str) -> Case:
    """The bench.py case of that name; ``keys-N``: the limiter with N distinct clients
    (curves.py's keys curve) against ``keys-1``; else the plain variant on GET / against bare."""
    if name.startswith("keys-"):
        lua = keys_lua(int(name[5:]))
        return Case(name, "limiter", lua, "keys-1", name, env={"BENCH_TRUST_HOPS": "1"})
    return _CASES.get(name) or Case(name, name, GET, "bare", name)


def export(rev: str, into: Path) -> Path:
    """``rev``'s src tree under ``into``; the path to put on PYTHONPATH."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def measure(
    case: Case,
    src: Path | None,
    connections: int,
    duration: int,
    tmp: Path,
    servers: dict[str, Any] | None = None,
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(dir=tmp))
    env = {**case.env, "PYTHONPATH": f"{src}:{ROOT}"} if src is not None else dict(case.env)
    env.update(extra or {})
    if case.redis and servers:
        env["BENCH_REDIS"] = servers[case.redis].url
    if case.postgres and servers:
        env["BENCH_POSTGRES"] = servers["postgres"].url
        env["BENCH_SCHEMA"] = data.name.replace("-", "_").lower()  # fresh tables per run
    server = Server(case.variant, data, env=env)
    path, lua = case.path, case.lua
    try:
        load(server.url, path, lua, connections=connections, duration=1, tmp=tmp)
        pid = server.pids()[0]
        gc0 = server.stats()["gc_collections"]
        before = thread_cpu(pid)
        r = load(server.url, path, lua, connections=connections, duration=duration, tmp=tmp)
        after = thread_cpu(pid)
        gc1 = server.stats()["gc_collections"]
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    n = max(1, int(r["requests"]))
    loop_us = other_us = 0.0
    for tid, (user, system, _) in after.items():
        u0, s0, _ = before.get(tid, (0.0, 0.0, 0))
        us = ((user - u0) + (system - s0)) * 1e6 / n
        if tid == pid:
            loop_us += us
        else:
            other_us += us
    return {
        "rps": r["rps"],
        "p99_ms": r["p99_ms"],
        "loop_us": loop_us,
        "other_us": other_us,
        "gc0": (gc1[0] - gc0[0]) * 1000 / n,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", default="main", help="git revision to compare against")
    parser.add_argument("--head", default="", help="git revision to measure (default: this tree)")
    parser.add_argument("--variants", default="bare,limiter", help="bench app variants")
    parser.add_argument("--connections", default="1,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=3)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE, this tree only")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    variants = args.variants.split(",")
    conns = [int(c) for c in args.connections.split(",")]
    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="porch-ab-") as tmpdir,
        store_servers([case(v) for v in variants]) as servers,
    ):
        tmp = Path(tmpdir)
        base_src = export(args.base, tmp / "base")
        # This checkout's own src, first on the path: never whatever porch the venv has
        # installed (a venv made in another worktree would measure that one instead).
        head_src = export(args.head, tmp / "head") if args.head else ROOT / "src"
        trees: list[tuple[str, Path | None]] = [("base", base_src), ("this", head_src)]
        for round_ in range(args.rounds):
            # Which tree goes first alternates, so neither always has the warmer machine.
            order = trees if round_ % 2 == 0 else trees[::-1]
            for c in conns:
                # Each tree's rps of every case measured so far this round: a case's
                # ratio is to its baseline on the same tree (``limiter-settle`` to that
                # tree's ``limiter``); a case that is its own baseline (``bare``) is
                # porch-free, measured once, and stands for both.
                measured: dict[tuple[str, str], float] = {}
                for variant in variants:
                    this = case(variant)
                    own = this.baseline == this.name
                    for tree, src in [t for t in order if t[0] == "this"] if own else order:
                        mine = extra if tree == "this" and not own else None
                        r = measure(this, src, c, args.duration, tmp, servers, mine)
                        for t in ("base", "this") if own else (tree,):
                            measured[this.name, t] = r["rps"]
                        bare = measured.get((this.baseline, tree))
                        r["ratio"] = r["rps"] / bare if bare else float("nan")
                        runs.setdefault((c, variant, tree), []).append(r)
                        print(
                            f"round {round_ + 1} c={c:<4} {variant:14} {tree:5} "
                            f"{r['rps']:8.0f} rps  ratio {r['ratio']:.3f}  p99 {r['p99_ms']:6.2f}"
                            f" ms  loop {r['loop_us']:5.1f} us  other {r['other_us']:4.1f} us"
                            f"  gc0/1000 {r['gc0']:5.2f}",
                            file=sys.stderr,
                            flush=True,
                        )
    head = args.head or ROOT
    print(f"medians over {args.rounds} rounds (base = {args.base}, this = {head}):")
    for (c, variant, tree), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"c={c:<4} {variant:14} {tree:5} {med['rps']:8.0f} rps  ratio {med['ratio']:.3f}"
            f"  p99 {med['p99_ms']:6.2f} ms  loop {med['loop_us']:5.1f} us"
            f"  other {med['other_us']:4.1f} us  gc0/1000 {med['gc0']:5.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
