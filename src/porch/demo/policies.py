"""The demo's rate limit: ``--limit`` per ``--window`` per client, by ``--algorithm``; with
``--global-limit``, a second level for every client together; with ``--plans``, the limits
of the plan a bearer token names; with ``--max-in-flight``, a cap on one client's
checkouts in flight."""

from __future__ import annotations

from .._types import Scope
from ..identity import ClientIdentity, KeyFunc
from ..ratelimit._rules import GLOBAL, Concurrency, Limit, Plans, Rule
from .config import DemoConfig

__all__ = ["bearer_token", "rate_rules"]


def bearer_token(scope: Scope) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None: no such header)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


def rate_rules(config: DemoConfig, identity: ClientIdentity) -> tuple[KeyFunc, list[Rule]]:
    """The key and the rules of the demo's limiter. The last, over every request, is named
    ``default``, its client limit ``demo`` (the counters outside checks read are
    ``rl US default US demo US <client>``). With ``--max-in-flight``, checkout (POST
    /orders) is also capped to that many requests of one client in flight: a rule of its
    own, first, so it selects them (its rate counts on counters of its own)."""
    limits = [
        Limit(
            config.limit,
            config.window,
            name="demo",
            algorithm=config.algorithm,
            burst=config.burst,
        )
    ]
    if config.global_limit is not None:
        # Everyone together, on the same rule: one decision with the client's limit.
        limits.append(
            Limit(
                config.global_limit,
                config.window,
                name="global",
                algorithm=config.algorithm,
                level=GLOBAL,
                slice=config.global_slice,
            )
        )
    key: KeyFunc = identity
    plans: Plans | None = None
    by_plan = config.plan_limits()
    if by_plan:

        def plan_of(scope: Scope) -> str | None:
            """``Bearer <plan>-<rest>`` of a known plan names it; anything else: no plan."""
            token = bearer_token(scope)
            plan = token.partition("-")[0] if token is not None and "-" in token else None
            return plan if plan in by_plan else None

        def planned_key(scope: Scope) -> str:
            """A plan's caller is its token; anyone else, the client identity."""
            if plan_of(scope) is not None:
                token = bearer_token(scope)
                if token is not None:
                    return token
            return identity(scope)

        # The global level counts planned callers too: it is part of every plan.
        shared = tuple(limits[1:])
        plans = Plans({name: (*found, *shared) for name, found in by_plan.items()}, plan=plan_of)
        key = planned_key
    rules = [Rule(limits, plans=plans)]
    if config.max_in_flight is not None:
        cap = Concurrency(config.max_in_flight, name="in-flight")
        rules.insert(
            0,
            Rule([*limits, cap], path="/orders", methods=["POST"], name="orders", plans=plans),
        )
    return key, rules
