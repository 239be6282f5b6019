"""What ``porch demo`` can be told, and how its worker processes are told it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from ..errors import ConfigurationError
from ..store import SQLiteStore, Store, open_store
from ..store.base import Durability

__all__ = ["CONFIG_ENV", "DemoConfig"]

# The CLI passes the config to uvicorn's worker processes in this variable.
CONFIG_ENV = "PORCH_DEMO_CONFIG"


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
    store: str | None = None  # a store URL (see porch.open_store); None: SQLite in data_dir

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

    def open_store(self) -> Store:
        """The store for counters and stored responses (not opened yet).

        ``--durability`` is the SQLite store's setting; a network store keeps its
        server's own durability.
        """
        if self.store is None:
            return SQLiteStore(self.data_dir, durability=self.durability)
        if self.store.lower().startswith("sqlite:"):
            return open_store(self.store, durability=self.durability)
        return open_store(self.store)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> DemoConfig:
        raw = os.environ.get(CONFIG_ENV)
        return cls(**json.loads(raw)) if raw else cls()
