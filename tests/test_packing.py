import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.trainer.packing import pack_microbatches

cases = st.tuples(
    st.lists(st.integers(min_value=0, max_value=120), max_size=60),
    st.integers(min_value=1, max_value=100),
    st.integers(min_value=1, max_value=8),
)


def test_docstring_example() -> None:
    plan = pack_microbatches([5, 4, 3, 2, 1], token_budget=6, n_ranks=2)
    assert plan == [[[0, 4], [2]], [[1, 3], []]]


def test_single_rank_best_fit() -> None:
    # best fit puts the 2 next to the 8 (room 2), not next to the 5 (room 5)
    assert pack_microbatches([8, 5, 2], token_budget=10) == [[[0, 2], [1]]]


def test_oversized_sample_goes_alone() -> None:
    plan = pack_microbatches([3, 50, 2], token_budget=10)
    assert plan == [[[1], [0, 2]]]


def test_more_ranks_than_batches_pads_with_empty_microbatches() -> None:
    assert pack_microbatches([4], token_budget=10, n_ranks=3) == [[[0]], [[]], [[]]]
    assert pack_microbatches([], token_budget=10, n_ranks=2) == [[], []]


@pytest.mark.parametrize(
    ("lengths", "budget", "ranks", "match"),
    [([1], 0, 1, "token_budget"), ([1], 5, 0, "n_ranks"), ([-1], 5, 1, "non-negative")],
)
def test_bad_arguments(lengths: list[int], budget: int, ranks: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack_microbatches(lengths, budget, ranks)


@settings(max_examples=300, deadline=None)
@given(cases)
def test_packing_properties(case: tuple[list[int], int, int]) -> None:
    lengths, budget, n_ranks = case
    plan = pack_microbatches(lengths, budget, n_ranks)

    assert len(plan) == n_ranks
    assert len({len(rank) for rank in plan}) == 1, "ranks must run equally many micro-batches"
    flat = [i for rank in plan for mb in rank for i in mb]
    assert sorted(flat) == list(range(len(lengths))), "every index exactly once"

    batches = [mb for rank in plan for mb in rank if mb]
    sizes = [sum(lengths[i] for i in mb) for mb in batches]
    for mb, size in zip(batches, sizes, strict=True):
        assert size <= budget or len(mb) == 1, "only a lone oversized sample may exceed"
        assert mb == sorted(mb)
    # best fit never leaves two bins that could have been merged: at most one is half empty
    assert sum(1 for s in sizes if s <= budget / 2) <= 1
    # greedy largest-first: rank totals differ by at most the largest micro-batch
    totals = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(totals) - min(totals) <= max(sizes, default=0)

    assert pack_microbatches(list(lengths), budget, n_ranks) == plan, "deterministic"
