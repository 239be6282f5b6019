"""Fingerprints: what of a keyed request's body makes a retry "the same request".

A key reused with a request of another fingerprint is refused with 422; one with
the same fingerprint gets the stored response. Method, path, query string and the
rule's digest headers are always compared as they are; the fingerprint decides the
body's part:

- ``"bytes"`` (the default): every byte. A client that re-serialises the same JSON
  with another key order or other whitespace gets 422.
- ``"json"`` (:class:`JSONFingerprint`): the body parsed as JSON and compared as a
  value: object key order and insignificant whitespace are ignored; strings compare
  by their characters (an escape and the character it stands for are the same);
  numbers compare exactly as decimals (``1``, ``1.0`` and ``1e0`` are the same,
  ``0.1`` and ``0.10000000000000001`` are not: no float rounding). A body that is
  not one JSON text in UTF-8, or whose object repeats a key, is compared byte for
  byte (never equal to a JSON one).
- ``JSONFingerprint(include=..., exclude=...)``: only the fields at those paths
  (``"customer.id"``, ``("odd.key", "x")``; ``"*"`` is every member or item), the
  rest ignored: a retry that changes an ignored field (a client timestamp, a trace
  id) is a replay and gets the *first* request's response.
- a function ``(scope, body) -> bytes | str``: whatever it returns is compared; it may
  raise ``ValueError`` for a body it cannot fingerprint (the request gets 400).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from .._types import Scope
from ..errors import ConfigurationError

__all__ = [
    "BodyBytes",
    "Fingerprint",
    "FingerprintFunc",
    "FingerprintSpec",
    "FunctionFingerprint",
    "JSONFingerprint",
    "fingerprint_of",
]

FingerprintFunc = Callable[[Scope, bytes], "bytes | str"]
Path = tuple[str, ...]

# Tags keep the kinds apart: no JSON value's text equals a raw body's or a function's.
_JSON = b"\x00json\x00"
_RAW = b"\x00raw\x00"
_FUNC = b"\x00fn\x00"


class Fingerprint:
    """What of a body is compared (a base: :class:`BodyBytes`, :class:`JSONFingerprint`,
    :class:`FunctionFingerprint`)."""

    __slots__ = ()

    def __call__(self, scope: Scope, body: bytes) -> bytes:
        raise NotImplementedError


class BodyBytes(Fingerprint):
    """Every byte of the body (the default)."""

    __slots__ = ()

    def __call__(self, scope: Scope, body: bytes) -> bytes:
        return body

    def __eq__(self, other: object) -> bool:
        return type(other) is BodyBytes

    def __hash__(self) -> int:
        return hash(BodyBytes)

    def __repr__(self) -> str:
        return "BodyBytes()"


class JSONFingerprint(Fingerprint):
    """The body as a JSON value (see the module's docs); ``include`` keeps only the fields
    at those paths, ``exclude`` drops the ones at those paths (after ``include``)."""

    __slots__ = ("exclude", "include")

    include: tuple[Path, ...] | None
    exclude: tuple[Path, ...]

    def __init__(
        self,
        *,
        include: Iterable[str | Iterable[str]] | None = None,
        exclude: Iterable[str | Iterable[str]] = (),
    ) -> None:
        self.include = None if include is None else _paths(include, "include")
        self.exclude = _paths(exclude, "exclude")

    def __call__(self, scope: Scope, body: bytes) -> bytes:
        try:
            value = json.loads(
                body.decode("utf-8"),
                parse_float=_number,
                parse_int=_number,
                parse_constant=_no_constant,
                object_pairs_hook=_object,
            )
            if self.include is not None:
                value = _pick(value, list(self.include))
            if self.exclude:
                value = _drop(value, list(self.exclude))
            text = _canonical(value)
        except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError too
            return _RAW + body
        return _JSON + text.encode("ascii")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, JSONFingerprint)
            and self.include == other.include
            and self.exclude == other.exclude
        )

    def __hash__(self) -> int:
        return hash((JSONFingerprint, self.include, self.exclude))

    def __repr__(self) -> str:
        return f"JSONFingerprint(include={self.include!r}, exclude={self.exclude!r})"


class FunctionFingerprint(Fingerprint):
    """What ``func(scope, body)`` returns (bytes, or text as UTF-8)."""

    __slots__ = ("func",)

    def __init__(self, func: FingerprintFunc) -> None:
        if not callable(func):
            raise ConfigurationError(f"fingerprint must be callable, got {func!r}")
        self.func = func

    def __call__(self, scope: Scope, body: bytes) -> bytes:
        result = self.func(scope, body)
        if isinstance(result, str):
            result = result.encode("utf-8", "surrogatepass")
        if not isinstance(result, bytes | bytearray):
            raise TypeError(f"a fingerprint function must return bytes or str, got {result!r}")
        return _FUNC + bytes(result)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FunctionFingerprint) and self.func == other.func

    def __hash__(self) -> int:
        return hash((FunctionFingerprint, self.func))

    def __repr__(self) -> str:
        return f"FunctionFingerprint({self.func!r})"


FingerprintSpec = Literal["bytes", "json"] | Fingerprint | FingerprintFunc


def fingerprint_of(spec: FingerprintSpec) -> Fingerprint:
    """The fingerprint ``spec`` names; anything else is a ConfigurationError."""
    if isinstance(spec, Fingerprint):
        return spec
    if spec == "bytes":
        return BodyBytes()
    if spec == "json":
        return JSONFingerprint()
    if callable(spec):
        return FunctionFingerprint(spec)
    raise ConfigurationError(
        f"fingerprint must be 'bytes', 'json', a JSONFingerprint or a function, got {spec!r}"
    )


def _paths(paths: Iterable[str | Iterable[str]], what: str) -> tuple[Path, ...]:
    if isinstance(paths, str):
        raise ConfigurationError(f"{what} must be a sequence of paths, got {paths!r}")
    out: list[Path] = []
    for path in paths:
        parts = tuple(path.split(".")) if isinstance(path, str) else tuple(path)
        if not parts or not all(isinstance(p, str) and p for p in parts):
            raise ConfigurationError(f"{what} path {path!r} must name one or more fields")
        out.append(parts)
    return tuple(out)


class _Number:
    """A JSON number, kept as its exact decimal value (never a float)."""

    __slots__ = ("text",)

    def __init__(self, literal: str) -> None:
        try:
            sign, digits, exponent = Decimal(literal).as_tuple()
        except InvalidOperation:
            raise ValueError(f"not a number: {literal[:20]}") from None
        if not isinstance(exponent, int):  # NaN, Infinity: no JSON number
            raise ValueError("not a JSON number")
        kept = list(digits)
        while len(kept) > 1 and kept[-1] == 0:  # 1.50 is 15e-1, 100 is 1e2
            kept.pop()
            exponent += 1
        if kept == [0]:
            self.text = "0"  # -0, 0.0 and 0e5 are zero
        else:
            self.text = ("-" if sign else "") + "".join(map(str, kept)) + f"e{exponent}"


def _number(literal: str) -> _Number:
    return _Number(literal)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        # Which one counts differs between parsers: ambiguous, so compared as bytes.
        raise ValueError("an object repeats a key")
    return value


_MISSING = object()


class _Items(dict[str, Any]):
    """Some items of a list, by index: a field of the second item is not the first's."""

    __slots__ = ()


def _pick(value: Any, paths: list[Path]) -> Any:
    """Only the parts of ``value`` at ``paths`` (relative to it); _MISSING if none is there."""
    if any(not p for p in paths):
        return value
    members: Iterable[tuple[str, Any]]
    if isinstance(value, dict):
        members = value.items()
    elif isinstance(value, list):
        members = ((str(i), item) for i, item in enumerate(value))
    else:
        return _MISSING
    out: dict[str, Any] = {} if isinstance(value, dict) else _Items()
    for name, member in members:
        inner = [p[1:] for p in paths if p[0] == "*" or p[0] == name]
        if inner:
            picked = _pick(member, inner)
            if picked is not _MISSING:
                out[name] = picked
    return out


def _drop(value: Any, paths: list[Path]) -> Any:
    """``value`` without the parts at ``paths``."""
    if isinstance(value, dict):  # _Items too (picked from a list): kept _Items
        out: dict[str, Any] = _Items() if isinstance(value, _Items) else {}
        for name, member in value.items():
            inner = [p[1:] for p in paths if p[0] == "*" or p[0] == name]
            if any(not p for p in inner):
                continue
            out[name] = _drop(member, inner) if inner else member
        return out
    if isinstance(value, list):
        items = _Items()
        for i, member in enumerate(value):
            name = str(i)
            inner = [p[1:] for p in paths if p[0] == "*" or p[0] == name]
            if any(not p for p in inner):
                continue
            items[name] = _drop(member, inner) if inner else member
        # Kept by index: dropping item 0 does not make item 1 the first.
        return items if len(items) != len(value) else list(items.values())
    return value


def _canonical(value: Any) -> str:
    if isinstance(value, _Items):  # "[0:..]" is no JSON text: never equal to a list's
        return "[" + ",".join(f"{i}:{_canonical(item)}" for i, item in value.items()) + "]"
    if isinstance(value, dict):
        return (
            "{" + ",".join(json.dumps(k) + ":" + _canonical(value[k]) for k in sorted(value)) + "}"
        )
    if isinstance(value, list):
        return "[" + ",".join(_canonical(item) for item in value) + "]"
    if isinstance(value, _Number):
        return value.text
    # Strings (escaped to ASCII: one form per string), true, false, null.
    return json.dumps(value)
