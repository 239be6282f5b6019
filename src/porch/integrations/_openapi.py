"""What a guarded FastAPI route adds to its OpenAPI operation: 429/503 (and 409) responses,
the rate-limit headers, and the ``Idempotency-Key`` header parameter."""

from __future__ import annotations

from typing import Any

from ..ratelimit._decisions import HeaderStyle
from ._routes import RouteIdempotency, RouteLimit

__all__ = ["document"]

_INT = {"schema": {"type": "integer"}}
_RATE_HEADERS: dict[str, Any] = {
    "X-RateLimit-Limit": {"description": "Requests allowed in the window.", **_INT},
    "X-RateLimit-Remaining": {"description": "Requests left in the window.", **_INT},
    "X-RateLimit-Reset": {"description": "When the window ends (Unix seconds).", **_INT},
    "RateLimit-Policy": {
        "description": 'The limits (IETF draft), e.g. "5-per-60s";q=5;w=60.',
        "schema": {"type": "string"},
    },
    "RateLimit": {
        "description": 'What is left (IETF draft), e.g. "5-per-60s";r=4;t=60.',
        "schema": {"type": "string"},
    },
}
_RETRY_AFTER = {"Retry-After": {"description": "Whole seconds to wait before retrying.", **_INT}}
_PROBLEM = {
    "application/problem+json": {
        "schema": {
            "type": "object",
            "properties": {
                "type": {"type": "string"},
                "title": {"type": "string"},
                "status": {"type": "integer"},
                "detail": {"type": "string"},
            },
        }
    }
}


def document(
    route: Any,
    responses: dict[int | str, Any],
    limits: list[RouteLimit],
    idempotency: list[RouteIdempotency],
    headers: HeaderStyle = "both",
) -> None:
    """Add porch's responses and parameters to ``route`` (an APIRoute); what is there stays.
    The rate-limit headers listed are those of ``headers`` (the style its limits send)."""
    if limits:
        # Names by their family's prefix: "X-RateLimit-*", or the draft's "RateLimit*".
        families = {"both": ("X-", "RateLimit"), "ietf": ("RateLimit",), "x-ratelimit": ("X-",)}
        prefixes = families.get(headers, ())
        sent = {name: spec for name, spec in _RATE_HEADERS.items() if name.startswith(prefixes)}
        responses.setdefault(
            429,
            {
                "description": "Too Many Requests: a rate limit of this route is exhausted.",
                "headers": {**_RETRY_AFTER, **sent},
                "content": _PROBLEM,
            },
        )
    responses.setdefault(
        503,
        {
            "description": "Service Unavailable: the limiter is saturated or its store is"
            " unavailable; nothing ran.",
            "headers": _RETRY_AFTER,
            "content": _PROBLEM,
        },
    )
    if not idempotency:
        return
    responses.setdefault(
        409,
        {
            "description": "Conflict: a request with this Idempotency-Key is still running.",
            "headers": _RETRY_AFTER,
            "content": _PROBLEM,
        },
    )
    declared = idempotency[0]
    if declared.documents_header:
        return  # a FastAPI dependency: its Header parameter is in the schema already
    extra = route.openapi_extra if isinstance(route.openapi_extra, dict) else {}
    extra.setdefault("parameters", []).append(
        {
            "name": "Idempotency-Key",
            "in": "header",
            "required": declared.required,
            "description": "Resending with the same key replays the stored response.",
            "schema": {"type": "string", "minLength": 1, "maxLength": 255},
        }
    )
    route.openapi_extra = extra
