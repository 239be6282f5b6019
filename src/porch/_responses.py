"""Minimal ASGI responses porch sends on its own: problem details (RFC 9457) and plain bytes."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ._types import Receive, Scope, Send

__all__ = ["BytesResponse", "problem"]

_PROBLEM_TYPE = b"application/problem+json"

_TITLES = {
    400: "Bad Request",
    409: "Conflict",
    413: "Content Too Large",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    503: "Service Unavailable",
}


class BytesResponse:
    """An ASGI app that sends one status, headers and body."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
    ) -> None:
        self.status = status
        self.body = body
        self.headers = [*headers, (b"content-length", str(len(body)).encode("ascii"))]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def problem(
    status: int,
    detail: str,
    *,
    headers: Iterable[tuple[bytes, bytes]] = (),
    **extensions: Any,
) -> BytesResponse:
    """An ``application/problem+json`` response with ``title`` from the status code."""
    document: dict[str, Any] = {
        "type": "about:blank",
        "title": _TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
    }
    document.update(extensions)
    body = json.dumps(document, separators=(",", ":")).encode("utf-8")
    return BytesResponse(status, body, [(b"content-type", _PROBLEM_TYPE), *headers])
