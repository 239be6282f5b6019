"""Rate strings, route templates, and counter namespaces that never collide by accident."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from porch import ConfigurationError, KeyPool, Limit, RateLimitMiddleware, Rule, SQLiteStore
from porch._types import ASGIApp, Receive, Scope, Send
from porch.ratelimit._rules import RATE_GRAMMAR
from support import asgi_client
from support import sqlite_counters as counters

pytestmark = pytest.mark.anyio


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def client(app: ASGIApp) -> httpx.AsyncClient:
    return asgi_client(app, "10.2.2.2")


@pytest.mark.parametrize(
    ("text", "amount", "window"),
    [
        ("5/minute", 5, 60),
        ("5/minutes", 5, 60),
        ("5 per minute", 5, 60),
        ("5 PER Minute", 5, 60),
        ("1/second", 1, 1),
        ("10/s", 10, 1),
        ("10/5s", 10, 5),
        ("10 per 5 seconds", 10, 5),
        ("3/2 hours", 3, 7200),
        ("100/day", 100, 86400),
        ("2/1.5s", 2, 1.5),
        (" 7 / hour ", 7, 3600),
    ],
)
def test_rate_strings(text: str, amount: int, window: float) -> None:
    limit = Limit(text)
    assert (limit.amount, limit.window) == (amount, window)
    # The same default name (and so the same counters) as the numeric form.
    assert limit == Limit(amount, window)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10/minute sliding", Limit(10, 60, algorithm="sliding")),
        ("10 per 5 seconds SLIDING", Limit(10, 5, algorithm="sliding")),
        ("5/second gcra", Limit(5, 1, algorithm="gcra")),
        ("5/second gcra burst 20", Limit(5, 1, algorithm="gcra", burst=20)),
        (" 5 per second  gcra  BURST 20 ", Limit(5, 1, algorithm="gcra", burst=20)),
        ("7/h fixed", Limit(7, 3600)),
    ],
)
def test_rate_strings_name_the_algorithm(text: str, expected: Limit) -> None:
    assert Limit(text) == expected
    # A keyword that agrees with the string, or says what the string leaves out, is fine.
    assert Limit(text, algorithm=expected.algorithm) == expected
    assert Limit("5/second", algorithm="gcra", burst=20) == Limit("5/second gcra burst 20")


def test_default_names_tell_the_algorithms_apart() -> None:
    # A fixed window's name is as it always was: its stored counters keep their meaning.
    assert Limit("10/minute").name == "10-per-60s"
    assert Limit("10/minute sliding").name == "10-per-60s-sliding"
    assert Limit("10/minute gcra").name == "10-per-60s-gcra"
    assert Limit("10/minute gcra burst 10").name == "10-per-60s-gcra"
    assert Limit("10/minute gcra burst 30").name == "10-per-60s-gcra-burst-30"
    # So one rule may hold one rate under two algorithms.
    assert len(Rule("10/minute; 10/minute sliding; 10/minute gcra").limits) == 3


def test_several_rates() -> None:
    assert Limit.parse("100/day; 10/second") == (Limit(100, 86400), Limit(10, 1))
    assert Limit.parse("1/s, 2/m") == (Limit(1, 1), Limit(2, 60))
    rule = Rule("100/day; 10/second")
    assert rule.limits == (Limit(100, 86400), Limit(10, 1))
    assert Rule(["5/minute", Limit(1, 1, name="burst")]).limits == (
        Limit(5, 60),
        Limit(1, 1, name="burst"),
    )
    assert Limit("5/minute", name="login").name == "login"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Limit("5/fortnight"),
            "invalid rate '5/fortnight': unknown unit 'fortnight'"
            f" (use second, minute, hour or day); expected {RATE_GRAMMAR}",
        ),
        (
            lambda: Limit("five/minute"),
            "invalid rate 'five/minute': expected '<amount>/[<count>]<unit>"
            " [fixed | sliding | gcra [burst <n>]]' ('per' for '/'), e.g. '5/minute',"
            " '10 per 5 seconds sliding', '5/second gcra burst 20'",
        ),
        (lambda: Limit("0/minute"), "limit amount must be an integer >= 1, got 0"),
        (lambda: Limit("5/0s"), "limit window must be > 0 seconds, got 0"),
        (lambda: Limit(""), "a rate string needs at least one rate, got ''"),
        (lambda: Limit.parse(" ; "), "a rate string needs at least one rate, got ' ; '"),
        (
            lambda: Limit("1/s; 2/m"),
            "Limit() takes one rate, got '1/s; 2/m'; use Limit.parse() for several",
        ),
        (
            lambda: Limit("5/minute", 60),
            "a rate string carries its own window; got Limit('5/minute', 60)",
        ),
        (lambda: Limit(5, True), "limit window must be > 0 seconds, got True"),
        (
            lambda: Rule("1/s", path="/a b"),
            "rule path must be printable ASCII without spaces (percent-encode the rest),"
            " got '/a b'",
        ),
        (
            lambda: Rule("1/s", path="/users/{id"),
            "rule path templates are {name} or {name:convertor} (letters, digits, _),"
            " got '/users/{id'",
        ),
        (lambda: Rule([1]), "rule limits must be Limit or Concurrency instances or rate strings"),  # type: ignore[list-item]
        (lambda: Rule("1/s", methods=[]), "rule methods must name at least one method, or be None"),
        (
            lambda: Limit(5, 60, algorithm="leaky"),  # type: ignore[arg-type]
            "limit algorithm must be one of ('fixed', 'sliding', 'gcra'), got 'leaky'",
        ),
        (
            lambda: Limit(5, 60, algorithm="sliding", burst=10),
            "a burst applies to gcra limits only, got 'sliding'",
        ),
        (
            lambda: Limit(5, 60, algorithm="gcra", burst=0),
            "limit burst must be an integer >= 1, got 0",
        ),
        (
            lambda: Limit("5/minute leaky"),
            f"invalid rate '5/minute leaky': unknown algorithm 'leaky'; expected {RATE_GRAMMAR}",
        ),
        (
            lambda: Limit("5/minute sliding burst 9"),
            "invalid rate '5/minute sliding burst 9': a burst applies to gcra only;"
            f" expected {RATE_GRAMMAR}",
        ),
        (lambda: Limit("5/s gcra burst 0"), "limit burst must be an integer >= 1, got 0"),
        (
            lambda: Limit("5/minute burst 9"),
            f"invalid rate '5/minute burst 9': expected {RATE_GRAMMAR}",
        ),
        (
            lambda: Limit("5/minute sliding", algorithm="gcra"),
            "the rate string says algorithm 'sliding' and the keyword algorithm='gcra';"
            " give it once",
        ),
        (
            lambda: Limit("5/minute gcra burst 9", burst=8),
            "the rate string says burst 9 and the keyword burst=8; give it once",
        ),
    ],
)
def test_bad_configuration_is_refused_with_an_exact_message(make: object, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        make()  # type: ignore[operator]
    assert str(info.value) == message


def test_default_names_come_from_path_and_methods() -> None:
    assert Rule("1/s").name == "default"  # the whole app: as before, so old counters keep
    assert Rule("1/s", path="/login").name == "/login"
    assert Rule("1/s", path="/login/", methods=["post", "HEAD"]).name == "GET+POST:/login"
    assert Rule("1/s", path="/users/{id}/follow").name == "/users/{id}/follow"
    assert Rule("1/s", path="/x", name="auth").name == "auth"


@pytest.mark.parametrize(
    ("path", "selected", "passed"),
    [
        (
            "/users/{id}/follow",
            ["/users/1/follow", "/users/abc/follow/"],
            ["/users/1", "/users/1/x/follow", "/users//follow"],
        ),
        ("/users/{id:int}", ["/users/7", "/users/7/follow"], ["/users", "/usersx/7"]),
        ("/files/{rest:path}", ["/files/a/b/c"], ["/files", "/files/"]),
    ],
)
def test_templates_match_one_segment_per_parameter(
    path: str, selected: list[str], passed: list[str]
) -> None:
    rule = Rule("1/s", path=path)
    for p in selected:
        assert rule.matches("GET", p), p
    for p in passed:
        assert not rule.matches("GET", p), p


async def test_two_middlewares_with_default_names_count_apart(
    pool: KeyPool, tmp_path: Path
) -> None:
    # The report: five requests to /login made /signup answer 429.
    inner = RateLimitMiddleware(ok, pool=pool, rules=Rule("5/minute", path="/signup"))
    app = RateLimitMiddleware(inner, pool=pool, rules=Rule("5/minute", path="/login"))
    async with client(app) as c:
        assert [(await c.post("/login")).status_code for _ in range(6)] == [200] * 5 + [429]
        assert (await c.post("/signup")).status_code == 200
    rows = counters(tmp_path)
    assert rows == {
        "rl\x1f/login\x1f5-per-60s\x1f10.2.2.2": 5,
        "rl\x1f/signup\x1f5-per-60s\x1f10.2.2.2": 1,
    }


async def test_a_taken_name_is_refused_when_the_limiter_is_built(pool: KeyPool) -> None:
    RateLimitMiddleware(ok, pool=pool, rules=Rule("5/minute", path="/login", name="auth"))
    with pytest.raises(ConfigurationError) as info:
        RateLimitMiddleware(ok, pool=pool, rules=Rule("5/minute", path="/signup", name="auth"))
    assert str(info.value) == (
        "rule name 'auth' (the rule for '/signup') is already used on this pool by"
        " the rule for '/login'; give one of them another name=, or shared=True on"
        " both to count them together"
    )
    # The same rule built again (an app built twice, as tests do) is the same policy.
    RateLimitMiddleware(ok, pool=pool, rules=Rule("5/minute", path="/login", name="auth"))


def test_a_limit_names_its_algorithm_and_burst() -> None:
    assert (Limit(5, 60).algorithm, Limit(5, 60).burst) == ("fixed", 5)
    assert Limit(5, 60, algorithm="gcra").burst == 5
    bucket = Limit(5, 60, algorithm="gcra", burst=20)
    assert (bucket.algorithm, bucket.burst, bucket.name) == ("gcra", 20, "5-per-60s-gcra-burst-20")
    # One name, another algorithm: another policy (two rules cannot share it by accident).
    assert Rule(bucket, name="r").signature() != Rule(Limit(5, 60), name="r").signature()
    assert Rule(Limit(5, 60), name="r").signature() == (
        "rule",
        "/",
        None,
        (("5-per-60s", 5, 60.0),),
    )


class FixedOnly(SQLiteStore):
    """A store that decides fixed windows only (as a network store did before its own)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.capabilities = replace(self.capabilities, algorithms=frozenset({"fixed"}))


