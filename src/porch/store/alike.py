"""Alike hits of a batch, sent to a remote store as one entry with a count.

n requests of one client under one rule, in one batch, are n hits on the same
counters with the same limits and cost. Decided in arrival order, the first k
that fit under every limit are allowed and the rest refused (an allowed hit
only ever takes units, so once one is refused every later one is), so the
server needs only the count n and answers with k and the state before them: a
hot client costs one step of the server per batch, not one per request.

Alike settles (the refunds of one client's requests of one rule, in one window)
go as one settle of their summed units, where summing is exact: fixed and sliding
windows count whole units, and units of one sign, settled one by one, end where
their sum ends (a count is only clamped at zero, and only by refunds). A gcra
settle moves a time in doubles, so gcra settles keep one entry each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar, cast

from .algorithms import GCRA, TAGS, Report, State, charge, fill_reports, fits, report
from .base import Hit, Settle, Vacate

__all__ = ["collapse_hits", "fill_decided", "fill_slots"]

Op = TypeVar("Op")


def collapse_hits(ops: Sequence[Op]) -> tuple[list[Op], dict[int, list[Hit]]]:
    """The ops to send, and per sent hit (by position) the alike hits it stands for.

    Hits are alike when they name the same counters with the same amounts,
    windows, algorithms, bursts and cost, and the same concurrency slots with the
    same caps; alike settles, see the module docstring. An op joins the group of
    alike ops before it (sent in the first one's place: hits as one entry with a
    count, settles as one settle of their summed deltas) only if that group was the
    last to touch each of its counters and slots, so every counter still sees its ops
    in arrival order: a hot client's batch of hits, then settles, then hits goes as
    three entries. Other ops touch no counter and keep their places.
    """
    sent: list[Op] = []
    alike: dict[int, list[Hit]] = {}
    latest: dict[tuple[Any, ...], int] = {}  # each shape's last group, by its place in sent
    touched: dict[str, int] = {}  # each counter's and slot's last group, by its place
    last: Hit | None = None  # the previous op if a hit, and the group it joined
    last_group: list[Hit] = []
    for op in ops:
        if isinstance(op, Hit):
            # A hot client's batch is a run of alike hits, each with its own keys list
            # but its rule's amounts and windows (the same objects): compared with the
            # previous op without building its shape.
            if (
                last is not None
                and (op.amounts is last.amounts or op.amounts == last.amounts)
                and (op.windows is last.windows or op.windows == last.windows)
                and op.cost == last.cost
                and (op.algorithms is last.algorithms or op.algorithms == last.algorithms)
                and (op.bursts is last.bursts or op.bursts == last.bursts)
                and op.keys == last.keys
                and op.slots == last.slots
                and (op.caps is last.caps or op.caps == last.caps)
            ):
                last_group.append(op)
                continue
            shape = (
                tuple(op.keys),
                tuple(op.amounts),
                tuple(op.windows),
                op.cost,
                None if op.algorithms is None else tuple(op.algorithms),
                None if op.bursts is None else tuple(op.bursts),
                None if op.slots is None else tuple(op.slots),
                tuple(op.caps),
            )
            keys: Sequence[str] = (*op.keys, *op.slots) if op.slots else op.keys
            at = latest.get(shape)
            if at is not None and all(touched[key] == at for key in keys):
                last, last_group = op, alike[at]
                last_group.append(op)
                continue
            at = latest[shape] = len(sent)
            last, last_group = op, [op]
            alike[at] = last_group
        elif isinstance(op, Settle):
            last = None
            keys = op.keys
            settle_shape = _settle_shape(op)
            if settle_shape is not None:
                at = latest.get(settle_shape)
                if at is not None and all(touched[key] == at for key in keys):
                    sent[at] = cast(Op, _summed(cast(Settle, sent[at]), op))
                    continue
                latest[settle_shape] = len(sent)
        elif isinstance(op, Vacate):
            # A slot freed between two hits that may take it: they decide apart.
            last = None
            keys = op.slots
        else:
            sent.append(op)  # a claim, a save...: no counter, no slot
            continue
        for key in keys:
            touched[key] = len(sent)
        sent.append(op)
    return sent, alike


def _settle_shape(op: Settle) -> tuple[Any, ...] | None:
    """What a settle must share with another to be summed with it, or None: never (a
    gcra limit's)."""
    algorithms = op.algorithms
    if algorithms is not None and any(TAGS[a] == GCRA for a in algorithms):
        return None
    return (
        "settle",
        tuple(op.keys),
        tuple(op.amounts),
        tuple(op.windows),
        None if algorithms is None else tuple(algorithms),
        None if op.bursts is None else tuple(op.bursts),
        tuple(op.stamps),
        tuple(delta < 0 for delta in op.deltas),
    )


def _summed(first: Settle, then: Settle) -> Settle:
    """One settle of both settles' units (alike: ``_settle_shape``), a new op: the ops
    a caller submitted are never changed."""
    return Settle(
        first.keys,
        first.amounts,
        first.windows,
        [a + b for a, b in zip(first.deltas, then.deltas, strict=True)],
        first.stamps,
        first.algorithms,
        first.bursts,
    )


def fill_decided(
    hits: Sequence[Hit],
    allowed: int,
    ns: Sequence[int],
    ps: Sequence[int],
    ss: Sequence[float],
    t: float,
    wall: float,
) -> None:
    """Fill alike hits in arrival order from a store's decision: the first ``allowed``
    counted, the rest refused.

    Per limit, the state ``(n, p, s)`` the first of them saw (read at ``t``: an
    elapsed window rolled, a row of another algorithm fresh); the j-th hit sees it
    charged min(j - 1, allowed) times, and reports it charged min(j, allowed) times
    (docs/design.md, "Policies"), computed here as SQLite computes it
    (:mod:`porch.store.algorithms`), so every store reports the same doubles.
    ``wall``: the decisions' wall time.
    """
    first = hits[0]
    cost = first.cost
    amounts = first.amounts
    windows = first.windows
    algorithms = first.algorithms
    if algorithms is None or all(a == "fixed" for a in algorithms):
        # Fixed windows (the common rule): next, full and retry are all the window's end,
        # one list shared, read only.
        ends = [s + w - t for s, w in zip(ss, windows, strict=True)]
        stamp = list(ss)
        if len(ns) == 1:  # one limit: no comprehension per hit
            count, amount = ns[0], amounts[0]
            for j, hit in enumerate(hits, 1):
                n = count + cost * (j if j < allowed else allowed)
                hit.allowed = j <= allowed
                hit.fits = [hit.allowed or n + cost <= amount]
                hit.remaining = [amount - n if n < amount else 0]
                hit.next = hit.full = hit.retry = ends
                hit.stamp = stamp
                hit.wall = wall
            return
        for j, hit in enumerate(hits, 1):
            step = cost * (j if j < allowed else allowed)
            hit.allowed = j <= allowed
            counts = [c + step for c in ns]
            hit.fits = [
                c + cost <= a if j > allowed else True for c, a in zip(counts, amounts, strict=True)
            ]
            hit.remaining = [a - c if c < a else 0 for c, a in zip(counts, amounts, strict=True)]
            hit.next = hit.full = hit.retry = ends
            hit.stamp = stamp
            hit.wall = wall
        return
    tags = [TAGS[a] for a in algorithms]
    bursts = first.bursts if first.bursts is not None else amounts
    limits = list(zip(tags, amounts, windows, bursts, strict=True))
    # Each limit's states after 0, 1, ... allowed charges (as many as the hits need).
    counted = min(allowed, len(hits))
    states: list[list[State]] = []
    for (tag, amount, window, _), n, p, s in zip(limits, ns, ps, ss, strict=True):
        state: State = (n, p, s)
        seq = [state]
        for _ in range(counted):
            state = charge(tag, state, cost, amount, window)
            seq.append(state)
        states.append(seq)
    refused_fits: list[bool] | None = None
    refused_reports: list[Report] | None = None
    for j, hit in enumerate(hits, 1):
        hit.allowed = j <= allowed
        if hit.allowed:
            hit.fits = [True] * len(limits)
            reports = [
                report(tag, seq[j], t, cost, amount, window, burst)
                for (tag, amount, window, burst), seq in zip(limits, states, strict=True)
            ]
        else:
            if refused_reports is None or refused_fits is None:
                refused_fits = [
                    fits(tag, seq[counted], t, cost, amount, window, burst)
                    for (tag, amount, window, burst), seq in zip(limits, states, strict=True)
                ]
                refused_reports = [
                    report(tag, seq[counted], t, cost, amount, window, burst)
                    for (tag, amount, window, burst), seq in zip(limits, states, strict=True)
                ]
            hit.fits = refused_fits
            reports = refused_reports
        fill_reports(hit, reports, wall)


def fill_slots(
    hits: Sequence[Hit], allowed: int, in_flight: Sequence[int], tokens: Sequence[int]
) -> None:
    """Fill the slots of alike hits (after :func:`fill_decided`): per slot key the
    requests in flight before them, and the tokens of the first ``allowed`` (one each,
    in order). The j-th hit reports the count with min(j, allowed) of them."""
    for j, hit in enumerate(hits, 1):
        taken = j if j < allowed else allowed
        hit.in_flight = [n + taken for n in in_flight]
        hit.token = tokens[j - 1] if j <= allowed else 0
