"""A WSGI request as an ASGI scope, and an ASGI status as a WSGI status line (PEP 3333)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from ..._types import Scope

__all__ = ["scope_of", "status_line"]


def status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def scope_of(environ: dict[str, Any]) -> Scope:
    """The ASGI scope of a WSGI request (PEP 3333 strings are latin-1 bytes)."""
    headers: list[tuple[bytes, bytes]] = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            field = name[5:].replace("_", "-").lower()
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if not value:
                continue
            field = name.replace("_", "-").lower()
        else:
            continue
        headers.append((field.encode("latin-1"), str(value).encode("latin-1")))
    script = environ.get("SCRIPT_NAME", "")
    path = environ.get("PATH_INFO", "") or "/"
    raw = (script + path).encode("latin-1")
    remote = environ.get("REMOTE_ADDR") or ""
    client: tuple[str, int] | None = None
    if remote:
        try:
            client = (remote, int(environ.get("REMOTE_PORT") or 0))
        except ValueError:
            client = (remote, 0)
    protocol = str(environ.get("SERVER_PROTOCOL", "HTTP/1.1"))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": protocol.split("/", 1)[-1] if "/" in protocol else "1.1",
        "method": str(environ.get("REQUEST_METHOD", "GET")).upper(),
        "scheme": environ.get("wsgi.url_scheme", "http"),
        # Invalid UTF-8 kept as surrogates, not replaced: the request digest encodes the
        # path back to exactly these bytes, so distinct paths never share one digest.
        "path": raw.decode("utf-8", "surrogateescape"),
        "raw_path": raw,
        "root_path": script.encode("latin-1").decode("utf-8", "replace"),
        "query_string": str(environ.get("QUERY_STRING", "")).encode("latin-1"),
        "headers": headers,
        "client": client,
        "server": (environ.get("SERVER_NAME", ""), int(environ.get("SERVER_PORT") or 0)),
        "state": {},
        "wsgi.environ": environ,
    }
