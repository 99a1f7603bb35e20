"""Which blocks each pipeline stage holds: contiguous runs, balanced by cost. Pure (no torch): the split
(``pipeline/split.py``) cuts a model with it and the planner counts each rank's share with it.

The cost is a stage's matrix work per token, counted in the weights it multiplies by: a block's
parameters, and the ends' (``ends``): nothing for the first stage's embeddings (a lookup reads one row
per token), the head's whole matrix for the last (a matmul over the vocabulary, tied to the embedding or
not). The last stage of a model with a large vocabulary therefore holds fewer blocks (Megatron-LM offers
the same, off by default: ``account_for_loss_in_pipeline_split`` counts the loss as a layer). Among the
splits of least work the one whose heaviest stage holds the fewest parameters is taken: Llama 3 70B on 8
stages (the head about 1.2 blocks) then puts its eleventh block on a middle stage, not on the first
beside the embedding. No communication here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# the fixes for a pipeline with more stages than the model has blocks (both places that refuse one)
FEWER_STAGES = (
    "lower --pp, or hold fewer stages per rank (--virtual-stages; zbv and dualpipev hold two, "
    "zb and 1f1b one)"
)


Ends = tuple[float, float]  # what the first and the last stage carry besides their blocks


def balance(
    work: Sequence[float], stages: int, ends: Ends = (0.0, 0.0),
    held: Sequence[float] | None = None, held_ends: Ends = (0.0, 0.0),
) -> list[list[int]]:  # fmt: skip
    """Contiguous runs of block indices, one per stage, each non-empty, minimising the largest stage's
    ``work`` (its blocks' plus ``ends[0]`` on the first stage and ``ends[1]`` on the last); with
    ``held`` (each block's parameters, ``held_ends`` the ends'), among the splits of that least
    largest work the one whose heaviest stage holds least (so the first stage, which holds the
    embedding, does not also get the extra block). Stages, not ranks: under a V schedule one rank holds
    both ends. Dynamic programming over cut points (blocks are few)."""
    if len(work) < stages:  # the callers refuse such a split in their own words first (split.plan_stages)
        raise ValueError(f"{len(work)} blocks cannot fill {stages} stages")
    least, runs = _min_max(work, ends, stages)
    if held is None:
        return runs
    limit = least + abs(least) * 1e-9  # the same sums in both passes: only rounding to allow for
    work_of = _stage_sums(work, ends, stages)
    return _min_max(held, held_ends, stages, lambda s, j, i: work_of(s, j, i) <= limit)[1]


def _stage_sums(values: Sequence[float], ends: Ends, stages: int) -> Callable[[int, int, int], float]:
    """``sum(s, j, i)``: stage ``s``'s (1-based) total holding blocks ``[j, i)``, its end included."""
    prefix: list[float] = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)

    def total(s: int, j: int, i: int) -> float:
        return prefix[i] - prefix[j] + (ends[0] if s == 1 else 0.0) + (ends[1] if s == stages else 0.0)

    return total


def _min_max(
    values: Sequence[float], ends: Ends, stages: int,
    allowed: Callable[[int, int, int], bool] = lambda s, j, i: True,
) -> tuple[float, list[list[int]]]:  # fmt: skip
    """The least largest stage total over the splits whose every stage is ``allowed``, and that split."""
    n, total = len(values), _stage_sums(values, ends, stages)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage total putting blocks [0, i) on s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], total(s, j, i))
                if value < best[s][i] and allowed(s, j, i):
                    best[s][i], cut[s][i] = value, j
    runs, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        runs.append(list(range(start, end)))
        end = start
    return best[stages][n], runs[::-1]
