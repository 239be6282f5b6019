"""What ``porch demo`` can be told, and how its worker processes are told it."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass

from ..errors import ConfigurationError
from ..ratelimit._rules import Limit
from ..store import SQLiteStore, Store, open_store
from ..store.base import ALGORITHMS, Algorithm, Durability

__all__ = ["CONFIG_ENV", "DemoConfig"]

# The CLI passes the config to uvicorn's worker processes in this variable.
CONFIG_ENV = "PORCH_DEMO_CONFIG"
_PLAN = re.compile(r"[A-Za-z0-9_]{1,32}\Z")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Everything ``porch demo`` can be told."""

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: str = "./porch-data"
    limit: int = 60
    window: float = 60.0
    pool_size: int | None = None  # None: the store's own shard count (KeyPool)
    mailbox: int = 1024
    checkout_latency: float = 0.0
    max_in_flight: int | None = None  # a cap on one client's POST /orders in flight
    max_stored: int = 1 << 20  # the largest response stored for replay (IdempotencyPolicy)
    trust_proxy_hops: int = 0
    workers: int = 1
    uds: str | None = None  # a unix socket to listen on, instead of host and port
    worker_header: bool = False  # X-Demo-Worker: <pid> on every response (multi-worker tests)
    durability: Durability = "process"
    # A store URL (see porch.open_store), or several (--store once per server: a sharded
    # store); None: SQLite in data_dir.
    store: str | tuple[str, ...] | None = None
    # --previous-store: of several --store URLs, the servers there before others were added.
    previous_store: tuple[str, ...] = ()
    algorithm: Algorithm = "fixed"  # of the --limit/--window rule (and --global-limit)
    burst: int | None = None  # gcra's burst of the per-client limit (None: the limit)
    global_limit: int | None = None  # every client together, per window (a second level)
    global_slice: int | None = None  # --global-limit's units a host leases at a time
    token_budget: int = 10_000  # POST /completions: tokens per client per window
    plans: str | None = None  # "free=5/minute,pro=50/minute": limits by bearer token's plan

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigurationError(f"--port must be 0-65535, got {self.port}")
        if self.checkout_latency < 0:
            raise ConfigurationError(
                f"--checkout-latency must be >= 0, got {self.checkout_latency}"
            )
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ConfigurationError(f"--max-in-flight must be >= 1, got {self.max_in_flight}")
        if self.max_stored < 0:
            raise ConfigurationError(f"--max-stored must be >= 0 bytes, got {self.max_stored}")
        if self.trust_proxy_hops < 0:
            raise ConfigurationError(
                f"--trust-proxy-hops must be >= 0, got {self.trust_proxy_hops}"
            )
        if self.workers < 1:
            raise ConfigurationError(f"--workers must be >= 1, got {self.workers}")
        if self.algorithm not in ALGORITHMS:
            raise ConfigurationError(
                f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}"
            )
        if self.burst is not None and (self.algorithm != "gcra" or self.burst < 1):
            raise ConfigurationError(
                f"--burst takes an integer >= 1 with --algorithm gcra, got {self.burst}"
                f" with {self.algorithm}"
            )
        if self.global_limit is not None and self.global_limit < 1:
            raise ConfigurationError(f"--global-limit must be >= 1, got {self.global_limit}")
        if self.global_slice is not None:
            if self.global_limit is None or not 1 <= self.global_slice <= self.global_limit:
                raise ConfigurationError(
                    f"--global-slice takes 1 to --global-limit units, got {self.global_slice}"
                    f" with --global-limit {self.global_limit}"
                )
            if (
                self.algorithm != "fixed"
                or self.plans is not None
                or self.max_in_flight is not None
            ):
                raise ConfigurationError(
                    "--global-slice takes fixed windows, without --plans or --max-in-flight"
                    " (the store decides those with every limit together)"
                )
        if self.token_budget < 1:
            raise ConfigurationError(f"--token-budget must be >= 1, got {self.token_budget}")
        self.plan_limits()  # a bad --plans is refused here, by the CLI

    def plan_limits(self) -> dict[str, tuple[Limit, ...]]:
        """``--plans`` read: each plan's limits by name (empty without the flag).

        ``name=rates`` pairs separated by ``,``; a plan of several rates separates them
        by ``;`` (``"free=5/minute;100/day,pro=50/minute sliding"``). A name is letters,
        digits and ``_``: a bearer token is ``<plan>-<rest>``.
        """
        if self.plans is None:
            return {}
        found: dict[str, tuple[Limit, ...]] = {}
        for item in self.plans.split(","):
            name, sep, rates = item.strip().partition("=")
            if not sep or not _PLAN.match(name) or name in found:
                raise ConfigurationError(
                    f"--plans takes 'name=rate[;rate...]' pairs separated by ',' with distinct"
                    f" names of letters, digits and _, e.g. 'free=5/minute,pro=50/minute';"
                    f" got {item.strip()!r}"
                )
            try:
                found[name] = Limit.parse(rates)
            except ConfigurationError as exc:
                raise ConfigurationError(f"--plans: plan {name!r}: {exc}") from None
        return found

    def open_store(self) -> Store:
        """The store for counters and stored responses (not opened yet).

        ``--durability`` is the SQLite store's setting; a network store keeps its
        server's own durability.
        """
        if self.store is None:
            return SQLiteStore(self.data_dir, durability=self.durability)
        if not isinstance(self.store, str):
            return open_store(list(self.store), previous=list(self.previous_store))
        if self.previous_store:
            raise ConfigurationError("--previous-store needs --store given once per server")
        if self.store.lower().startswith("sqlite:"):
            return open_store(self.store, durability=self.durability)
        return open_store(self.store)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> DemoConfig:
        raw = os.environ.get(CONFIG_ENV)
        if not raw:
            return cls()
        fields = json.loads(raw)
        if isinstance(fields.get("store"), list):  # several URLs: JSON has no tuples
            fields["store"] = tuple(fields["store"])
        fields["previous_store"] = tuple(fields.get("previous_store", ()))
        return cls(**fields)
