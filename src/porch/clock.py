"""Clocks: monotonic time for window arithmetic, wall time for client-facing headers.

The limiter never reads time directly; it is handed a :class:`Clock`. The
monotonic clock is immune to wall-clock jumps but restarts at boot, so the
clock also names the boot it belongs to: a store that finds windows recorded
under another boot rebases them on wall time (never counting a backward jump
as elapsed time).
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


class Clock(Protocol):
    """The time source porch reads; inject one to move time in tests."""

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps; comparable within one boot."""
        ...

    def wall(self) -> float:
        """Unix seconds, for headers a client reads and for rebasing after a reboot."""
        ...

    def boot_id(self) -> str:
        """An identifier of the current boot; monotonic readings compare only within it."""
        ...


def _read_boot_id() -> str:
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        # No Linux boot id: the boot time (wall minus monotonic) to the minute is
        # stable for the life of a boot unless the wall clock is stepped a lot.
        return f"boot-{int((time.time() - time.monotonic()) // 60)}"


class SystemClock:
    """The real clocks: ``CLOCK_MONOTONIC`` (shared by every process of a boot) and ``time()``."""

    __slots__ = ("_boot_id",)

    def __init__(self) -> None:
        self._boot_id = _read_boot_id()

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def boot_id(self) -> str:
        return self._boot_id


class ManualClock:
    """A clock that moves only when told to; for tests."""

    __slots__ = ("_boot", "_mono", "_wall")

    def __init__(
        self,
        *,
        monotonic: float = 1000.0,
        wall: float = 1_700_000_000.0,
        boot_id: str = "manual-boot",
    ) -> None:
        self._mono = monotonic
        self._wall = wall
        self._boot = boot_id

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._wall

    def boot_id(self) -> str:
        return self._boot

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass on both clocks."""
        if seconds < 0:
            raise ValueError("time cannot run backwards; use jump_wall() to step the wall clock")
        self._mono += seconds
        self._wall += seconds

    def jump_wall(self, seconds: float) -> None:
        """Step only the wall clock (an NTP correction or an operator's mistake)."""
        self._wall += seconds

    def reboot(self, boot_id: str, *, monotonic: float = 0.0) -> None:
        """Simulate a reboot: a new boot id and a monotonic clock starting over."""
        self._boot = boot_id
        self._mono = monotonic
