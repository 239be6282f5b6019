"""Draw the README's performance table from benchmarks/results.json.

    python benchmarks/render.py      # rewrites the block between the results markers
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def table(report: dict) -> str:  # type: ignore[type-arg]
    lines = [
        f"Measured {report['date'][:10]} on {report['machine']['cpus']} CPUs "
        f"({report['load_generator']}, {report['connections']} connections, "
        f"{report['rounds']} rounds × {report['duration_s']} s, medians; "
        f"command: `{report['command'].strip()}`).",
        "",
        "| variant | what | req/s | ratio | p50 ms | p99 ms | added p99 ms | store txn / request |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        ratio = f"{r['ratio_to_bare']:.2f}× {r['baseline']}" if r["variant"] != r["baseline"] else "1"
        added = "" if r["variant"] == r["baseline"] else f"{r['added_p99_ms']:+.2f}"
        lines.append(
            f"| {r['variant']} | {r['what']} | {r['rps']:,.0f} | {ratio} | {r['p50_ms']:.2f} "
            f"| {r['p99_ms']:.2f} | {added} | {r['txn_per_request']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    report = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    readme = ROOT / "README.md"
    text = readme.read_text()
    block = f"<!-- results:start -->\n{table(report)}\n<!-- results:end -->"
    readme.write_text(
        re.sub(r"<!-- results:start -->.*?<!-- results:end -->", lambda _: block, text, flags=re.S)
    )


if __name__ == "__main__":
    main()
