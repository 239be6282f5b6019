"""``porch inspect | reset | forget | purge | check``: the operator's commands, for any store.

Each takes ``--data-dir D`` (the SQLite file ``D/porch.sqlite3``, as ``porch
demo`` uses it) or ``--store URL`` and speaks only the admin protocol of
:mod:`porch.store.admin`, beside running servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ConfigurationError, StoreError
from ..store.admin import StoreAdmin
from ..store.base import Store
from ..store.urls import redact

__all__ = ["COMMANDS", "add_parsers", "run"]

COMMANDS = ("inspect", "reset", "forget", "purge", "check")

T = TypeVar("T")


def _target(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--data-dir",
        default=None,
        help="the data directory (its porch.sqlite3); default ./porch-data",
    )
    where.add_argument(
        "--store",
        default=None,
        action="append",
        help="a store URL (sqlite:///path/file.sqlite3, ...); given once per server of a"
        " sharded store (PostgreSQL or Redis), every command works on them all",
    )


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def add_parser(name: str, help: str) -> argparse.ArgumentParser:
        # The same sentence in `porch --help` and in `porch NAME --help`.
        return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")

    p = add_parser("inspect", "list live counters and stored responses")
    _target(p)
    p.add_argument("--client", default=None, help="only this client (its counters and responses)")
    _json(p)
    p.add_argument("--max", type=int, default=1000, help="at most this many of each (default 1000)")
    p = add_parser(
        "reset",
        help="delete a client's counters: it is served again within ~1 s (the limiters'"
        " refusal memory); exit 1 if it has none",
    )
    _target(p)
    p.add_argument("--client", required=True, help="the client key (e.g. its address)")
    p.add_argument("--rule", default=None, help="only this rule's counters")
    _json(p)
    p = add_parser(
        "forget",
        help="forget one stored idempotency response: the next request with its key runs"
        " the handler; exit 1 if there is none",
    )
    _target(p)
    p.add_argument(
        "--scope", required=True, help="the caller scope, as porch inspect shows it (client:ADDR)"
    )
    p.add_argument("--key", required=True, help="the Idempotency-Key")
    _json(p)
    p = add_parser("purge", "delete expired counters and stored responses")
    _target(p)
    _json(p)
    p = add_parser("check", "schema version and integrity; exit 1 when damaged")
    _target(p)
    _json(p)


def _admin(args: argparse.Namespace) -> StoreAdmin:
    from ..store import SQLiteStore, open_store

    if args.store:
        return _admin_of(open_store(args.store[0] if len(args.store) == 1 else args.store))
    return _admin_of(SQLiteStore(Path(args.data_dir or "./porch-data")))


def run(args: argparse.Namespace) -> int:
    """Run one operator command; return the exit status."""
    name = f"porch {args.command}"
    try:
        admin = _admin(args)
    except ConfigurationError as exc:
        print(f"{name}: {redact(str(exc))}", file=sys.stderr)
        return 2
    command: Callable[[StoreAdmin, argparse.Namespace], Awaitable[int]] = _COMMANDS[args.command]
    try:
        return asyncio.run(_closing(admin, command(admin, args)))
    except StoreError as exc:
        print(f"{name}: {redact(str(exc))}", file=sys.stderr)
        return 2


async def _closing(admin: StoreAdmin, work: Awaitable[T]) -> T:
    try:
        return await work
    finally:
        await admin.close()


async def _inspect(admin: StoreAdmin, args: argparse.Namespace) -> int:
    if args.max < 1:
        raise StoreError(f"--max must be >= 1, got {args.max}")
    counters = await admin.counters(client=args.client, most=args.max)
    responses = await admin.responses(client=args.client, most=args.max)
    if args.json:
        document: dict[str, Any] = {
            "store": redact(admin.location),
            "counters": [
                {
                    "client": c.client,
                    "rule": c.rule,
                    "limit": c.limit,
                    "count": c.count,
                    "reset_in": round(c.reset_in, 3),
                }
                for c in counters
            ],
            "responses": [
                {
                    "scope": r.scope,
                    "key": r.key,
                    "status": r.status,
                    "size": r.size,
                    "expires_in": round(r.expires_in, 3),
                    "expires_at": round(r.expires_at, 3),
                }
                for r in responses
            ],
            "truncated": len(counters) >= args.max or len(responses) >= args.max,
        }
        print(json.dumps(document, indent=2, ensure_ascii=False))
        return 0
    print(f"store: {shown(redact(admin.location))}")
    print(f"counters ({len(counters)}):")
    for c in counters:
        print(
            f"  {shown(c.client)}  rule={shown(c.rule)}/{shown(c.limit)}  count={c.count}"
            f"  reset_in={c.reset_in:.0f}s"
        )
    print(f"stored responses ({len(responses)}):")
    for r in responses:
        print(
            f"  {shown(r.scope)}  key={r.key!r}  status={r.status}  {r.size} bytes"
            f"  expires_in={r.expires_in:.0f}s"
        )
    return 0


def shown(text: str) -> str:
    """``text`` safe for an operator's terminal: a client key or scope comes from a key
    function that may return request text, so control characters (terminal escapes, a
    bidi override) and backslashes are written as Python escapes, the rest as is."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in text)


