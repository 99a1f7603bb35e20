"""Which blocks each pipeline stage holds: contiguous runs, balanced by cost. Pure (no torch): the split
(``pipeline/split.py``) cuts a model with it and the planner counts each rank's share with it. No
communication here.
"""

from __future__ import annotations

from collections.abc import Sequence

# the fixes for a pipeline with more stages than the model has blocks (both places that refuse one)
FEWER_STAGES = (
    "lower --pp, or hold fewer stages per rank (--virtual-stages; zbv and dualpipev hold two, "
    "zb and 1f1b one)"
)


def balance(costs: Sequence[float], stages: int) -> list[list[int]]:
    """Contiguous runs of block indices, one per stage, each non-empty, minimising the largest sum of
    ``costs`` (dynamic programming over cut points; blocks are few)."""
    n = len(costs)
    if n < stages:  # the callers refuse such a split in their own words first (split.plan_stages)
        raise ValueError(f"{n} blocks cannot fill {stages} stages")
    prefix: list[float] = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost putting blocks [0, i) on s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    runs, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        runs.append(list(range(start, end)))
        end = start
    return runs[::-1]
