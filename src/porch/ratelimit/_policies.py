"""What one request counts under a rule: its plan's limits, the keys of their levels, its cost.

The middleware's general path asks :func:`resolve` before it sends the hit (a
rule of today's shape, one key and one unit, never comes here). Everything the
app's functions return is checked here, so a bad answer is a precise 4xx, never
a counter under a key nobody meant.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable

from .._asgi import replaying
from .._eventlog import EventLog
from .._responses import problem
from .._types import ASGIApp, Receive, Scope
from ._costs import BodyGone, BodyTooLarge, CostRequest
from ._decisions import CompiledRule, level_key

__all__ = ["Resolved", "resolve"]


class Resolved:
    """A request's part in a rule: ``compiled`` (its plan's limits, less the levels that do
    not apply to it; None: none applies), a key per limit, its cost, and the ``receive``
    the app reads the body from (the body a cost function read, then the real channel)."""

    __slots__ = ("compiled", "cost", "keys", "memo", "receive")

    def __init__(
        self,
        compiled: CompiledRule | None,
        keys: list[str],
        cost: int,
        receive: Receive,
    ) -> None:
        self.compiled = compiled
        self.keys = keys
        self.cost = cost
        self.receive = receive
        # Where a refusal of these counters is remembered: every key (a level's counter is
        # shared by clients), and the plan (one counter, other amounts).
        plan = compiled.plan if compiled is not None else None
        self.memo = "\x1e".join([plan or "", *keys])


async def resolve(
    compiled: CompiledRule,
    client: str,
    scope: Scope,
    receive: Receive,
    now: Callable[[], float],
    log: EventLog,
) -> Resolved | ASGIApp | None:
    """The request's :class:`Resolved`; or the answer it gets instead (a 400 or 413 for a
    cost that cannot be read); or None when its client left while its body was read.
    A level's key function may raise ForwardingHeaderError (the caller answers 400)."""
    rule = compiled.rule
    if rule.plans is not None:
        compiled = await _plan(compiled, client, scope, now, log)
    keys: dict[str, str | None] = {}
    for level in compiled.level_names:
        key = level_key(level, client)
        if key is None:
            # A declared level's key function, called here: a coroutine (and the ABC check
            # of inspect.isawaitable) only for an answer that is neither a str nor None.
            answer = compiled.level_keys[level](scope)
            key = (
                answer
                if answer is None or type(answer) is str
                else await _level(rule.name, level, answer)
            )
        keys[level] = key
    variant: CompiledRule | None = compiled
    if None in keys.values():
        # A level that does not apply to this request (a caller without an organisation):
        # its limits are left out, of the hit and of the headers.
        variant = compiled.subset(tuple(keys[level] is not None for level in compiled.levels))
    counted: list[str] = []
    if variant is not None:
        for prefix, level in zip(variant.prefixes, variant.levels, strict=True):
            counted.append(prefix + str(keys[level]))
    cost = rule.cost
    if not callable(cost):
        return Resolved(variant, counted, cost, receive)
    request = CostRequest(scope, receive)
    try:
        found = cost(request)
        if not isinstance(found, int):
            found = await found
    except BodyGone:
        return None
    except BodyTooLarge as exc:
        _refused(log, rule.name, 413, "porch: refused a body over the cost's cap: %s", exc)
        return problem(413, str(exc), cause="cost")
    except (ValueError, LookupError, TypeError) as exc:  # the request is not what it expects
        _refused(log, rule.name, 400, "porch: refused a request whose cost cannot be read: %s", exc)
        return problem(400, f"the request's cost cannot be read: {exc}", cause="cost")
    if isinstance(found, bool) or not isinstance(found, int) or found < 0:
        _refused(log, rule.name, 400, "porch: a cost function returned %r (400)", found)
        return problem(
            400, f"the request's cost must be an integer >= 0, got {found!r}", cause="cost"
        )
    if request.read is not None:
        receive = replaying(request.read, receive)
    return Resolved(variant, counted, found, receive)


async def _plan(
    compiled: CompiledRule,
    client: str,
    scope: Scope,
    now: Callable[[], float],
    log: EventLog,
) -> CompiledRule:
    """The rule as the client's plan has it, looked up at most once per cache time."""
    chosen = compiled.chosen
    moment = now()
    found = chosen.get(client)
    if found is not None and moment < found[1]:
        return found[0]
    plans = compiled.rule.plans
    if plans is None:  # pragma: no cover - resolve() asks only for a rule with plans
        return compiled
    name = plans.plan(scope)
    if name is not None and not isinstance(name, str):
        name = await name
    variant = compiled
    if name is not None:
        known = compiled.variants.get(name) if isinstance(name, str) else None
        if known is None:
            log.event(
                logging.ERROR,
                ("plan", compiled.rule.name),
                moment,
                60.0,
                "porch: the plan function of rule %r returned %r, which is no plan (%s);"
                " the rule's own limits apply",
                compiled.rule.name,
                name,
                ", ".join(compiled.variants),
                rule=compiled.rule.name,
                outcome="unknown plan",
            )
        else:
            variant = known
    chosen.pop(client, None)
    if len(chosen) >= plans.entries:
        del chosen[next(iter(chosen))]  # the oldest lookup goes first
    chosen[client] = (variant, moment + plans.cache)
    return variant


async def _level(rule: str, level: str, found: object) -> str | None:
    """What a level's key function returned that is not plainly a str or None: awaited if it
    is awaitable, then checked."""
    if inspect.isawaitable(found):
        found = await found
    if found is None or isinstance(found, str):
        return found
    raise TypeError(
        f"the key function of level {level!r} (rule {rule!r}) must return a str or None,"
        f" got {found!r}"
    )


def _refused(log: EventLog, rule: str, status: int, message: str, detail: object) -> None:
    """A throttled log line for a request refused before its hit (once a second per rule)."""
    log.event(
        logging.WARNING,
        ("cost", rule),
        asyncio.get_running_loop().time(),
        1.0,
        message,
        detail,
        rule=rule,
        outcome="bad cost",
        status=status,
    )