async def test_an_algorithm_the_store_does_not_decide_is_refused_when_built(
    tmp_path: Path,
) -> None:
    rule = Rule([Limit(5, 60), Limit(1, 1, name="b", algorithm="gcra")], name="r")
    async with KeyPool(FixedOnly(tmp_path)) as pool:
        with pytest.raises(ConfigurationError) as info:
            RateLimitMiddleware(ok, pool=pool, rules=rule)
        assert str(info.value) == (
            "rule 'r': limit 'b' uses 'gcra', which FixedOnly does not decide (it offers fixed)"
        )


async def test_shared_rules_count_together(pool: KeyPool, tmp_path: Path) -> None:
    login = Rule("3/minute", path="/login", name="auth", shared=True)
    signup = Rule("3/minute", path="/signup", name="auth", shared=True)
    app = RateLimitMiddleware(ok, pool=pool, rules=[login, signup])
    async with client(app) as c:
        statuses = [
            (await c.post(p)).status_code for p in ("/login", "/signup", "/login", "/signup")
        ]
    assert statuses == [200, 200, 200, 429]
    assert counters(tmp_path) == {"rl\x1fauth\x1f3-per-60s\x1f10.2.2.2": 3}
    with pytest.raises(ConfigurationError) as info:
        RateLimitMiddleware(
            ok, pool=pool, rules=Rule("9/minute", path="/reset", name="auth", shared=True)
        )
    assert "is shared with the rule for '/login' but its limits differ" in str(info.value)


