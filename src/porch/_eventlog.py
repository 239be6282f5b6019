"""Refusals and failures on the ``porch.*`` loggers, throttled so a flood cannot flood the log.

Every refusal (429, 409, 413, 422, 400) and every 503 reaches :meth:`EventLog.event`.
A line is written at most once per ``interval`` per key (a client and rule, a
shard, a cause) and at most ``rate`` lines per second in all; the next line
written for a key says how many were suppressed since the last one
(``suppressed``), and how many the overall cap dropped (``dropped``). The
fields go to ``extra=``, so JSON formatters see them as structured fields.
Memory is bounded: at most ``capacity`` keys are remembered (the oldest are
forgotten first, their suppressed counts moved to ``dropped``).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from .errors import ConfigurationError

__all__ = ["EventLog"]


class EventLog:
    """A throttled structured logger for one middleware."""

    __slots__ = ("_budget", "_capacity", "_dropped", "_entries", "_rate", "_second", "logger")

    def __init__(self, logger: logging.Logger, *, capacity: int = 4096, rate: int = 20) -> None:
        if capacity < 1:
            raise ConfigurationError(f"log throttle capacity must be >= 1, got {capacity}")
        if rate < 1:
            raise ConfigurationError(f"log rate must be >= 1 line per second, got {rate}")
        self.logger = logger
        self._capacity = capacity
        self._rate = rate
        # key -> [time before which the key's lines are suppressed, lines suppressed]
        self._entries: dict[Hashable, list[float]] = {}
        self._second = float("-inf")
        self._budget = rate
        self._dropped = 0

    def event(
        self,
        level: int,
        key: Hashable,
        now: float,
        interval: float,
        message: str,
        *args: object,
        **fields: Any,
    ) -> bool:
        """Log ``message % args`` with ``fields`` unless throttled; return whether it was."""
        if not self.logger.isEnabledFor(level):
            return False
        entries = self._entries
        entry = entries.get(key)
        if entry is not None and now < entry[0]:
            entry[1] += 1
            return False
        if now - self._second >= 1.0:
            self._second = now
            self._budget = self._rate
        if self._budget <= 0:
            if entry is not None:
                entry[1] += 1
            else:
                self._dropped += 1
            return False
        self._budget -= 1
        suppressed = int(entry[1]) if entry is not None else 0
        dropped, self._dropped = self._dropped, 0
        if entry is not None:
            del entries[key]  # re-inserted last: the dict's order is the eviction order
        entries[key] = [now + interval, 0]
        if len(entries) > self._capacity:
            oldest = next(iter(entries))
            dropped += int(entries.pop(oldest)[1])
        if suppressed or dropped:
            message += " (%d similar suppressed, %d other lines dropped)"
            args = (*args, suppressed, dropped)
        self.logger.log(
            level, message, *args, extra={**fields, "suppressed": suppressed, "dropped": dropped}
        )
        return True
