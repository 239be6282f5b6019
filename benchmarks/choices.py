"""The figures behind design choices, for docs/benchmarks.md (render.py places them).

Each was measured once, when the choice was made, and says how; bench.sh does not
measure them again. docs/design.md states the choices and links here.
"""

from __future__ import annotations

__all__ = ["CHOICES"]

CHOICES = """## Design choices, measured

The figures behind choices that [the design](design.md) states. Each was measured once,
when the choice was made, on the same shared 2-CPU machine, and says with what; unlike
the sections above, `./scripts/bench.sh` does not measure them again. Where no script in
the repository reproduces a figure, it says so.

### PostgreSQL: four batches in flight

A hot counter's batches queue on its row lock, which each holds through its commit's WAL
flush. `limiter-postgres` with four batches out, interleaved with two on a loaded box:
0.44 → 0.60× bare, event-loop CPU per request 57.3 → 53.3 µs, about 0.06 transactions
per request at 64 connections (the command was not recorded).

### PostgreSQL: plans that never scan a table whole, and the caps' figures read once a batch

Found with `pg_stat_statements` (`track = all`) and `auto_explain` under
`idem-first-postgres`: PL/pgSQL kept generic plans made while the tables were empty, so a
batch of claims locked its rows through a sequential scan of every stored response (3 ms
a batch at 2,000 rows, growing with the table), its replay lookup read every live
response through `records_expires`, and `hits_v2` scanned every counter; and the quota
check, a function call and three statements for each claim and each save, took 47% of
the server's time in the function. The functions now run with sequential scans and JIT
off (`schema.py`'s `PLANNER`), the replay lookup is a `LIMIT 1` per key, and each cap's
figure is read once a batch and kept up to date with the batch's own changes
(`function.py`'s `_OVER`). `python benchmarks/ab.py --base <the commit before> --variants
bare-post,idem-first-postgres,idem-replay-postgres --connections 64 --rounds 3 --duration
4` (the first run with `bare,bare-headers,limiter-postgres` too; 2026-12-04, medians of 3
interleaved rounds, req/s):

| change (base) | idem-first-postgres | its rounds | idem-replay-postgres |
|---|---:|---:|---:|
| the plans (0e41ba5) | 1,477 → 2,148 (+45%) | +27 to +69% | 15,314 → 16,070 |
| the caps' figures once a batch (e25f00b) | 2,270 → 3,781 (+67%) | +51 to +67% | 18,077 → 18,309 |

`limiter-postgres` in the first run: 15,146 → 16,006 (rounds −16%, +5%, +10%: within its
spread). The PostgreSQL server's CPU a first execution (its processes' CPU time over the
requests served in 5 s at 64 connections, with `pg_stat_statements` and `auto_explain`
loaded; a probe not kept in the repository): 806 µs, 396 µs after the plans, 224 µs
after the caps' figures. The server shares its CPU with the load generator, so that CPU
bounds the row.

### PostgreSQL and Redis: the batch functions of the policies

Against the fixed-window functions and script they replaced (`python benchmarks/ab.py
--base 878651f --variants bare,limiter-postgres,limiter-redis --connections 64 --rounds 6
--duration 5`, medians of 6 interleaved rounds):

- `limiter-postgres`: 7,492 against 6,460 requests/s, event loop 56.3 against 62.7 µs a
  request; an earlier run of 5 rounds had it the other way, 2,698 against 2,985.
- `limiter-redis`: 8,972 against 8,430 requests/s, event loop 61.5 against 62.2 µs a
  request; the earlier run 2,793 against 3,338.

Both the same within the box's noise. Batches per request at 64 connections: about 0.06
transactions for `limiter-postgres` (four batches out: smaller ones), 0.02 for
`idem-replay-postgres`, 0.05-0.07 for `idem-first-postgres` (a claim and a save per
request); 0.03 pipelines for `limiter-redis`.

### PostgreSQL: the driver

asyncpg and psycopg 3 side by side (`python benchmarks/pgdriver.py`: porch's own call,
`hits_v1` on the real schema, 4 calls in flight from one uvloop loop pinned to the app's
core, 3 interleaved rounds; 2026-12-01). Calls per second are the same within noise (the
server's commit and WAL flush bound them): 2,631 against 2,491 for one hot client, 1,672
against 1,737 for 16 clients. The event loop spends 44.6 µs per call with asyncpg against
112.0 µs with psycopg (text; 111.0 binary) for one hot client, and 71.1 against 183.5
(176.0) for 16 clients.

### PostgreSQL: how soon a dead or frozen holder's keys come free

With the default `lease=3.0` (renewed every second): a `kill -9`ed holder's key was
claimable again 2.0-3.1 s after its death, and a SIGSTOPped holder's claim was taken over
2.0 s after its last renewal (observations, no script). Session advisory locks, measured
as the alternative, were free about 55 ms after `kill -9`, but stay held by a frozen or
cut-off host until TCP keepalive gives up (about 2 h by default). Slots: in the gate
(`tests/e2e/test_gate_hosts.py`, a host killed -9 holding two slots) the other host's
next checkout passed 2.9 s after the kill.

### SQLite: page size and WAL size

Smaller pages for new files: a new client dirties one random leaf per commit, and at 2048
bytes the writer and checkpoint spent about 2 µs less per new client in process (5 of 5
rounds; at 1024 bytes about the same: deeper trees and more splits take back what the
smaller frames save), within the noise over HTTP (keys-1000000: +0.5% and +3%, 4 of 6
rounds ahead). But a stored response spans twice the overflow pages: claim+save +9% and
lookup +23% for an 8 KB body, +16% and +40% at 40 KB (1024 bytes: +16%/+38% and
+29%/+89%). A 4 MiB WAL limit instead of 16 MiB lost 2.7% on keys-1000000 at 64
connections (3 of 3 rounds). No script reproduces the in-process figures.

### SQLite: compact counter rows

The bounded prune, planned by SQLite as one `DELETE ... WHERE (name, client) IN (SELECT
...)`, searched on `name` alone: 46 ms per batch with 200k live clients, against 0.5 ms
reading the expired keys first and deleting each by its primary key. An IPv4 client's row
is about a third of the full-key row: 628 pages for 52k clients without the `expires`
index, 1004 with it, against 1880 for the full text key with its index. Both measured in
process, once; no script.

### SQLite: how many hits commit on the event loop

With `durability="process"`, the hits of one loop iteration that arrive while the writer
is idle commit on the loop, up to `INLINE_OPS` of them (`porch/store/sqlite/writer.py`);
more go to the writer thread. `python benchmarks/ab.py --base HEAD --variants
bare,bare-headers,limiter --connections 16,64,256 --rounds 5 --duration 4 --env
BENCH_INLINE_OPS=N` against the then cap of 4 (2026-12-04, a quiet machine, medians of 5
interleaved rounds, `limiter` req/s):

| cap | 16 connections | 64 connections | 256 connections | p99 at 64 |
|---|---:|---:|---:|---:|
| 4 (run of 16) | 14,769 | 18,308 | 17,642 | 7.74 ms |
| 16 | 15,819 (+7%; every round +5 to +20%) | 18,453 (+1%) | 17,938 (+2%) | 6.79 ms |
| 4 (run of 64) | 13,979 | 18,133 | 15,832 | 8.82 ms |
| 64 | 15,601 (+12%) | 18,385 (+1%) | 16,994 (+7%: −3 to +14%) | 9.69 ms |

At 64 connections neither cap moves the throughput (the loop's CPU bounds it either way;
with the cap at 64 the writer's 4 µs a request move onto the loop). 16 keeps the gain at
16 connections, and the loop's longest inline commit a quarter of 64's: 16, the default.
The rows with a second store operation a request, with 16 against 4 (`ab.py --base
954c8a0 --variants bare,limiter,limiter-settle,limiter-concurrency --connections 16,64
--rounds 3 --duration 4`, medians): `limiter-settle` 8,151 -> 8,768 req/s at 16
connections (+8%), 9,678 -> 9,809 at 64 (+1%); `limiter-concurrency` 7,977 -> 9,332 at 16
(+17%), 9,917 -> 9,364 at 64 (-6%; rounds -11%, +8%, -6%: within their spread).
"""
