"""The porch command line: the storefront demo, and the operator's commands on a store."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigurationError
from ..store.urls import redact

__all__ = ["main"]

# What `porch demo` imports, checked before anything is imported.
DEMO_NEEDS = ("uvicorn", "starlette", "prometheus_client")


def missing_modules(names: Sequence[str]) -> list[str]:
    """The top-level modules among ``names`` that cannot be imported here."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo", help="serve the storefront demo (SQLite, or the store --store names)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--data-dir",
        default="./porch-data",
        help="this host's orders; also counters and stored responses unless --store is given",
    )
    p.add_argument(
        "--store",
        default=None,
        action="append",
        metavar="URL",
        help="counters and stored responses in this store: sqlite:///path/file.sqlite3,"
        " postgresql://user@host:port/db, redis://host:port/db (shared by several hosts);"
        " given once per server (PostgreSQL or Redis), a store over them all, each key at"
        " one of them",
    )
    p.add_argument(
        "--previous-store",
        default=[],
        action="append",
        metavar="URL",
        help="after adding servers: one of the --store URLs that was there before (once per"
        " old server); a stored response whose home moved is replayed from it until it"
        " expires (docs/stores/sharding.md)",
    )
    p.add_argument("--limit", type=int, default=60, help="requests per window per client")
    p.add_argument("--window", type=float, default=60.0, help="window length in seconds")
    p.add_argument(
        "--algorithm",
        choices=("fixed", "sliding", "gcra"),
        default="fixed",
        help="how --limit counts: fixed windows, a sliding window, or gcra (a token bucket)",
    )
    p.add_argument(
        "--burst",
        type=int,
        default=None,
        metavar="N",
        help="gcra's bucket size (default: --limit)",
    )
    p.add_argument(
        "--global-limit",
        type=int,
        default=None,
        metavar="N",
        help="also N requests per window for every client together (a second level)",
    )
    p.add_argument(
        "--global-slice",
        type=int,
        default=None,
        metavar="N",
        help="decide --global-limit on each host from N units it leases at a time: fewer"
        " store round trips, never over the limit, under it by at most N per host",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=10_000,
        metavar="N",
        help="POST /completions: tokens per window per client, reserved then settled",
    )
    p.add_argument(
        "--plans",
        default=None,
        metavar="PLANS",
        help="limits by plan, e.g. 'free=5/minute,pro=50/minute': a request with"
        " 'Authorization: Bearer <plan>-<rest>' is limited by that plan under that token",
    )
    p.add_argument(
        "--pool-size",
        type=int,
        default=None,
        help="shard actors in the key pool (default: the store's: 1 for SQLite, else 4)",
    )
    p.add_argument("--mailbox", type=int, default=1024, help="queued operations per shard")
    p.add_argument(
        "--checkout-latency",
        type=float,
        default=0.0,
        help="simulated delay inside POST /orders (the payment provider) and"
        " POST /completions (the model), seconds",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        metavar="N",
        help="at most N requests of one client in flight on POST /orders (the next is 429"
        " with Retry-After; that route then counts --limit on a counter of its own)",
    )
    p.add_argument(
        "--max-stored",
        type=int,
        default=1 << 20,
        metavar="BYTES",
        help="the largest response stored for replay (POST /exports answers up to 100 MiB)",
    )
    p.add_argument(
        "--trust-proxy-hops",
        type=int,
        default=0,
        help="proxies in front whose X-Forwarded-For entries are trusted",
    )
    p.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="listen on this unix socket instead of --host/--port (behind a local proxy)",
    )
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument(
        "--worker-header",
        action="store_true",
        help="name the worker process (its pid) in X-Demo-Worker on every response (tests)",
    )
    p.add_argument(
        "--durability",
        choices=("process", "power"),
        default="process",
        help="'process' survives kill -9; 'power' also syncs every group commit",
    )