async def _reset(admin: StoreAdmin, args: argparse.Namespace) -> int:
    n = await admin.reset(client=args.client, rule=args.rule)
    which = f" of rule {args.rule!r}" if args.rule else ""
    if args.json:
        print(json.dumps({"client": args.client, "rule": args.rule, "deleted": n}))
    elif n:
        print(f"deleted {n} counter(s){which} of client {shown(args.client)!r}")
    if not n:
        # Nothing to reset is most often a mistyped key (a port, another /64): say so.
        print(
            f"porch reset: client {shown(args.client)!r} has no live counter{which}"
            " (porch inspect lists the clients)",
            file=sys.stderr,
        )
        return 1
    return 0


async def _forget(admin: StoreAdmin, args: argparse.Namespace) -> int:
    n = await admin.forget(scope=args.scope, key=args.key)
    if args.json:
        print(json.dumps({"scope": args.scope, "key": args.key, "forgotten": n}))
    elif n:
        print(f"forgot the stored response of key {shown(args.key)!r} of {shown(args.scope)}")
    if not n:
        print(
            f"porch forget: no live stored response for key {shown(args.key)!r} in scope"
            f" {shown(args.scope)!r} (porch inspect lists them)",
            file=sys.stderr,
        )
        return 1
    return 0


async def _purge(admin: StoreAdmin, args: argparse.Namespace) -> int:
    report = await admin.purge()
    if args.json:
        print(json.dumps({"counters": report.counters, "responses": report.responses}))
        return 0
    print(
        f"deleted {report.counters} expired counter(s) and {report.responses} expired response(s)"
    )
    return 0


async def _check(admin: StoreAdmin, args: argparse.Namespace) -> int:
    report = await admin.check()
    if args.json:
        print(
            json.dumps(
                {
                    "store": redact(report.location),
                    "healthy": report.healthy,
                    "schema_version": report.schema_version,
                    "expected_version": report.expected_version,
                    "problems": [redact(p) for p in report.problems],
                },
                ensure_ascii=False,
            )
        )
        return 0 if report.healthy else 1
    if report.healthy:
        print(f"{redact(report.location)}: ok (schema version {report.schema_version})")
        return 0
    print(f"{redact(report.location)}: NOT HEALTHY", file=sys.stderr)
    for problem in report.problems:
        print(f"  {shown(redact(problem))}", file=sys.stderr)
    return 1


_COMMANDS: dict[str, Callable[[StoreAdmin, argparse.Namespace], Awaitable[int]]] = {
    "inspect": _inspect,
    "reset": _reset,
    "forget": _forget,
    "purge": _purge,
    "check": _check,
}


def _admin_of(store: Store) -> StoreAdmin:
    """The store's admin; ConfigurationError if its backend offers none."""
    admin = store.capabilities.admin
    if admin is None:
        raise ConfigurationError(
            f"the {type(store).__name__} backend does not offer porch's admin protocol"
        )
    return admin()
