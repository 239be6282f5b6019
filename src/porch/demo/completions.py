"""``POST /completions``: a token budget reserved before the handler and settled after it.

The shape of an LLM API's limit: a request asks for up to ``max_tokens``; porch
reserves that many of the client's ``--token-budget`` per ``--window`` before the
handler runs (refused with 429 if they are not left), the "model" uses
``min(max_tokens, words in prompt)``, and the handler settles that amount: the
rest is refunded after the response. A request the handler refuses (400, 422)
reserved nothing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..integrations.starlette import limit
from ..ratelimit._costs import CostRequest, settle
from ..ratelimit._rules import Limit
from .checks import MAX_BODY, TooLarge, problem_response, read_capped
from .config import DemoConfig

__all__ = ["MAX_TOKENS", "completions_route", "reserved_tokens"]

MAX_TOKENS = 100_000


def _request(body: bytes) -> tuple[str, int] | JSONResponse:
    """A completion request's ``(prompt, max_tokens)``, or the 400/422 problem refusing it."""
    try:
        payload: Any = json.loads(body)
    except (ValueError, RecursionError):
        return problem_response(400, "body must be a JSON object")
    if not isinstance(payload, dict):
        return problem_response(400, "body must be a JSON object")
    prompt, max_tokens = payload.get("prompt"), payload.get("max_tokens")
    if not isinstance(prompt, str):
        return problem_response(422, "'prompt' must be a string")
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= MAX_TOKENS
    ):
        return problem_response(422, f"'max_tokens' must be an integer from 1 to {MAX_TOKENS}")
    return prompt, max_tokens


async def reserved_tokens(request: CostRequest) -> int:
    """What a request reserves: its ``max_tokens``; nothing when the handler will refuse it."""
    parsed = _request(await request.body(MAX_BODY))
    return 0 if isinstance(parsed, JSONResponse) else parsed[1]


def completions_route(config: DemoConfig) -> Route:
    """``POST /completions``, limited per client by the token budget (a route limit)."""

    @limit(
        Limit(config.token_budget, config.window, name="tokens"),
        name="completions",
        cost=reserved_tokens,
        settle=True,
    )
    async def complete(request: Request) -> JSONResponse:
        try:
            body = await read_capped(request, MAX_BODY)
        except TooLarge:
            return problem_response(413, f"a request body may be at most {MAX_BODY} bytes")
        parsed = _request(body)
        if isinstance(parsed, JSONResponse):
            return parsed
        prompt, max_tokens = parsed
        if config.checkout_latency:
            await asyncio.sleep(config.checkout_latency)  # the model, thinking
        used = min(max_tokens, len(prompt.split()))
        settle(request, used)
        return JSONResponse({"tokens": used})

    return Route("/completions", complete, methods=["POST"])
