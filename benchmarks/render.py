"""Draw the results: the README's summary table, docs/benchmarks.md and its charts.

    python benchmarks/render.py

Reads benchmarks/results.json (bench.py), benchmarks/curves.json (curves.py) and
benchmarks/cpu.json (cpu.py); writes the README block between the results
markers, docs/benchmarks.md and docs/img/*.png (benchmarks/charts.py). Every
number shown comes from those three files; a row, curve or file that is missing
is left out (a run with --cases renders what it measured).
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any

from charts import capacity_chart, charts, median
from choices import CHOICES
from targets import BOUNDS, target_lines

ROOT = Path(__file__).resolve().parent.parent


def _ratio(r: dict[str, Any]) -> str:
    if r["variant"] == r["baseline"]:
        return "1"
    if r["ratio_to_bare"] is None:  # its baseline was not measured in this run
        return "–"
    return f"{r['ratio_to_bare']:.2f}× {r['baseline']}"


def measured_line(report: dict[str, Any]) -> str:
    return (
        f"Measured {report['date'][:10]} on {report['machine']['cpus']} CPUs "
        f"({report['load_generator']}, {report['connections']} connections, "
        f"{report['rounds']} interleaved round{'s' if report['rounds'] != 1 else ''} × "
        f"{report['duration_s']} s, medians; "
        f"`{report['command'].strip()}`)."
    )


def io_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows whose handler awaits I/O before it answers (bench.py's ``-io`` cases)."""
    return [r for r in report["results"] if r.get("handler_io_ms")]


def results_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | what | req/s | ratio | p50 ms | p99 ms | added p99 ms | txn / request |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        added = (
            ""
            if r["variant"] == r["baseline"] or r["added_p99_ms"] is None
            else f"{r['added_p99_ms']:+.2f}"
        )
        txn = "" if r["txn_per_request"] is None else f"{r['txn_per_request']:.3f}"
        lines.append(
            f"| {r['variant']} | {r['what']} | {r['rps']:,.0f} | {_ratio(r)} | {r['p50_ms']:.2f} "
            f"| {r['p99_ms']:.2f} | {added} | {txn} |"
        )
    return "\n".join(lines)


IO_INTRO = (
    "With a realistic handler: it awaits `asyncio.sleep(0.002)` before it answers, "
    "standing in for a database query of about 2 ms (uvloop's timers tick in "
    "milliseconds, so the wait is 2–3 ms). Each ratio is to the bare app running the "
    "same handler, in the same round; a replay answers without running the handler."
)


def _when(stamp: str) -> datetime.datetime | None:
    try:
        when = datetime.datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def run_lines(
    report: dict[str, Any], curves: dict[str, Any] | None, cpu: dict[str, Any] | None
) -> list[str]:
    """How long each script took, and whether the three files come from one run."""
    parts = [("bench.py", report), ("curves.py", curves), ("cpu.py", cpu)]
    took = [(name, data["elapsed_s"]) for name, data in parts if data and "elapsed_s" in data]
    # bench.sh runs the three one after another: bench.py stamps its end, curves.py its
    # start, cpu.py its end. One run leaves no gap between them (a minute's slack for
    # start-up, a few seconds for the stamps' rounding); a script re-run on its own later
    # is not part of that run.
    one_run = False
    if len(took) == 3 and curves is not None and cpu is not None:
        ended, started, done = _when(report["date"]), _when(curves["date"]), _when(cpu["date"])
        if ended is not None and started is not None and done is not None:
            gap = (done - started).total_seconds() - curves["elapsed_s"] - cpu["elapsed_s"]
            one_run = -5 <= (started - ended).total_seconds() < 60 and -5 <= gap < 60
    if one_run:
        total = sum(seconds for _, seconds in took)
        detail = ", ".join(f"{name} {_minutes(seconds)}" for name, seconds in took)
        return [
            f"`./scripts/bench.sh` measured all of this in one run of {_minutes(total)} "
            f"on {report['machine']['cpus']} CPUs ({detail}; render.py draws in seconds)."
        ]
    dates = ", ".join(
        f"{name} {data['date'][:16].replace('T', ' ')}" for name, data in parts if data is not None
    )
    return [f"These results come from more than one run: {dates}."]


