from __future__ import annotations

import hashlib

import pytest

from porch.errors import ConfigurationError
from porch.idempotency._keys import (
    SECRET,
    CallerScope,
    InvalidKey,
    authorization_scope,
    parse_key,
    request_digest,
    scope_digest,
)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ([b"abc-123"], "abc-123"),
        ([b"  padded\t"], "padded"),
        ([b'"quoted key"'], "quoted key"),
        ([b'"with \\"escapes\\" and \\\\"'], 'with "escapes" and \\'),
        ([b"x" * 255], "x" * 255),
        ([b"~!@#$%^&*()"], "~!@#$%^&*()"),
    ],
)
def test_valid_keys(values: list[bytes], key: str) -> None:
    assert parse_key(values) == key


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([b""], "empty"),
        ([b'""'], "empty"),
        ([b"x" * 256], "longer than 255"),
        ([b"a\x01b"], "printable ASCII"),
        ([b"a\x7fb"], "printable ASCII"),
        (["caf\u00e9".encode()], "printable ASCII"),
        ([b"a", b"b"], "exactly one"),
        ([b"a, b"], "several values"),
        ([b'"a", "b"'], "several values"),
        ([b'"open'], "unterminated"),
        ([b'"bad \\n escape"'], "bad escape"),
    ],
)
def test_invalid_keys(values: list[bytes], message: str) -> None:
    with pytest.raises(InvalidKey, match=message):
        parse_key(values)


def test_authorization_scope() -> None:
    def scope(*headers: tuple[bytes, bytes], secret: bytes = b"k" * 32) -> dict[str, object]:
        return {"headers": list(headers), SECRET: secret}

    anon = authorization_scope(scope())
    alice = authorization_scope(scope((b"authorization", b"Bearer alice")))
    bob = authorization_scope(scope((b"authorization", b"Bearer bob")))
    assert anon == "anon"
    assert len({anon, alice, bob}) == 3
    assert alice == authorization_scope(scope((b"authorization", b"Bearer alice")))
    assert "alice" not in alice  # a digest, never the credential itself
    # Keyed with the store's secret: another store's digest of the same credential differs,
    # and neither is the unkeyed digest a dictionary could be tried against.
    other = authorization_scope(scope((b"authorization", b"Bearer alice"), secret=b"j" * 32))
    unkeyed = hashlib.blake2b(b"Bearer alice", digest_size=16).hexdigest()
    assert len({alice, other, unkeyed}) == 3


def test_credentials_are_never_digested_without_the_secret() -> None:
    headers = {"headers": [(b"cookie", b"s=1")], "client": ("10.0.0.1", 1)}
    with pytest.raises(ConfigurationError, match="store's secret"):
        CallerScope()(headers)
    with pytest.raises(ConfigurationError, match="store's secret"):
        authorization_scope({"headers": [(b"authorization", b"Basic eDp5")]})
    # Without credentials there is nothing to key: the client identity, as before.
    assert CallerScope()({"headers": [], "client": ("10.0.0.1", 1)}) == "client:10.0.0.1"


def test_digest_covers_method_path_query_and_body() -> None:
    base = request_digest("POST", "/orders", b"", b"{}")
    assert base == request_digest("POST", "/orders", b"", b"{}")
    assert (
        len(
            {
                base,
                request_digest("PATCH", "/orders", b"", b"{}"),
                request_digest("POST", "/orders/1", b"", b"{}"),
                request_digest("POST", "/orders", b"a=1", b"{}"),
                request_digest("POST", "/orders", b"", b"{ }"),
            }
        )
        == 5
    )


def _digest_piece_by_piece(
    method: str, path: str, query: bytes, body: bytes, headers: list[tuple[bytes, list[bytes]]]
) -> bytes:
    # The digest as stored by earlier versions (each piece hashed in turn): a stored
    # response must still match its retry after an upgrade.
    import hashlib

    h = hashlib.blake2b(digest_size=32)
    for part in (method.upper().encode("ascii"), path.encode("utf-8", "surrogateescape"), query):
        h.update(b"%d:" % len(part))
        h.update(part)
    for name, values in headers:
        h.update(b"h%d:" % len(name))
        h.update(name)
        h.update(b"#%d" % len(values))
        for value in values:
            h.update(b"%d:" % len(value))
            h.update(value)
    h.update(b"b%d:" % len(body))
    h.update(body)
    return h.digest()


@pytest.mark.parametrize(
    ("method", "path", "query", "body", "headers"),
    [
        ("POST", "/orders", b"", b"{}", [(b"content-type", [b"application/json"])]),
        ("patch", "/x/\udcff", b"a=1&b", b"", [(b"content-type", []), (b"x-a", [b"1", b""])]),
        ("POST", "/", b"", b"x" * 100_000, []),
    ],
)
def test_digest_is_the_same_as_earlier_versions_stored(
    method: str, path: str, query: bytes, body: bytes, headers: list[tuple[bytes, list[bytes]]]
) -> None:
    assert request_digest(method, path, query, body, headers) == _digest_piece_by_piece(
        method, path, query, body, headers
    )


def test_printable_check_accepts_exactly_0x20_to_0x7e() -> None:
    # parse_key checks isascii() then str.isprintable(), not a [\x20-\x7e] regex: the two
    # must agree on every byte, alone and inside an otherwise valid key.
    for byte in range(256):
        raw = bytes([byte])
        printable = 0x20 <= byte <= 0x7E
        for key in (b"k" + raw + b"k", b"k" + raw * 3 + b"k"):
            if printable and raw not in (b",", b'"', b" "):
                assert parse_key([key]) == key.decode("ascii")
            elif not printable:
                with pytest.raises(InvalidKey, match="printable ASCII"):
                    parse_key([key])


@pytest.mark.parametrize(
    "names", [(b"content-type",), (b"content-type", b"x-account"), (b"x-account",)]
)
@pytest.mark.parametrize(
    "sent",
    [
        [(b"content-type", b"application/json")],
        [],
        [(b"content-type", b"a"), (b"content-type", b"b")],
        [(b"x-account", b"7"), (b"content-type", b""), (b"host", b"h")],
        [(b"content-type", b"text/plain; charset=\xe9"), (b"x-account", b"7")],
    ],
)
def test_scope_digest_is_request_digest_of_the_scope(
    names: tuple[bytes, ...], sent: list[tuple[bytes, bytes]]
) -> None:
    # scope_digest formats the usual request (one digest header, sent once) in one call:
    # it must hash exactly what request_digest hashes, for that shape and every other.
    for method, path, query, body in [
        ("POST", "/orders", b"", b'{"a": 1}'),
        ("patch", "/x/\udcff/\u00e9", b"a=1&b", b""),
        ("POST", "/", b"q", b"x" * 100_000),
    ]:
        headers = [(b"host", b"example"), *sent]
        scope = {"method": method, "path": path, "query_string": query, "headers": headers}
        named = [(name, [v for k, v in headers if k == name]) for name in names]
        expected = request_digest(method, path, query, body, named)
        assert scope_digest(scope, body, names) == expected
    assert scope_digest({"method": "POST", "path": "/", "headers": sent}, b"", names) == (
        request_digest("POST", "/", b"", b"", [(n, [v for k, v in sent if k == n]) for n in names])
    )
