from __future__ import annotations

import time

import pytest

from porch.clock import ManualClock, SystemClock


def test_system_clock_reads_both_clocks_and_a_boot_id() -> None:
    clock = SystemClock()
    assert abs(clock.wall() - time.time()) < 5
    assert abs(clock.monotonic() - time.monotonic()) < 5
    assert clock.boot_id()
    assert clock.boot_id() == SystemClock().boot_id()


def test_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(monotonic=10.0, wall=100.0)
    clock.advance(5)
    assert (clock.monotonic(), clock.wall()) == (15.0, 105.0)
    clock.jump_wall(-50)
    assert (clock.monotonic(), clock.wall()) == (15.0, 55.0)
    clock.reboot("b2")
    assert (clock.monotonic(), clock.boot_id()) == (0.0, "b2")
    with pytest.raises(ValueError, match="time cannot run backwards"):
        clock.advance(-1)
