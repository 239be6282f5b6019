"""Store URLs as they may be shown: every password form replaced by ``***``.

A store URL can carry a secret in more than one place, and drivers accept them
all: the userinfo (``redis://user:pw@host``), a query parameter
(``?password=``, which redis-py and libpq both read, also as ``sslpassword``
or percent-encoded: ``?pass%77ord=``), or a libpq ``key=value`` string.
:func:`redact` is the one function every message, log line, ``repr`` and
command output that may hold a URL goes through.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["redact"]

HIDDEN = "***"

# The userinfo's password: after "scheme://user:" and up to the last "@" of the
# authority (a password may hold "@"; the authority ends at "/", "?", "#" or a space).
_USERINFO = re.compile(r"(?i)([a-z][a-z0-9+.\-]*://[^/?#\s:@]*:)[^/?#\s]*@")
# A parameter: in a query (after ? & ;) or a libpq keyword string (after a space or
# at the start). Its value is a quoted libpq string or runs to the next separator.
_PARAMETER = re.compile(r"(^|[?&;\s])([^=&?;#\s]+)(\s*=\s*)('(?:[^'\\]|\\.)*'|[^&;#\s]*)")
# A parameter whose (decoded) name says it holds a secret.
_SECRET_NAME = re.compile(r"pass|pwd|secret|token|auth|key")


def redact(text: str) -> str:
    """``text`` (a URL, or a message quoting one) with every password in it replaced."""
    text = _USERINFO.sub(lambda m: m.group(1) + HIDDEN + "@", text)
    return _PARAMETER.sub(_hide_secret, text)


def _hide_secret(match: re.Match[str]) -> str:
    lead, name, equals, _value = match.groups()
    if _SECRET_NAME.search(unquote(name).lower()) is None:
        return match.group(0)
    return lead + name + equals + HIDDEN