def main(argv: Sequence[str] | None = None) -> int:
    from .. import __version__
    from . import _operator as operator

    parser = argparse.ArgumentParser(prog="porch", description=__doc__)
    parser.add_argument("--version", action="version", version=f"porch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_parser(sub)
    operator.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command in operator.COMMANDS:
        return operator.run(args)
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2


def _demo(args: argparse.Namespace) -> int:
    missing = missing_modules(DEMO_NEEDS)
    if missing:
        # A message naming the extra, not a traceback from deep inside an import.
        print(f"porch demo needs {', '.join(missing)}: pip install 'porch[demo]'", file=sys.stderr)
        return 2
    import uvicorn

    from ..demo.config import CONFIG_ENV, DemoConfig
    from ..pool._pool import KeyPool
    from ..ratelimit._rules import Limit

    try:
        config = DemoConfig(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            limit=args.limit,
            window=args.window,
            pool_size=args.pool_size,
            mailbox=args.mailbox,
            checkout_latency=args.checkout_latency,
            max_in_flight=args.max_in_flight,
            max_stored=args.max_stored,
            trust_proxy_hops=args.trust_proxy_hops,
            workers=args.workers,
            worker_header=args.worker_header,
            uds=args.uds,
            durability=args.durability,
            store=_stores(args.store),
            previous_store=tuple(args.previous_store),
            algorithm=args.algorithm,
            burst=args.burst,
            global_limit=args.global_limit,
            global_slice=args.global_slice,
            token_budget=args.token_budget,
            plans=args.plans,
        )
        # Validate everything once here, so a bad flag is a message, not a worker traceback.
        Limit(config.limit, config.window, algorithm=config.algorithm, burst=config.burst)
        store = config.open_store()
        KeyPool(store, size=config.pool_size, mailbox=config.mailbox)
        offered = store.capabilities.algorithms
        asked = {config.algorithm} | {
            limit.algorithm for found in config.plan_limits().values() for limit in found
        }
        if not asked <= offered:
            raise ConfigurationError(
                f"{type(store).__name__} does not decide {', '.join(sorted(asked - offered))}"
                f" limits (it offers {', '.join(sorted(offered))})"
            )
    except (ConfigurationError, ValueError) as exc:
        print(f"porch demo: {redact(str(exc))}", file=sys.stderr)
        return 2
    os.environ[CONFIG_ENV] = config.to_env()
    metrics_dir = None
    if config.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Every worker writes its metrics here; GET /metrics on any of them sums them all.
        _remove_stale_metrics_dirs()
        metrics_dir = tempfile.mkdtemp(prefix=f"{_METRICS_PREFIX}{os.getpid()}-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    shown = config.store if isinstance(config.store, str) else " + ".join(config.store or ())
    where = f"orders in {os.path.abspath(config.data_dir)}, store {shown}"
    if config.store is None:
        where = f"data in {os.path.abspath(config.data_dir)}"
    address = f"unix:{config.uds}" if config.uds else f"http://{config.host}:{config.port}"
    policy = f"limit {config.limit} per {config.window:g}s per client"
    if config.algorithm != "fixed":
        policy += f" ({config.algorithm})"
    if config.global_limit is not None:
        policy += f", {config.global_limit} for everyone"
        if config.global_slice is not None:
            policy += f" (leased {config.global_slice} at a time)"
    print(
        f"porch demo serving on {address} ({redact(where)}, {policy})",
        flush=True,
    )
    try:
        uvicorn.run(
            "porch.demo:create_app_from_env",
            factory=True,
            host=config.host,
            port=config.port,
            uds=config.uds,
            workers=config.workers if config.workers > 1 else None,
            log_level="warning",
            access_log=False,
            # uvicorn would otherwise rewrite the peer address from X-Forwarded-For
            # for loopback connections: who to trust is --trust-proxy-hops' decision.
            proxy_headers=False,
        )
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


_METRICS_PREFIX = "porch-metrics-"


def _remove_stale_metrics_dirs() -> None:
    """Remove the metrics directories of demos killed before they could (kill -9)."""
    root = Path(tempfile.gettempdir())
    for path in root.glob(_METRICS_PREFIX + "*-*"):
        pid = path.name[len(_METRICS_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its demo is gone
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # alive (another user's), or unknowable: leave it
            pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def _stores(given: list[str] | None) -> str | tuple[str, ...] | None:
    """``--store`` as given: none, one URL, or several (one per server)."""
    if not given:
        return None
    return given[0] if len(given) == 1 else tuple(given)
