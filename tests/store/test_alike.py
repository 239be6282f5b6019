"""Which ops of a batch go as one entry (porch/store/alike.py): alike ops whose counters
saw nothing else between them; everything else in its place, in arrival order.

What the stores then decide is proven against the reference model for every
network store in tests/store/conformance/test_alike_hits.py; this is the grouping
itself, case by case.
"""

from __future__ import annotations

from collections.abc import Sequence

from porch.store.alike import collapse_hits
from porch.store.base import Algorithm, Claim, Hit, Settle, StoreOp, Vacate


def hit(key: str = "k", cost: int = 1, slots: list[str] | None = None) -> Hit:
    return Hit([key], [10], [60.0], cost=cost, slots=slots, caps=[5] if slots else ())


def settle(
    key: str = "k", delta: int = -1, stamp: float = 0.0, algorithm: Algorithm = "fixed"
) -> Settle:
    return Settle([key], [10], [60.0], [delta], [stamp], [algorithm])


def shape(sent: Sequence[object], alike: dict[int, list[Hit]]) -> list[object]:
    """Each sent entry: a hit group's size, a settle's deltas, or the op's type name."""
    return [
        len(alike[i]) if i in alike else op.deltas if isinstance(op, Settle) else type(op).__name__
        for i, op in enumerate(sent)
    ]


def test_alike_settles_are_summed_into_one_and_the_submitted_ones_are_untouched() -> None:
    ops = [settle(delta=-2), settle(delta=-3), settle(delta=-1)]
    sent, alike = collapse_hits(ops)
    assert shape(sent, alike) == [[-6]]
    assert [op.deltas for op in ops] == [[-2], [-3], [-1]]


def test_settles_are_summed_only_alike() -> None:
    ops: list[StoreOp] = [
        settle(delta=-1),
        settle(delta=2),  # a charge: not summed with refunds (a count clamps at zero)
        settle(delta=-1, stamp=60.0),  # another window
        settle(delta=-1, algorithm="gcra"),  # a time in doubles: never summed
        settle(delta=-1, algorithm="gcra"),
        settle("other", delta=-1),
    ]
    sent, alike = collapse_hits(ops)
    assert shape(sent, alike) == [[-1], [2], [-1], [-1], [-1], [-1]]


def test_a_run_is_closed_by_another_op_on_its_counter() -> None:
    # Hits, a settle, hits: the settle counts between them, so three entries; the same
    # for a settle, a hit, a settle (the second settle is not moved before the hit).
    sent, alike = collapse_hits([hit(), hit(), settle(), hit(), hit(), hit()])
    assert shape(sent, alike) == [2, [-1], 3]
    sent, alike = collapse_hits([settle(), hit(), settle(), settle()])
    assert shape(sent, alike) == [[-1], 1, [-2]]
    # Unlike hits on one counter (another cost) close each other's runs too.
    sent, alike = collapse_hits([hit(), hit(cost=2), hit(), hit(cost=2)])
    assert shape(sent, alike) == [1, 1, 1, 1]


def test_ops_on_other_counters_do_not_close_a_run() -> None:
    claim = Claim("record")
    ops: list[StoreOp] = [hit("a"), settle("b"), hit("b"), claim, hit("a"), settle("b")]
    sent, alike = collapse_hits(ops)
    assert shape(sent, alike) == [2, [-1], 1, "Claim", [-1]]
    assert sent[3] is claim


def test_a_vacate_closes_the_run_of_hits_on_its_slot() -> None:
    ops: list[StoreOp] = [hit(slots=["s"]), Vacate(["s"], 7), hit(slots=["s"]), hit(slots=["s"])]
    sent, alike = collapse_hits(ops)
    assert shape(sent, alike) == [1, "Vacate", 2]
