"""Fingerprints: what of a body makes a retry the same request (and what each lets through)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from porch import (
    ConfigurationError,
    IdempotencyMiddleware,
    IdempotencyPolicy,
    IdempotencyRule,
    JSONFingerprint,
    KeyPool,
    SQLiteStore,
)
from porch._types import Scope
from porch.idempotency import BodyBytes, FunctionFingerprint
from porch.idempotency._keys import scope_digest

from .test_middleware import Handler, keyed, no_cookies

pytestmark = pytest.mark.anyio

SCOPE: Scope = {"type": "http", "method": "POST", "path": "/o", "headers": []}


def same(fingerprint: Any, a: bytes, b: bytes) -> bool:
    policy = IdempotencyPolicy(fingerprint=fingerprint)
    return policy.digest(SCOPE, a) == policy.digest(SCOPE, b)


def test_bytes_is_todays_digest() -> None:
    # Responses stored before fingerprints keep matching their retries.
    policy = IdempotencyPolicy()
    assert policy.fingerprint == BodyBytes()
    assert policy.digest(SCOPE, b'{"a":1}') == scope_digest(SCOPE, b'{"a":1}', (b"content-type",))
    assert not same("bytes", b'{"a":1,"b":2}', b'{"b":2,"a":1}')


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (b'{"a":1,"b":[1,2]}', b'{ "b" : [ 1 , 2 ] ,\n\t"a" : 1 }'),  # order, whitespace
        (b'{"a":1}', b'{"a":1.0}'),  # one decimal value
        (b'{"a":100}', b'{"a":1e2}'),
        (b'{"a":1.50}', b'{"a":15E-1}'),
        (b'{"a":0}', b'{"a":-0.0}'),
        (b'{"s":"\\u00e9"}', '{"s":"\u00e9"}'.encode()),  # an escape is its character
        (b'{"s":"\\/"}', b'{"s":"/"}'),
        (b'{"a":{"y":1,"x":2}}', b'{"a":{"x":2,"y":1}}'),  # nested objects too
    ],
)
def test_json_ignores_order_whitespace_and_notation(a: bytes, b: bytes) -> None:
    assert same("json", a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (b'{"a":1}', b'{"a":2}'),
        (b'{"a":0.1}', b'{"a":0.10000000000000001}'),  # equal as floats, not as decimals
        (b'{"a":12345678901234567890123456789012}', b'{"a":12345678901234567890123456789013}'),
        (b'{"a":1}', b'{"a":"1"}'),
        (b'{"a":null}', b"{}"),
        (b'{"a":true}', b'{"a":1}'),
        (b"[1,2]", b"[2,1]"),  # lists keep their order
        (b'{"s":"e\\u0301"}', '{"s":"\u00e9"}'.encode()),  # no Unicode normalisation
        (b'{"a":1}', b'{"a":1} x'),  # not one JSON text: bytes
        (b'{"a":1,"a":2}', b'{"a":2}'),  # a repeated key: ambiguous, so bytes
    ],
)
def test_json_tells_different_values_apart(a: bytes, b: bytes) -> None:
    assert not same("json", a, b)


def test_json_compares_what_is_not_json_by_bytes() -> None:
    for body in [b"", b"\xff\xfe", b"not json", b"NaN", b'{"a":Infinity}', b"[" * 100_000]:
        assert same("json", body, body)
        assert not same("json", body, body + b" ")
    # A raw body is never equal to a JSON one, whatever its bytes.
    assert not same("json", b'{"a":1,"a":1}', b'{"a":1}')


def test_include_compares_only_those_fields() -> None:
    fields = JSONFingerprint(include=["amount", "customer.id", ("odd.key",)])
    base = b'{"amount":5,"customer":{"id":"c1","name":"A"},"odd.key":1,"sent_at":"10:00"}'
    retry = b'{"sent_at":"10:01","customer":{"name":"B","id":"c1"},"odd.key":1,"amount":5}'
    assert same(fields, base, retry)  # name and sent_at are not compared: a replay
    assert not same(fields, base, base.replace(b'"amount":5', b'"amount":6'))
    assert not same(fields, base, base.replace(b'"odd.key":1', b'"odd.key":2'))
    # An included field absent is not the same as present (null included).
    assert not same(fields, b'{"amount":5}', b'{"amount":5,"customer":{"id":null}}')
    assert not same(fields, b'{"amount":5}', b'{"amount":5,"customer":{"id":"c1"}}')


def test_exclude_drops_those_fields_and_stars_match_every_item() -> None:
    noise = JSONFingerprint(exclude=["trace_id", "items.*.added_at"])
    a = b'{"trace_id":"t1","items":[{"sku":"x","added_at":1},{"sku":"y","added_at":2}]}'
    b = b'{"trace_id":"t2","items":[{"sku":"x","added_at":9},{"sku":"y","added_at":8}]}'
    assert same(noise, a, b)
    assert not same(noise, a, a.replace(b'"sku":"y"', b'"sku":"z"'))
    # Dropping a list's item by index keeps the others' places.
    first_dropped = JSONFingerprint(exclude=["items.0"])
    assert not same(first_dropped, b'{"items":[1,2]}', b'{"items":[2]}')
    assert same(first_dropped, b'{"items":[1,2]}', b'{"items":[9,2]}')
    # Items picked from a list are not an object with those names.
    picked = JSONFingerprint(include=["items.*"])
    assert not same(picked, b'{"items":[5]}', b'{"items":{"0":5}}')


def test_a_function_fingerprint() -> None:
    def account_and_amount(scope: Scope, body: bytes) -> str:
        return body.split(b";")[0].decode()

    assert same(account_and_amount, b"acct-1;sent 10:00", b"acct-1;sent 10:05")
    assert not same(account_and_amount, b"acct-1;x", b"acct-2;x")
    assert IdempotencyPolicy(fingerprint=account_and_amount).fingerprint == FunctionFingerprint(
        account_and_amount
    )


def test_fingerprint_configuration() -> None:
    with pytest.raises(ConfigurationError, match="include must be a sequence of paths"):
        JSONFingerprint(include="amount")
    with pytest.raises(ConfigurationError, match=r"exclude path 'a\.\.b' must name"):
        JSONFingerprint(exclude=["a..b"])
    with pytest.raises(ConfigurationError, match="fingerprint must be callable"):
        FunctionFingerprint(42)  # type: ignore[arg-type]


async def test_through_the_middleware(tmp_path: Path) -> None:
    handler = Handler()

    def strict(scope: Scope, body: bytes) -> bytes:
        if not body.startswith(b"v1:"):
            raise ValueError("no version prefix")
        return body

    rules = [
        IdempotencyRule("/json", policy=IdempotencyPolicy(fingerprint="json")),
        IdempotencyRule("/fn", policy=IdempotencyPolicy(fingerprint=strict)),
    ]
    async with KeyPool(SQLiteStore(tmp_path)) as pool:
        app = IdempotencyMiddleware(handler, pool=pool, rules=rules)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", cookies=no_cookies()
        ) as c:
            first = await c.post("/json", content=b'{"item":"tea","qty":2}', headers=keyed())
            again = await c.post("/json", content=b'{ "qty": 2, "item": "tea" }', headers=keyed())
            other = await c.post("/json", content=b'{"item":"tea","qty":3}', headers=keyed())
            refused = await c.post("/fn", content=b"v2:x", headers=keyed("f"))
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert other.status_code == 422
    assert refused.status_code == 400
    assert "no version prefix" in refused.json()["detail"]
    assert handler.calls == 1
