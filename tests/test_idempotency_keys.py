from __future__ import annotations

import pytest

from porch.idempotency_keys import InvalidKey, authorization_scope, parse_key, request_digest


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
    def scope(*headers: tuple[bytes, bytes]) -> dict[str, object]:
        return {"headers": list(headers)}

    anon = authorization_scope(scope())
    alice = authorization_scope(scope((b"authorization", b"Bearer alice")))
    bob = authorization_scope(scope((b"authorization", b"Bearer bob")))
    assert anon == "anon"
    assert len({anon, alice, bob}) == 3
    assert alice == authorization_scope(scope((b"authorization", b"Bearer alice")))
    assert "alice" not in alice  # a digest, never the credential itself


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
