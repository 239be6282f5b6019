"""Prometheus metrics for porch (optional: ``pip install 'porch[metrics]'``).

Nothing here is global: a :class:`PorchMetrics` owns its registry (a fresh one
unless you pass yours), and only the pools and middlewares it is handed to
report into it. Without one, porch pays one ``is None`` check per request.

Multiprocess mode: when ``PROMETHEUS_MULTIPROC_DIR`` is set (before
``prometheus_client`` is first imported — ``porch demo --workers N`` sets it for
its workers), every process writes its values to files there and a scrape of
any worker reports the sum over all of them.

Mount the endpoint in one line (and exempt it from the limiter)::

    app.router.routes.append(Route("/metrics", metrics.asgi_app()))
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from .errors import ConfigurationError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from ._types import ASGIApp, Receive, Scope, Send

__all__ = [
    "FUNCTION_OUTCOMES",
    "IDEMPOTENCY_OUTCOMES",
    "UNAVAILABLE_CAUSES",
    "UNSTORED_REASONS",
    "PorchMetrics",
    "Watched",
]


class Watched(Protocol):
    """What the metrics read from a key pool they watch (a KeyPool is one)."""

    def shard_load(self) -> list[tuple[int, int]]:
        """Per shard: operations queued in its mailbox, and calls parked behind an owner."""
        ...


IDEMPOTENCY_OUTCOMES = (
    "executed",
    "replayed",
    "mismatch",
    "conflict",
    "invalid",
    "too_large",
    "quota",
    "integrity",
)
#: What became of one call of an idempotent function (each call counts once): ``executed``
#: (it ran and its result is stored), ``failed`` (it ran and raised: nothing stored, the
#: next call runs it), ``unstored`` (it ran and returned, but its result was not stored:
#: over ``max_stored``, its claim lost, or the store failed; a retry runs it again),
#: ``replayed`` (the stored result was returned), ``mismatch`` (KeyReusedError),
#: ``conflict`` (KeyInProgressError), ``quota`` (QuotaFullError: refused before it ran),
#: ``integrity`` (IntegrityError), ``unavailable`` (the pool could not decide: saturated,
#: the store failed or the pool was closed).
FUNCTION_OUTCOMES = (
    "executed",
    "failed",
    "unstored",
    "replayed",
    "mismatch",
    "conflict",
    "quota",
    "integrity",
    "unavailable",
)
UNAVAILABLE_CAUSES = ("saturated", "store", "unidentified", "quota", "integrity")
UNSTORED_REASONS = ("quota", "fenced")

_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_COMMIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_OPS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError(
            "porch metrics need prometheus_client: pip install 'porch[metrics]'"
        ) from exc
    return prometheus_client


class PorchMetrics:
    """The counters, histograms and gauges porch reports, in one registry.

    ``registry``: where the metrics are registered and what :meth:`asgi_app`
    serves (default: a new ``CollectorRegistry``; pass
    ``prometheus_client.REGISTRY`` to share the global one). In multiprocess
    mode the served registry collects the files of every process instead.
    """

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        prom = _prometheus()
        self.multiprocess = bool(os.environ.get(_MULTIPROC_ENV))
        if self.multiprocess:
            from prometheus_client import multiprocess

            # Values live in files; the served registry sums every process's files.
            served = prom.CollectorRegistry()
            multiprocess.MultiProcessCollector(served)  # type: ignore[no-untyped-call]
            target = None
        else:
            served = registry if registry is not None else prom.CollectorRegistry()
            target = served
        self.registry: CollectorRegistry = served
        self.ratelimit_requests = prom.Counter(
            "porch_ratelimit_requests",
            "Rate-limited requests decided, by rule and outcome (allowed, refused).",
            ["rule", "outcome"],
            registry=target,
        )
        self.idempotency_requests = prom.Counter(
            "porch_idempotency_requests",
            "Keyed requests, by outcome (executed, replayed, mismatch, conflict, invalid,"
            " too_large, quota, integrity).",
            ["outcome"],
            registry=target,
        )
        self.responses_unstored = prom.Counter(
            "porch_idempotency_unstored",
            "Owners' responses sent but not stored, by reason (quota: the caller's or the"
            " store's quota was full; fenced: the owner had lost its claim).",
            ["reason"],
            registry=target,
        )
        self.unavailable = prom.Counter(
            "porch_unavailable",
            "Requests answered 503, by cause (saturated, store, unidentified, quota, integrity).",
            ["cause"],
            registry=target,
        )
        self.function_calls = prom.Counter(
            "porch_idempotent_function_calls",
            "Calls of idempotent functions, by function and outcome (executed, failed,"
            " unstored, replayed, mismatch, conflict, quota, integrity, unavailable).",
            ["function", "outcome"],
            registry=target,
        )
        self.function_waits = prom.Counter(
            "porch_idempotent_function_waits",
            "Calls of idempotent functions that waited for another call of their key"
            " (then got its result, ran after it failed, or gave up: conflict).",
            ["function"],
            registry=target,
        )
        self.commit_seconds = prom.Histogram(
            "porch_store_commit_seconds",
            "Seconds a shard waited for its group commit (one store transaction).",
            registry=target,
            buckets=_COMMIT_BUCKETS,
        )
        self.commit_operations = prom.Histogram(
            "porch_store_operations_per_commit",
            "Store operations applied in one group commit.",
            registry=target,
            buckets=_OPS_BUCKETS,
        )
        # Children bound once: the hot path increments, it never looks labels up.
        self.idempotency = {o: self.idempotency_requests.labels(o) for o in IDEMPOTENCY_OUTCOMES}
        self.causes = {c: self.unavailable.labels(c) for c in UNAVAILABLE_CAUSES}
        self.unstored = {r: self.responses_unstored.labels(r) for r in UNSTORED_REASONS}
        self._pools: list[Watched] = []
        self._depth: Any = None
        self._parked: Any = None
        if self.multiprocess:
            # Other processes' queues cannot be read at scrape time: each shard
            # publishes its own after every group commit; dead processes drop out.
            self._depth = prom.Gauge(
                "porch_mailbox_depth",
                "Operations queued in the shard mailboxes.",
                ["shard"],
                registry=None,
                multiprocess_mode="livesum",
            )
            self._parked = prom.Gauge(
                "porch_parked_waiters",
                "Duplicate requests parked behind a running idempotency owner.",
                ["shard"],
                registry=None,
                multiprocess_mode="livesum",
            )
        else:
            served.register(_PoolCollector(self._pools))

    def ratelimit(self, rule: str) -> tuple[Any, Any]:
        """The (allowed, refused) counters of ``rule``, bound once per rule by the middleware."""
        return (
            self.ratelimit_requests.labels(rule, "allowed"),
            self.ratelimit_requests.labels(rule, "refused"),
        )

    def function(self, name: str) -> tuple[dict[str, Any], Any]:
        """The outcome counters (by outcome) and the waits counter of the idempotent
        function ``name``, bound once per function."""
        calls = {o: self.function_calls.labels(name, o) for o in FUNCTION_OUTCOMES}
        return calls, self.function_waits.labels(name)

    def watch(self, pool: Watched) -> None:
        """Report ``pool``'s mailbox depth and parked waiters (the pool calls this)."""
        if pool not in self._pools:
            self._pools.append(pool)

    def committed(self, seconds: float, operations: int) -> None:
        """One group commit: how long it took and how many operations it applied."""
        self.commit_seconds.observe(seconds)
        self.commit_operations.observe(operations)

    def shard_state(self, shard: int, queued: int, parked: int) -> None:
        """Multiprocess mode only: a shard's depth and waiters after a commit."""
        if self._depth is not None:
            label = str(shard)
            self._depth.labels(label).set(queued)
            self._parked.labels(label).set(parked)

    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        prom = _prometheus()
        return prom.generate_latest(self.registry), str(prom.CONTENT_TYPE_LATEST)

    def asgi_app(self) -> ASGIApp:
        """A pure ASGI app serving the metrics: ``GET`` → Prometheus text format.

        An object, not a function, so Starlette's ``Route("/metrics", ...)`` serves
        it as an ASGI app at exactly that path.
        """
        return _MetricsApp(self)


