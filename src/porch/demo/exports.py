"""The storefront's exports: ``POST /exports`` with ``{"size": BYTES}`` answers 201 with that
many bytes (``application/octet-stream``), up to 100 MiB, streamed in chunks.

Each run's bytes are its own (a random pattern, and a ``Location`` naming the run), so a
replay that is byte-identical was stored, not run again. Keyed, the response is stored
for replay when it is at most ``--max-stored`` bytes.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .checks import MAX_BODY, TooLarge, problem_response, read_capped

__all__ = ["MAX_EXPORT", "export_route", "quota_bytes"]

MAX_EXPORT = 100 << 20
_CHUNK = 64 << 10


def quota_bytes(max_stored: int, default: int) -> int:
    """A caller's stored-bytes quota that holds at least two responses of ``max_stored``
    bytes (their heads and keys too), and never less than ``default``."""
    return max(default, 2 * max_stored + 2 * _CHUNK)


async def _export(request: Request) -> Response:
    try:
        body = await read_capped(request, MAX_BODY)
    except TooLarge:
        return problem_response(413, f"a request body may be at most {MAX_BODY} bytes")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return problem_response(400, "body must be a JSON object")
    if not isinstance(payload, dict):
        return problem_response(400, "body must be a JSON object")
    size = payload.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_EXPORT:
        return problem_response(422, f"'size' must be an integer from 0 to {MAX_EXPORT}")
    run = secrets.token_hex(8)
    pattern = (secrets.token_bytes(64) * (_CHUNK // 64))[:_CHUNK]

    async def chunks() -> AsyncIterator[bytes]:
        left = size
        while left > 0:
            piece = pattern if left >= _CHUNK else pattern[:left]
            left -= len(piece)
            yield piece

    return StreamingResponse(
        chunks(),
        status_code=201,
        media_type="application/octet-stream",
        headers={"location": f"/exports/{run}", "content-length": str(size)},
    )


def export_route() -> Route:
    """``POST /exports``."""
    return Route("/exports", _export, methods=["POST"])
