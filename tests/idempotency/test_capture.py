"""The response head a capture checks and keeps (porch.capture.head), pinned against the
implementation it replaced: the same headers kept, the same first invalid header named."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from porch.idempotency import _capture as capture
from porch.idempotency._capture import REPLAYED_HEADERS, head

# The check as it was before the names cache (capture.py at 256346f), verbatim but names.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_TOKENS = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+(?:,[!#$%&'*+\-.^_`|~0-9A-Za-z]+)*")


def _old_invalid_header(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    if not headers:
        return None
    names = b",".join([name for name, _ in headers])
    if (
        _TOKENS.fullmatch(names) is not None
        and names.count(b",") == len(headers) - 1
        and _BAD_VALUE.search(b"\t".join([value for _, value in headers])) is None
    ):
        return None
    for name, value in headers:
        if _TOKEN.fullmatch(name) is None or _BAD_VALUE.search(value) is not None:
            return bytes(name)
    return None


def _old_head(
    headers: Sequence[tuple[bytes, bytes]],
) -> tuple[tuple[tuple[bytes, bytes], ...], bytes | None]:
    invalid = _old_invalid_header(headers)
    kept = []
    for name, value in headers:
        name = name.lower()
        if name in REPLAYED_HEADERS:
            kept.append((name, value))
    return tuple(kept), invalid


# The names a middleware learnt (IdempotencyMiddleware._names), one dict for every call.
NAMES: dict[bytes, bytes] = {}


@pytest.fixture(autouse=True)
def _cold_names() -> Iterator[None]:
    """Each test starts with no learnt names (and leaves none behind)."""
    NAMES.clear()
    yield
    NAMES.clear()


def _same(headers: Sequence[tuple[bytes, bytes]]) -> None:
    # Twice: the first call may learn the names, the second answers from what it learnt.
    expected = _old_head(headers)
    assert head(headers, NAMES) == expected, headers
    assert head(headers, NAMES) == expected, headers


def test_every_byte_in_a_name_and_in_a_value_as_before() -> None:
    for byte in range(256):
        raw = bytes([byte])
        for name in (raw, b"x" + raw, raw + b"-y", b"Content-Type" + raw):
            _same([(name, b"v")])
            _same([(b"content-type", b"text/plain"), (name, b"v"), (b"x-a", b"\n")])
        for value in (raw, b"a" + raw + b"b", raw * 3):
            _same([(b"etag", value)])
            _same([(b"x-a", b"1"), (b"Location", value), (b"x\n", b"2")])


def test_mixed_heads_name_the_same_first_invalid_header() -> None:
    names = [b"content-type", b"ETag", b"x-a", b"", b"a:b", b"a b", b"a,b", b"a\nb", b"\xff"]
    values = [b"", b"text/plain", b"a:b", b"a\tb", b"a\nb", b"a\rb", b"\x00", b"\x7f", b"\xe9"]
    pairs = [(n, v) for n in names for v in values]
    heads: list[list[tuple[bytes, bytes]]] = [[]]
    heads += [[p] for p in pairs]
    heads += [[(b"content-type", b"x"), p] for p in pairs]
    heads += [[p, (b"x-b", b"y\nz:w")] for p in pairs]
    heads += [[(b"a", b"1"), (b"b\n", b""), (b"c", b"2")], [(b"a", b"1:\nb:2")]]
    for headers in heads:
        _same(headers)


def test_heads_that_are_no_bytes_as_before() -> None:
    # A bytearray value passes (it is checked as bytes); a bytearray name is no dict key,
    # so it failed (TypeError) before and still does.
    values: list[tuple[bytes, Any]] = [(b"etag", bytearray(b"\x00")), (b"etag", bytearray(b"1"))]
    for header in values:
        _same([header])
    names: list[tuple[Any, bytes]] = [(bytearray(b"Content-Type"), b"1"), (bytearray(b"x a"), b"1")]
    for header in names:
        with pytest.raises(TypeError):
            _old_head([header])
        with pytest.raises(TypeError):
            head([header], NAMES)


def test_names_past_the_bound_are_still_checked() -> None:
    for i in range(capture.NAMES_MAX + 10):
        _same([(f"x-{i}".encode(), b"1"), (b"Location", b"/a")])
    assert len(NAMES) == capture.NAMES_MAX
    _same([(b"x-new name", b"1")])
    _same([(b"X-NEW", b"\r")])