def split_lines(report: dict[str, Any]) -> list[str]:
    """How the kernel spread the connections over the workers, round by round."""
    out = []
    for r in report["results"]:
        splits = r.get("connections_per_worker")
        if splits and any(splits):
            rounds = ", ".join("/".join(map(str, s)) if s else "?" for s in splits)
            rps = ", ".join(f"{x:,.0f}" for x in r["rounds_rps"])
            out.append(f"- {r['variant']}: {rounds} (req/s {rps})")
    return out


def peer_lines(report: dict[str, Any]) -> list[str]:
    by = {r["variant"]: r for r in report["results"]}
    out = []
    for ours, peer in (
        ("limiter", "slowapi-memory"),
        ("limiter-power", "slowapi-redis"),
        ("limiter-power", "slowapi-redis-fsync"),
        ("limiter-redis", "slowapi-redis"),
        ("limiter-redis-fsync", "slowapi-redis-fsync"),
        ("idem-first", "peer-idem-first"),
        ("idem-replay", "peer-idem-replay"),
        ("limiter-postgres", "slowapi-redis"),
    ):
        if ours in by and peer in by:
            out.append(f"- {ours} / {peer}: {by[ours]['rps'] / by[peer]['rps']:.2f}×")
    return out


def curves_text(curves: dict[str, Any]) -> list[str]:
    lines = [
        "## Against concurrency",
        "",
        f"`{curves['command'].strip()}` — {curves['duration_s']} s per point, bare, "
        "bare-headers (the bare app sending the limiter's five headers itself) and the "
        "limiter interleaved at each point, one measurement each.",
        "",
        "| connections | bare req/s | bare-headers req/s | limiter req/s | ratio to bare "
        "| ratio to bare-headers | bare-headers p99 ms | limiter p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in curves["concurrency"]:
        headers = c.get("bare-headers")  # curves.json from before it had the row: a dash
        cells = (
            (f"{headers['rps']:,.0f}", f"{c['ratio_to_headers']:.2f}", f"{headers['p99_ms']:.2f}")
            if headers
            else ("–", "–", "–")
        )
        lines.append(
            f"| {c['connections']} | {c['bare']['rps']:,.0f} | {cells[0]} | "
            f"{c['limiter']['rps']:,.0f} | {c['ratio']:.2f} | {cells[1]} | "
            f"{cells[2]} | {c['limiter']['p99_ms']:.2f} |"
        )
    lines += [
        "",
        "![throughput against concurrency](img/concurrency.png)",
        "",
        "## Against distinct client keys",
        "",
        "Every request carries a forwarded client (`X-Forwarded-For`, one trusted hop) "
        "drawn from K distinct addresses.",
        "",
        "| distinct keys | req/s | ratio to 1 key | counter rows after | txn / request |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k in curves["keys"]:
        lines.append(
            f"| {k['keys']:,} | {k['rps']:,.0f} | {k['ratio_to_one_key']:.2f} | "
            f"{k['rows']:,} | {k['txn_per_request']:.3f} |"
        )
    churn = curves["churn"]
    first, last = churn["samples"][0], churn["samples"][-1]
    rate = (last["requests"] - first["requests"]) / (last["t"] - first["t"])
    one_key = next(k["rps"] for k in curves["keys"] if k["keys"] == 1)
    lines += [
        "",
        "![throughput against keys](img/keys.png)",
        "",
        "## Under churn",
        "",
        f"Every request is a client never seen before, window {churn['window_s']:g} s, "
        f"for {churn['seconds']} s: {last['requests']:,} distinct clients. The bounded "
        "prune keeps the table near one window's worth of clients.",
        "",
        f"- counter rows: {first['rows']:,} at {first['t']} s, {last['rows']:,} at {last['t']} s",
        # Windows expire all along here, unlike the keys curve's: the prune's cost shows.
        f"- throughput: {rate:,.0f} requests/s, {rate / one_key:.2f}× the keys curve's one client",
        f"- store file + WAL: {first['db_mb']} MB → {last['db_mb']} MB",
        f"- process RSS: {first['rss_mb']} MB → {last['rss_mb']} MB",
        "",
        "![churn](img/churn.png)",
        "",
    ]
    return lines


def cpu_text(cpu: dict[str, Any]) -> list[str]:
    """The per-request table from benchmarks/cpu.json: CPU per thread and store round trips."""
    lines = [
        "## Where the time goes, per request",
        "",
        f"`python benchmarks/cpu.py` ({cpu['date'][:10]}, {cpu['duration_s']} s per row, 64 "
        "connections, one measurement each): CPU time per request of each busy server "
        "thread, from the kernel's per-thread counters, and the store round trips per "
        "request (SQLite transactions, PostgreSQL function calls, Redis pipelines, from the "
        "pool's statistics). The server has one core, so the total sets the throughput. "
        "PostgreSQL's and Redis's drivers run on the event loop: their work is in its column "
        "(the store writer's column is SQLite's writer thread). The store server's column is "
        "the CPU of the PostgreSQL or Redis server's processes per request (every backend "
        "and background process; on the load's core, not the app's): what bounds a row "
        "whose app core is not busy.",
        "",
        "| row | req/s | event loop µs (user + sys) | store writer µs (user + sys) "
        "| store helpers µs | total µs / request | store round trips / request "
        "| store server µs / request | GC passes / 1000 requests (gen 0, 1, 2) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in cpu["cases"]:
        cells = {"event loop": "–", "store writer": "–", "store helpers": "–"}
        sums: dict[str, list[float]] = {}
        for t in row["threads"]:
            # Older files label every thread but the loop "store writer": summed, as here.
            user_sys = sums.setdefault(t["thread"], [0.0, 0.0])
            user_sys[0] += t["user_us"]
            user_sys[1] += t["system_us"]
        for name, (user, system) in sums.items():
            cells[name] = f"{user + system:.1f} ({user:.1f} + {system:.1f})"
        trips = row.get("round_trips")
        server = row.get("store_server_us")
        lines.append(
            f"| {row['case']} | {row['rps']:,.0f} | {cells['event loop']} "
            f"| {cells['store writer']} | {cells['store helpers']} | {row['cpu_us']:.1f} "
            f"| {'–' if trips is None else f'{trips:.3f}'} "
            f"| {'–' if server is None else f'{server:.1f}'} "
            f"| {', '.join(f'{g:g}' for g in row.get('gc_per_1000_requests', []))} |"
        )
    return [*lines, ""]


def capacity_text(capacity: dict[str, Any]) -> list[str]:
    """The capacity model from benchmarks/capacity.json: the measured points, then what one
    core of each side decides and how many app hosts one store core keeps up with."""
    points = capacity["points"]
    lines = [
        "## Capacity: decisions per app process and per store server",
        "",
        f"Made by `{capacity['command'].strip()}` ({_minutes(capacity['seconds'])}, "
        f"{capacity['duration_s']} s of load per point, {capacity['connections']} connections "
        "in all, split between the processes). Every request is a new client among a million, "
        "so each is a decision on a counter of its own; app processes are uvicorn with one "
        "worker each, unpinned; the CPU is read from /proc for the app processes and for "
        "every process of the store servers (PostgreSQL's backends, each cluster node). On "
        "this 2-core box everything shares two cores, so the totals flatten where the box "
        "saturates; CPU per decision does not depend on the box.",
        "",
        "| store | servers | app processes | decisions/s | per process "
        "| app CPU µs / decision | store CPU µs / decision |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        store_us = "—" if p["store_cpu_us"] is None else f"{p['store_cpu_us']:g}"
        lines.append(
            f"| {p['store']} | {p['servers'] or '— (embedded)'} | {p['processes']} "
            f"| {p['rps']:,.0f} | {p['rps_per_process']:,.0f} | {p['app_cpu_us']:g} "
            f"| {store_us} |"
        )
    lines += [
        "",
        "![capacity](img/capacity.png)",
        "",
        "Per core, from the CPU per decision (median over the process counts). *One app "
        "core*: decisions/s one core of app processes makes; *one store core*: decisions/s "
        "one core of the store's servers makes (a Redis server or cluster node is about one "
        "core: Redis runs commands on one thread); *app cores per store core*: how many app "
        "cores, each deciding flat out, one store core keeps up with; *hosts per store "
        f"core*: app hosts at {HOST_RATE:,} decisions/s each.",
        "",
        "| store | one app core | one store core | app cores per store core "
        "| hosts per store core |",
        "|---|---:|---:|---:|---:|",
    ]
    per_core = capacity_per_core(points)
    for name, (app, store) in per_core.items():
        if store is None:
            lines.append(f"| {name} | {app:,.0f} | — (in the app process) | — | — |")
        else:
            lines.append(
                f"| {name} | {app:,.0f} | {store:,.0f} | {store / app:.1f} "
                f"| {store / HOST_RATE:,.1f} |"
            )
    lines += ["", "Where each saturates, and what to add next (from the rows above):", ""]
    lines += next_steps(per_core)
    return [*lines, ""]


def capacity_per_core(points: list[dict[str, Any]]) -> dict[str, tuple[float, float | None]]:
    """Per store: decisions/s of one app core and of one store core (None: embedded),
    from the median CPU per decision over its process counts."""
    found: dict[str, tuple[float, float | None]] = {}
    for name in dict.fromkeys(p["store"] for p in points):
        mine = [p for p in points if p["store"] == name]
        app = 1e6 / median([p["app_cpu_us"] for p in mine])
        spent = [p["store_cpu_us"] for p in mine if p["store_cpu_us"]]
        found[name] = (app, 1e6 / median(spent) if spent else None)
    return found


def next_steps(per_core: dict[str, tuple[float, float | None]]) -> list[str]:
    """What the capacity rows say to add next, store by store, with their numbers."""
    lines = []
    if "sqlite" in per_core:
        lines.append(
            f"- **SQLite** decides in the app process: {per_core['sqlite'][0]:,.0f} decisions/s "
            "per app core, every worker of one host on one file. Its ceiling is that host; "
            "more hosts need a store server."
        )
    for name, what, then in (
        (
            "postgres",
            "One PostgreSQL server",
            "more cores on that server first (each connection is a process; a batch is one "
            "function call), then a second server (`--store` twice), each key at one home",
        ),
        (
            "redis",
            "One Redis server",
            "a Redis Cluster, whose primaries each take about one core's share of the slots",
        ),
        (
            "redis-cluster",
            "A Redis Cluster (3 primaries)",
            "more primaries: the keys spread over the slots, each primary about one core",
        ),
        (
            "postgres-2",
            "Two PostgreSQL servers",
            "a third server (about a third of the keys move to it) — note the CPU per "
            "decision here against one server: a batch splits per home, so each server's "
            "batches are smaller",
        ),
    ):
        app, store = per_core.get(name, (0.0, None))
        if store is None:
            continue
        lines.append(
            f"- **{what}**: one store core keeps up with {store / app:.1f} app cores "
            f"({store:,.0f} decisions/s against {app:,.0f} per app core). Past that: {then}."
        )
    lines.append(
        "- **A hot limit every request shares** (a global cap) is one counter on one "
        "server whatever the store: `Limit(..., slice=n)` decides it on each host from "
        'leased units, one round trip per `n` requests (docs/design.md, "Slices").'
    )
    return lines


# The per-host decision rate the capacity table counts hosts at.
HOST_RATE = 1_000


def _load(name: str) -> dict[str, Any] | None:
    path = ROOT / "benchmarks" / name
    return dict(json.loads(path.read_text())) if path.exists() else None


def section(title: str, lines: list[str]) -> list[str]:
    """A titled list, or nothing when the run measured none of its rows."""
    return [title, "", *lines, ""] if lines else []


def readme_block(
    report: dict[str, Any], curves: dict[str, Any] | None, cpu: dict[str, Any] | None
) -> str:
    """The README's block: the one-worker table, the realistic-handler rows, the peers."""
    io = io_rows(report)
    main_rows = [r for r in report["results"] if r["workers"] == 1 and r not in io]
    lines = [measured_line(report), "", results_table(main_rows), ""]
    if io:
        lines += [IO_INTRO, "", results_table(io), ""]
    lines += section("Against the peers, same run:", peer_lines(report))
    lines += run_lines(report, curves, cpu)
    return "<!-- results:start -->\n" + "\n".join(lines) + "\n<!-- results:end -->"


def main() -> None:
    report = _load("results.json")
    if report is None:
        raise SystemExit("benchmarks/results.json is missing: run benchmarks/bench.py first")
    curves = _load("curves.json")
    cpu = _load("cpu.json")
    readme = ROOT / "README.md"
    block = readme_block(report, curves, cpu)
    readme.write_text(
        re.sub(
            r"<!-- results:start -->.*?<!-- results:end -->",
            lambda _: block,
            readme.read_text(),
            flags=re.S,
        )
    )
    made = charts(report, curves)
    targets = target_lines(report, curves)
    met = sum(1 for t in targets if t.endswith("— met"))
    io = io_rows(report)
    doc = [
        "# Benchmarks",
        "",
        "Made by `./scripts/bench.sh`, which runs `benchmarks/bench.py` (the table), "
        "`benchmarks/curves.py` (the curves), `benchmarks/cpu.py` (where the CPU goes), "
        "`benchmarks/capacity.py` (the capacity model) and `benchmarks/render.py` (this "
        "page, the README's table and the charts); every number here comes from "
        "`benchmarks/results.json`, `benchmarks/curves.json`, `benchmarks/cpu.json` and "
        "`benchmarks/capacity.json`. Servers are real uvicorn processes (uvloop, httptools) "
        "pinned to CPU 0, wrk runs on CPU 1 (Redis and PostgreSQL too, for their rows); "
        "variants are interleaved round by round and each ratio is taken within a round. "
        "The machine is shared: compare ratios, not req/s across runs.",
        "",
        *run_lines(report, curves, cpu),
        "",
        "## Side by side",
        "",
        measured_line(report),
        "",
        results_table([r for r in report["results"] if r not in io]),
        "",
    ]
    if io:
        doc += [IO_INTRO, "", results_table(io), ""]
    doc += [
        "![throughput](img/throughput.png)",
        "",
        *section(
            "Connections per worker process in each round (sampled mid-run with `ss`), "
            "with that round's req/s:",
            split_lines(report),
        ),
        *section("Against the peers:", peer_lines(report)),
        f"The targets ({met} of {len(targets)} met):",
        "",
        *targets,
        "",
        BOUNDS,
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".",
        "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpus']} CPUs.",
        "",
    ]
    if cpu is not None:
        doc += cpu_text(cpu)
    if curves is not None:
        doc += curves_text(curves)
    capacity = _load("capacity.json")
    if capacity is not None:
        doc += capacity_text(capacity)
        made.append(capacity_chart(capacity))
    doc += ["", CHOICES]
    (ROOT / "docs" / "benchmarks.md").write_text("\n".join(doc))
    print("wrote README.md block, docs/benchmarks.md,", ", ".join(f"docs/img/{m}" for m in made))


if __name__ == "__main__":
    main()
