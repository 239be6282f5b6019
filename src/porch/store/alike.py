"""Alike hits of a batch, sent to a remote store as one entry with a count.

n requests of one client under one rule, in one batch, are n hits on the same
counters with the same amounts and windows. Decided in arrival order, the first
k that fit under every limit are allowed and the rest refused, so the server
needs only the count n and answers with k and the counts before them: a hot
client costs one step of the server per batch, not one per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from .base import Hit

__all__ = ["collapse_hits", "settle_alike"]

Op = TypeVar("Op")


def collapse_hits(ops: Sequence[Op]) -> tuple[list[Op], dict[int, list[Hit]]]:
    """The ops to send, and per sent hit (by position) the alike hits it stands for.

    Hits are alike when they name the same counters with the same amounts and
    windows. Hits whose counters overlap without being alike (a rule changed
    between hosts) keep one entry each, in arrival order.
    """
    sent: list[Op] = []
    alike: dict[int, list[Hit]] = {}
    first: dict[tuple[Any, ...], int] = {}
    owner: dict[str, tuple[Any, ...]] = {}
    last: Hit | None = None  # the previous hit, and the group it joined
    last_group: list[Hit] = []
    for op in ops:
        if isinstance(op, Hit):
            # A hot client's batch is a run of alike hits, each with its own keys list
            # but its rule's amounts and windows (the same objects): compared with the
            # previous hit without building its shape.
            if (
                last is not None
                and (op.amounts is last.amounts or op.amounts == last.amounts)
                and (op.windows is last.windows or op.windows == last.windows)
                and op.keys == last.keys
            ):
                last_group.append(op)
                continue
            shape = (tuple(op.keys), tuple(op.amounts), tuple(op.windows))
            at = first.get(shape)
            if at is not None:
                last, last_group = op, alike[at]
                last_group.append(op)
                continue
            for key in op.keys:
                if owner.setdefault(key, shape) != shape:
                    return list(ops), {}  # a counter shared by unlike hits: one entry each
            first[shape] = len(sent)
            last, last_group = op, [op]
            alike[len(sent)] = last_group
        sent.append(op)
    return sent, alike


def settle_alike(
    hits: Sequence[Hit], allowed: int, before: Sequence[int], resets: Sequence[float], wall: float
) -> None:
    """Fill alike hits in arrival order: the first ``allowed`` counted, the rest refused.

    ``before``: each counter's count before them; the j-th hit sees each count
    plus min(j, allowed).
    """
    if len(before) == 1:  # one limit (the common rule): no comprehension per hit
        count = before[0]
        for j, hit in enumerate(hits, 1):
            hit.allowed = j <= allowed
            hit.counts = [count + (j if j < allowed else allowed)]
            hit.resets = list(resets)
            hit.wall = wall
        return
    for j, hit in enumerate(hits, 1):
        step = j if j < allowed else allowed
        hit.allowed = j <= allowed
        hit.counts = [c + step for c in before]
        hit.resets = list(resets)
        hit.wall = wall
