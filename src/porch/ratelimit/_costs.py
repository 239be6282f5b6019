"""What a request costs: the cost function's view of the request, and settling afterwards.

A rule's cost is charged with the hit, before the handler runs. With
``Rule(settle=True)`` that charge is a reservation: the handler reports what the
request actually cost with :func:`settle`, which only records the amount in the
request's reservation; the middleware that counted the request applies it after
the response, as one ``Settle`` of the difference (docs/design.md, "Policies").
Nothing is settled for a handler that never reported: the estimate stands.
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from typing import Any

from .._types import Receive, Scope

__all__ = [
    "RESERVATIONS",
    "BodyGone",
    "BodyTooLarge",
    "CostRequest",
    "Reservation",
    "settle",
]

#: The scope entry holding a request's reservations (a list, shared by copies of the scope).
RESERVATIONS = "porch.reservations"

DEFAULT_MAX_BODY = 1 << 20


class BodyTooLarge(Exception):
    """The body a cost function read is over its cap: the request is refused with 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"a request body may be at most {max_bytes} bytes")
        self.max_bytes = max_bytes


class BodyGone(Exception):
    """The client left while its body was read for the cost: nothing to answer."""


class CostRequest:
    """What a cost function is given: the request's ASGI ``scope``, and its body on demand.

    Reading the body (:meth:`body`, :meth:`json`) reads it whole before the
    handler runs, at most ``max_bytes`` (over it the request is refused with 413);
    the app then receives it as if nothing had read it.
    """

    __slots__ = ("_body", "_receive", "scope")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self._receive = receive
        self._body: bytes | None = None

    @property
    def read(self) -> bytes | None:
        """The body, if a cost function read it (None: it did not)."""
        return self._body

    async def body(self, max_bytes: int = DEFAULT_MAX_BODY) -> bytes:
        """The request body, whole (read once; kept for the app). A WebSocket handshake
        has none: empty."""
        if self.scope["type"] != "http":
            return b""
        if self._body is not None:
            if len(self._body) > max_bytes:
                raise BodyTooLarge(max_bytes)
            return self._body
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise BodyGone
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                self._body = b"".join(chunks)
                return self._body

    async def json(self, max_bytes: int = DEFAULT_MAX_BODY) -> Any:
        """The body parsed as JSON; a ValueError (the request is answered 400) if it is not."""
        try:
            return json.loads(await self.body(max_bytes))
        except RecursionError:  # nested too deeply for the parser: not a body to read
            raise ValueError("the body is nested too deeply") from None


class Reservation:
    """One rule's charge on a request, settled after the response if the handler reported
    the actual amount (``actual``)."""

    __slots__ = ("actual", "rule")

    def __init__(self, rule: str) -> None:
        self.rule = rule
        self.actual: int | None = None


def settle(request: Any, amount: int, *, rule: str | None = None) -> bool:
    """Report what ``request`` actually cost: ``amount`` units (an int >= 0).

    ``request`` is the request's ASGI scope or anything holding it as ``.scope``
    (Starlette's and FastAPI's ``Request``, a :class:`CostRequest`); under the WSGI
    bridge, the WSGI environ or what holds it as ``.environ`` (Flask's and Django's
    request). The amount is
    recorded in each reservation the request holds (each ``Rule(settle=True)``
    that counted it; ``rule``: only the one of that name) and applied by its
    middleware before the response's last body chunk leaves (or, reported later,
    once the handler returns): the difference from the estimate charged with the
    request is refunded or charged then. Called again, the last amount reported
    before that counts. Returns whether a reservation took it (False: no rule reserved for
    this request, e.g. the limiter is off, or exempted it).
    """
    if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
        raise ValueError(f"a settled amount must be an integer >= 0, got {amount!r}")
    scope = getattr(request, "scope", None)
    if scope is None:
        scope = getattr(request, "environ", request)
    # A server's scope is a dict: checked first, as isinstance() against the ABC costs a
    # Python-level subclass check on every call.
    if type(scope) is not dict and not isinstance(scope, MutableMapping):
        raise TypeError(f"settle() takes a request or its ASGI scope, got {request!r}")
    taken = False
    for reservation in scope.get(RESERVATIONS, ()):
        if rule is None or reservation.rule == rule:
            reservation.actual = amount
            taken = True
    return taken
