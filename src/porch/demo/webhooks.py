"""The storefront's webhook consumer: each event id is processed once, through porch's
idempotent-function API (keyed by the event's id, not by a header).

``POST /webhooks`` with ``{"id": str, "amount": int}`` processes the event (a row in
this host's orders file) and answers ``{"id", "processed_at"}``: the same body for every
delivery of that id, on every host sharing the store. ``GET /webhooks`` answers
``{"processed": N}``, this host's rows.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import sqlite3
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..errors import (
    KeyInProgressError,
    KeyReusedError,
    PoolClosedError,
    SaturatedError,
    StoreError,
)
from ..idempotency._functions import idempotent_function
from ..pool._pool import KeyPool
from .checks import MAX_BODY, TooLarge, parse_event, problem_response, read_capped, unavailable
from .config import DemoConfig
from .orders import Orders

__all__ = ["webhook_routes"]

logger = logging.getLogger("porch.demo")


def webhook_routes(pool: KeyPool, orders: Orders, config: DemoConfig) -> list[Route]:
    """``POST /webhooks`` and ``GET /webhooks`` over ``pool`` and this host's ``orders``."""

    @idempotent_function(pool, key="event", name="demo.webhooks")
    async def process(event: str, amount: int) -> dict[str, Any]:
        if config.checkout_latency:
            await asyncio.sleep(config.checkout_latency)  # the work a real consumer does
        processed_at = datetime.datetime.now(datetime.UTC).isoformat()
        await orders.record_event(event, amount, processed_at)
        return {"id": event, "processed_at": processed_at}

    async def receive(request: Request) -> JSONResponse:
        try:
            body = await read_capped(request, MAX_BODY)
        except TooLarge:
            return problem_response(413, f"a request body may be at most {MAX_BODY} bytes")
        parsed = parse_event(body)
        if isinstance(parsed, JSONResponse):
            return parsed
        event, amount = parsed
        try:
            result = await process(event, amount)
        except KeyReusedError:
            return problem_response(422, f"event {event!r} was delivered with another amount")
        except KeyInProgressError:
            return problem_response(409, f"event {event!r} is still being processed")
        except SaturatedError as exc:
            return problem_response(503, f"saturated: {exc}", cause="saturated")
        except (StoreError, PoolClosedError) as exc:
            logger.error("porch demo: a webhook could not be processed: %s", exc)
            return problem_response(503, "the idempotency store is unavailable", cause="store")
        except sqlite3.Error as exc:
            return unavailable(exc)
        return JSONResponse(result)

    async def count(request: Request) -> JSONResponse:
        try:
            processed = await orders.events()
        except sqlite3.Error as exc:
            return unavailable(exc)
        return JSONResponse({"processed": processed})

    return [
        Route("/webhooks", receive, methods=["POST"]),
        Route("/webhooks", count, methods=["GET"]),
    ]
