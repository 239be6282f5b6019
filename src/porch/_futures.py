"""Answering a future from a callback: the store's writer threads and the WSGI bridge's
app thread reply to a caller's event loop through ``loop.call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["resolve"]


def resolve(future: asyncio.Future[Any], error: BaseException | None, result: Any = None) -> None:
    """Set ``future``'s ``result``, or its exception ``error``; nothing if it is done
    already (cancelled: its caller left)."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
