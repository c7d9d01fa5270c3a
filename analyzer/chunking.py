"""The prefill token budget: long prompts split into many chunks.

With chunked prefill, one engine step computes at most ``--max-num-batched-tokens`` tokens,
so a prompt longer than that is prefilled over several steps. Each extra step costs its fixed
part (scheduling, launching the model, output processing) and the request waits between its
chunks while other work runs; a larger budget (or a long-prefill threshold) would compute the
prompt in fewer, longer steps.

The counterfactual is measured from the run itself: the prefill steps' durations are fitted
as ``a + b * tokens`` (a fixed cost per step plus a cost per token computed in it), and a
request's prefill in one step would have taken ``a + b * its prompt tokens``. The impact is
what its chunked prefill (first chunk start -> last chunk end: prefill, allreduce and the
waits between chunks) took beyond that.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from .findings import Context, Finding, detector
from .findings import finding as _finding

#: fewer requests than this with a split prompt, or fewer prefill steps to fit: no verdict
MIN_REQUESTS, MIN_STEPS = 5, 8


def step_cost(steps: pl.DataFrame) -> tuple[float, float] | None:
    """(fixed ns per step, ns per token) fitted over the prefill steps (least squares, both
    kept >= 0); None when the steps do not say."""
    if steps.height < MIN_STEPS:
        return None
    x = (steps["prefill_tokens"] + steps["decode_tokens"]).to_numpy().astype(float)
    y = steps["dur_ns"].to_numpy().astype(float)
    if np.ptp(x) == 0:
        return None
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return float(np.median(y)), 0.0
    if a < 0:
        return 0.0, float(np.median(y / np.maximum(x, 1)))
    return float(a), float(b)


def chunked_excess(a_ns: float, b_ns: float) -> pl.Expr:
    """Per request: what its prefill over several chunks took beyond one step of its prompt."""
    window = pl.col("prefill") + pl.col("allreduce") + pl.col("gap_chunk_wait")
    one_step = a_ns + b_ns * pl.col("prompt_tokens").cast(pl.Float64)
    return pl.when(pl.col("chunks") > 1).then((window - one_step).clip(lower_bound=0)).otherwise(0).cast(pl.Int64)


@detector("chunk_budget")
def chunk_budget(ctx: Context) -> list[Finding]:
    df = ctx.df
    if df.height == 0 or "chunks" not in df.columns:
        return []
    split = df.filter(pl.col("chunks") > 1)
    if split.height < MIN_REQUESTS:
        return []
    steps = ctx.prefill_steps
    fit = step_cost(steps)
    if fit is None:
        return []
    a_ns, b_ns = fit
    excess = split.select(chunked_excess(a_ns, b_ns)).to_series()
    share = float(excess.sum()) / float(df["ttft"].sum())
    budget = int(steps["prefill_tokens"].max())
    chunks = float(split["chunks"].median())
    sev = "high" if share >= 0.25 else "medium" if share >= 0.10 else "low" if share >= 0.03 else None
    worst = split.with_columns(excess.alias("x")).sort("x", descending=True).head(5)
    return [f] if (f := _finding(
        "chunk_budget", sev, share, "share", share,
        f"long prompts are prefilled in {chunks:.0f} chunks of <= {budget} tokens: the extra steps and the waits "
        f"between them are {share:.0%} of TTFT", chunks_per_request_p50=chunks, requests_split=split.height,
        requests=df.height, step_token_budget_seen=budget, step_fixed_ms=a_ns / 1e6, step_ms_per_1k_tokens=b_ns / 1e3,
        a_ns=a_ns, b_ns=b_ns, prompt_tokens_p50=float(split["prompt_tokens"].median()),
        request_ids=worst["request_id"].to_list(), trace_ids=worst["trace_id"].to_list())) else []
