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
    df = pl.DataFrame({"chunks": [1, 4, 15], "gap_chunk_wait": [0, 3_000_000, 1_000_000]})
    got = df.select(chunked_excess(800_000.0, 10_000.0)).to_series().to_list()
    assert got == [0, 3_000_000 + 3 * 800_000, 1_000_000 + 14 * 800_000]

