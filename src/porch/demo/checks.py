"""The demo's own input checks: an order is small, and nothing a client sends may
reach SQLite (or json's recursion) unchecked. Refusals are problem documents
(RFC 9457), 4xx for bad input and 503 when the orders file fails, never a 500.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse

from .._responses import problem
from .._types import ASGIApp, Receive, Scope, Send

__all__ = [
    "DEFAULT_PAGE",
    "MAX_BODY",
    "MAX_ITEM",
    "MAX_PAGE",
    "MAX_QTY",
    "BodyCap",
    "TooLarge",
    "page_args",
    "parse_event",
    "parse_order",
    "problem_response",
    "read_capped",
    "unavailable",
]

logger = logging.getLogger("porch.demo")

# An order names an item of up to 64 KiB (outside checks send such orders, to
# exercise the stored-bytes quota); a body may be a few times that, escaped.
MAX_BODY = 512 * 1024
MAX_ITEM = 64 * 1024
MAX_QTY = 10_000
MAX_PAGE = 1000
DEFAULT_PAGE = 100

_TITLES = {
    400: "Bad Request",
    409: "Conflict",
    413: "Content Too Large",
    422: "Unprocessable Content",
    503: "Service Unavailable",
}


def problem_response(status: int, detail: str, **extensions: str) -> JSONResponse:
    document = {"type": "about:blank", "title": _TITLES[status], "status": status}
    document.update(detail=detail, **extensions)
    return JSONResponse(
        document,
        status_code=status,
        media_type="application/problem+json",
        headers={"retry-after": "1"} if status == 503 else None,
    )


def unavailable(exc: sqlite3.Error) -> JSONResponse:
    """The orders file failed (disk full, locked): 503 like porch's own store, never a 500."""
    logger.error("porch demo: the orders store failed: %s", exc, extra={"cause": "store"})
    return problem_response(503, "the orders store is unavailable", cause="store")


class TooLarge(Exception):
    """Raised when a request body exceeds MAX_BODY while it is read."""


async def read_capped(request: Request, cap: int) -> bytes:
    """The body, read chunk by chunk and refused as soon as it passes ``cap``."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def parse_order(body: bytes) -> tuple[str, int] | JSONResponse:
    """An order's ``(item, qty)``, or the 400/422 problem that refuses it."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: a deeply nested array; ValueError also covers an
        # integer literal longer than Python's int-parsing limit.
        return problem_response(400, "body must be a JSON object")
    if not isinstance(payload, dict):
        return problem_response(400, "body must be a JSON object")
    item, qty = payload.get("item"), payload.get("qty")
    if not isinstance(item, str) or not item:
        return problem_response(422, "'item' must be a non-empty string")
    if len(item) > MAX_ITEM:
        return problem_response(422, f"'item' must be at most {MAX_ITEM} characters")
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written as a JSON escape
        return problem_response(422, "'item' must be valid Unicode text (no lone surrogates)")
    if isinstance(qty, bool) or not isinstance(qty, int) or not 1 <= qty <= MAX_QTY:
        return problem_response(422, f"'qty' must be an integer from 1 to {MAX_QTY}")
    return item, qty


MAX_EVENT_ID = 255


def parse_event(body: bytes) -> tuple[str, int] | JSONResponse:
    """A webhook event's ``(id, amount)``, or the 400/422 problem that refuses it."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return problem_response(400, "body must be a JSON object")
    if not isinstance(payload, dict):
        return problem_response(400, "body must be a JSON object")
    event_id, amount = payload.get("id"), payload.get("amount")
    if not isinstance(event_id, str) or not 1 <= len(event_id) <= MAX_EVENT_ID:
        return problem_response(422, f"'id' must be a string of 1-{MAX_EVENT_ID} characters")
    try:
        event_id.encode("utf-8")
    except UnicodeEncodeError:
        return problem_response(422, "'id' must be valid Unicode text (no lone surrogates)")
    if isinstance(amount, bool) or not isinstance(amount, int) or abs(amount) >= 2**63:
        return problem_response(422, "'amount' must be a 64-bit integer")
    return event_id, amount


def page_args(query: str) -> tuple[int, int] | JSONResponse:
    """``after`` and ``limit`` of ``GET /orders``, or the 400 problem that refuses them."""
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=False, max_num_fields=20)
    except ValueError:
        return problem_response(400, "too many query parameters")
    values: dict[str, int] = {}
    for name, default, low, high in (
        ("after", 0, 0, 2**63 - 1),
        ("limit", DEFAULT_PAGE, 1, MAX_PAGE),
    ):
        raw = params.get(name, [str(default)])
        text = raw[-1].strip()
        if len(raw) != 1 or not text.isascii() or not text.isdigit() or len(text) > 19:
            return problem_response(400, f"'{name}' must be one integer from {low} to {high}")
        number = int(text)
        if not low <= number <= high:
            return problem_response(400, f"'{name}' must be one integer from {low} to {high}")
        values[name] = number
    return values["after"], values["limit"]


class BodyCap:
    """413 for any request whose Content-Length exceeds ``cap``; streamed bodies are
    capped where they are read (the order handler, the idempotency middleware)."""

    def __init__(self, app: ASGIApp, *, cap: int) -> None:
        self.app = app
        self.cap = cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length":
                    text = value.strip()
                    if not text.isdigit():
                        await problem(400, "Content-Length must be a decimal integer")(
                            scope, receive, send
                        )
                        return
                    if len(text) > 18 or int(text) > self.cap:
                        logger.info(
                            "porch demo: refused a declared body over %d bytes (413)",
                            self.cap,
                            extra={"outcome": "too_large", "status": 413},
                        )
                        await problem(413, f"a request body may be at most {self.cap} bytes")(
                            scope, receive, send
                        )
                        return
        await self.app(scope, receive, send)
