"""Split one step's samples into token-budgeted micro-batches, balanced across trainer ranks.

Pure Python (no torch), deterministic: every rank computes the same plan from the same
lengths and takes its own share without communicating.
"""

from __future__ import annotations

import bisect
import heapq


def _best_fit_decreasing(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Bins of sample indices, each summing to at most ``token_budget`` (oversized: alone)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # (room left, bin id), sorted: the first entry with enough room is the best fit, and
    # ties go to the older bin, which keeps the result deterministic.
    open_bins: list[tuple[int, int]] = []
    for i in order:
        size = lengths[i]
        pos = bisect.bisect_left(open_bins, (size, -1))
        if pos < len(open_bins):
            room, b = open_bins.pop(pos)
            bins[b].append(i)
            bisect.insort(open_bins, (room - size, b))
            continue
        bins.append([i])
        if size <= token_budget:
            bisect.insort(open_bins, (token_budget - size, len(bins) - 1))
    return bins


def pack_microbatches(
    lengths: list[int], token_budget: int, n_ranks: int = 1
) -> list[list[list[int]]]:
    """Plan micro-batches: ``plan[rank][k]`` is the list of sample indices of micro-batch k.

    - Each micro-batch holds at most ``token_budget`` tokens, packed by best-fit decreasing.
      A sample longer than the budget cannot be split here, so it gets a micro-batch of its
      own (the only case where the budget is exceeded).
    - Micro-batches go largest first to the rank with the fewest tokens so far, so the
      ranks' token totals differ by at most one micro-batch's worth.
    - Every rank gets the same number of micro-batches, padded with empty ones at the end:
      each micro-batch's forward/backward runs collectives (FSDP all-gather, gradient
      reduce), so all ranks must run the same count; a rank holding an empty micro-batch
      still runs a step on a dummy, fully masked input.

    Every index appears exactly once; indices inside a micro-batch are ascending.

    Example: ``lengths=[5, 4, 3, 2, 1], token_budget=6, n_ranks=2`` packs lengths ``5+1``,
    ``4+2`` and ``3``; the plan is ``[[[0, 4], [2]], [[1, 3], []]]`` (9 and 6 tokens).
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if any(n < 0 for n in lengths):
        raise ValueError("sample lengths must be non-negative")

    bins = _best_fit_decreasing(lengths, token_budget)
    totals = [sum(lengths[i] for i in b) for b in bins]
    plan: list[list[list[int]]] = [[] for _ in range(n_ranks)]
    # (tokens so far, micro-batches so far, rank): ties favour the rank with fewer batches,
    # which keeps the padding short.
    load = [(0, 0, r) for r in range(n_ranks)]
    for b in sorted(range(len(bins)), key=lambda b: (-totals[b], b)):
        tokens, count, rank = heapq.heappop(load)
        plan[rank].append(sorted(bins[b]))
        heapq.heappush(load, (tokens + totals[b], count + 1, rank))

    n_micro = max(len(p) for p in plan)
    for p in plan:
        p.extend([] for _ in range(n_micro - len(p)))
    return plan