async def test_template_rule_counts_per_route(pool: KeyPool, tmp_path: Path) -> None:
    app = RateLimitMiddleware(
        ok, pool=pool, rules=Rule("2/minute", path="/users/{id}/follow", methods=["POST"])
    )
    async with client(app) as c:
        statuses = [(await c.post(f"/users/{i}/follow")).status_code for i in (1, 2, 3)]
        assert (await c.post("/users/1")).status_code == 200  # not selected, not counted
    assert statuses == [200, 200, 429]
    assert counters(tmp_path) == {"rl\x1fPOST:/users/{id}/follow\x1f2-per-60s\x1f10.2.2.2": 2}


async def test_a_first_rule_over_the_whole_app_selects_every_request_not_exempt(
    pool: KeyPool, tmp_path: Path
) -> None:
    # Such a rule skips method normalization and matching per request (a shortcut): it must
    # still select exactly what matching does, before any later rule, exempt paths exact or
    # by prefix as configured.
    rules = [Rule("100/minute"), Rule("100/minute", path="/api", name="api")]
    app = RateLimitMiddleware(ok, pool=pool, rules=rules, exempt=("/health", "/static/"))
    async with client(app) as c:
        selected = [
            await c.get("/"),
            await c.head("/api/x"),
            await c.post("/api"),
            await c.request("PURGE", "/a/b"),
            await c.get("/health/x"),
            await c.get("/static"),
        ]
        exempt = [await c.get("/health"), await c.post("/static/app.js")]
    assert [r.headers["ratelimit"] for r in selected] == [
        f'"100-per-60s";r={99 - i};t=60' for i in range(6)
    ]
    assert all("ratelimit" not in r.headers for r in exempt)
    assert counters(tmp_path) == {"rl\x1fdefault\x1f100-per-60s\x1f10.2.2.2": 6}
