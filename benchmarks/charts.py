"""The charts of docs/benchmarks.md (docs/img/*.png), drawn with matplotlib.

benchmarks/render.py calls ``charts``; every value drawn comes from
benchmarks/results.json and benchmarks/curves.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def charts(report: dict[str, Any], curves: dict[str, Any] | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    rows = [r for r in report["results"] if r["workers"] == 1]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.25 * len(rows)))
    ax.barh([r["variant"] for r in rows][::-1], [r["rps"] for r in rows][::-1], color="#4a7")
    ax.set_xlabel("requests / second (median)")
    ax.set_title("Throughput, one worker, 64 connections")
    fig.tight_layout()
    fig.savefig(IMG / "throughput.png", dpi=110)
    plt.close(fig)
    made.append("throughput.png")
    if curves is None:
        return made
    conc = curves["concurrency"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [c["connections"] for c in conc]
    ax.plot(xs, [c["bare"]["rps"] for c in conc], "o-", label="bare")
    if all("bare-headers" in c for c in conc):  # curves.json from before it had the row
        ax.plot(xs, [c["bare-headers"]["rps"] for c in conc], "o-", label="bare + the headers")
    ax.plot(xs, [c["limiter"]["rps"] for c in conc], "o-", label="porch limiter")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("connections")
    ax.set_ylabel("requests / second")
    ax.set_title("Throughput against concurrency")
    ax.legend()
    fig.tight_layout()
    fig.savefig(IMG / "concurrency.png", dpi=110)
    plt.close(fig)
    made.append("concurrency.png")
    keys = curves["keys"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([k["keys"] for k in keys], [k["rps"] for k in keys], "o-", color="#a55")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("distinct client keys")
    ax.set_ylabel("requests / second")
    ax.set_title("porch limiter throughput against distinct keys")
    fig.tight_layout()
    fig.savefig(IMG / "keys.png", dpi=110)
    plt.close(fig)
    made.append("keys.png")
    samples = curves["churn"]["samples"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ts = [s["t"] for s in samples]
    ax.plot(ts, [s["db_mb"] for s in samples], "o-", label="store file + WAL (MB)")
    ax.plot(ts, [s["rss_mb"] for s in samples], "o-", label="process RSS (MB)")
    ax2 = ax.twinx()
    ax2.plot(
        ts,
        [s["requests"] / 1000 for s in samples],
        "--",
        color="gray",
        label="distinct clients so far (thousands)",
    )
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    ax.set_xlabel("seconds")
    ax.set_title(f"Churn: every request a new client, window {curves['churn']['window_s']:g} s")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(IMG / "churn.png", dpi=110)
    plt.close(fig)
    made.append("churn.png")
    return made


def capacity_chart(capacity: dict[str, Any]) -> str:
    """docs/img/capacity.png from benchmarks/capacity.json: decisions/s against app
    processes per store, and the CPU each side spends per decision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    points = capacity["points"]
    stores = list(dict.fromkeys(p["store"] for p in points))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in stores:
        mine = [p for p in points if p["store"] == name]
        left.plot([p["processes"] for p in mine], [p["rps"] for p in mine], "o-", label=name)
    left.set_xlabel("app processes")
    left.set_ylabel("decisions / second (this 2-core box)")
    left.set_ylim(bottom=0)
    left.set_title("Decisions per second, every process loaded")
    left.legend(fontsize=8)
    app = [median([p["app_cpu_us"] for p in points if p["store"] == n]) for n in stores]
    served = [median([p["store_cpu_us"] or 0.0 for p in points if p["store"] == n]) for n in stores]
    ys = range(len(stores))
    right.barh([y + 0.2 for y in ys], app, height=0.4, label="app processes", color="#4a7")
    right.barh([y - 0.2 for y in ys], served, height=0.4, label="store servers", color="#a55")
    right.set_yticks(list(ys), stores)
    right.invert_yaxis()
    right.set_xlabel("CPU µs per decision (median over process counts)")
    right.set_title("Where a decision's CPU goes")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMG / "capacity.png", dpi=110)
    plt.close(fig)
    return "capacity.png"


def median(values: list[float]) -> float:
    """The median of ``values`` (not empty)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