class _MetricsApp:
    __slots__ = ("metrics",)

    def __init__(self, metrics: PorchMetrics) -> None:
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] not in ("GET", "HEAD"):
            status, body, kind = 405, b"GET only\n", "text/plain; charset=utf-8"
            extra = [(b"allow", b"GET, HEAD")]
        else:
            body, kind = self.metrics.exposition()
            status, extra = 200, []
        headers = [
            (b"content-type", kind.encode("latin-1")),
            (b"content-length", str(len(body)).encode("ascii")),
            *extra,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )


class _PoolCollector:
    """Mailbox depth and parked waiters of the watched pools, read at scrape time."""

    def __init__(self, pools: list[Watched]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        depth = GaugeMetricFamily(
            "porch_mailbox_depth", "Operations queued in the shard mailboxes.", labels=["shard"]
        )
        parked = GaugeMetricFamily(
            "porch_parked_waiters",
            "Duplicate requests parked behind a running idempotency owner.",
            labels=["shard"],
        )
        queued: dict[str, float] = {}
        waiting: dict[str, float] = {}
        for pool in self._pools:
            for index, (q, w) in enumerate(pool.shard_load()):
                queued[str(index)] = queued.get(str(index), 0) + q
                waiting[str(index)] = waiting.get(str(index), 0) + w
        for label in sorted(queued, key=int):
            depth.add_metric([label], queued[label])
            parked.add_metric([label], waiting[label])
        yield depth
        yield parked
