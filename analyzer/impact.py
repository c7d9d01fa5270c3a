"""Impact: how much TTFT a finding's cause costs, and the severity that follows from it.

For a finding whose cause is time inside requests (a phase, a class of gap, the first
requests after a start), the counterfactual is computed in polars over the per-request
decomposition: each request's TTFT with the cause's time removed (or replaced by its healthy
baseline: the phase's 10th percentile, or for receive/intake/deliver a fixed floor and for
tokenize a floor per prompt token, when lower), then ``impact_ms[q] = p_q(TTFT) - p_q(TTFT without
the cause)`` for p50, p95 and p99, with the requests it touches.

Severity then comes from that impact against the SLO, at the percentile the SLO is tightest
on (the largest measured/target ratio): **high** when removing the cause would bring a
violated target back within it, or the impact is at least a quarter of the target;
**medium** from a tenth of the target; otherwise **low** — a cause that costs a few
milliseconds on a server far inside its SLO is at most low. A detector's own verdict can
only be lowered by this, never raised. Within a severity, findings are ranked by impact at
that percentile; a specific cause goes before the phase it inflates (``INFLATES``: idle
engine-loop bubbles before a long queue), and before a finding it brings about (``CAUSES``:
prefix-cache misses before the extra chunks of the chunk budget), when it explains at least half
of that one's impact, and at equal impact anyway; findings without a per-request impact (cold start,
regressions, load tracking) follow by their detector's score.
"""

from __future__ import annotations

from collections.abc import Callable

import polars as pl
from ttftscope.schemas.phases import DOMINANCE, HEALTHY_NS, SWEPT

from .chunking import chunked_excess
from .slo import _Q, SLO

QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
_ORDER = {"high": 0, "medium": 1, "low": 2}


#: on top of tokenize's healthy floor: what a fast (Rust) tokenizer takes per prompt token
#: (about a million tokens a second)
TOKENIZE_NS_PER_TOKEN = 2_000


def _floor(col: str) -> pl.Expr | None:
    """A phase's healthy cost whatever the load (the registry's ``healthy_ns``). A fault that
    hits every request alike (a stalled event loop) lifts the window's own 10th percentile
    too; against this floor its whole size still counts."""
    if col not in HEALTHY_NS:
        return None
    floor = pl.lit(HEALTHY_NS[col])
    if col == "tokenize":
        floor = floor + pl.col("prompt_tokens").cast(pl.Int64).fill_null(0) * TOKENIZE_NS_PER_TOKEN
    return floor


#: a window whose 10th percentile of a phase is more than this many times the phase's healthy
#: floor has no unaffected request left to say what is normal: its excess is taken over the floor
WHOLE_WINDOW_LIFTED = 4


def _excess(col: str, expr: pl.Expr | None = None) -> pl.Expr:
    """Time above the phase's healthy baseline: its 10th percentile over the window (what the
    requests a cause spared take on this machine), or the healthy floor (``HEALTHY_NS``; for
    tokenize, per prompt token) when that is lower and the 10th percentile is more than
    ``WHOLE_WINDOW_LIFTED`` times it (a cause that hit every request alike, a stalled event loop,
    lifts the percentile too)."""
    e = pl.col(col) if expr is None else expr
    base = e.quantile(0.1, "lower")
    floor = _floor(col)
    if floor is not None:
        base = pl.when(base > WHOLE_WINDOW_LIFTED * floor).then(floor).otherwise(base)
    return (e - base).clip(lower_bound=0)


def _phase(col: str) -> Callable[[dict], pl.Expr]:
    return lambda f: _excess(col)


def _first_requests(f: dict) -> pl.Expr:
    ids = f["evidence"].get("trace_ids") or []
    return pl.when(pl.col("trace_id").is_in(ids)).then(
        (pl.col("ttft") - pl.col("ttft").filter(~pl.col("trace_id").is_in(ids)).median()).clip(lower_bound=0)
    ).otherwise(0)


#: finding kind -> the time (ns per request) its cause adds, as a polars expression
REMOVED: dict[str, Callable[[dict], pl.Expr]] = {
    **{f"{p}_dominates": _phase(p) for p in DOMINANCE},
    # a non-streaming response's generation after the first token is not the delivery path
    "deliver_dominates": lambda f: _excess("deliver", pl.col("deliver") - pl.col("deliver_generation")),
    "chunk_wait": lambda f: pl.col("gap_chunk_wait"),
    # the wait for KV-cache blocks after a preemption (the prefill it redid comes on top: a lower bound)
    "kv_preemption": lambda f: pl.col("gap_preempted"),
    "chunk_budget": lambda f: chunked_excess(f["evidence"]["a_ns"], f["evidence"]["b_ns"]),
    "host_gap": lambda f: pl.col("gap_host"),
    "tokenizer_long_prompts": lambda f: _excess("tokenize"),
    "allreduce_concurrency": lambda f: _excess("allreduce"),
    "cold_requests": _first_requests,
    # the engine loop's idle time inside each request's wait for its first token (gaps.bubble_delays)
    "scheduling_bubbles": lambda f: pl.col("bubble_ns").fill_null(0),
    "prefix_cache_misses": lambda f: _hit_saves(f),
    "engine_host_overhead": lambda f: _engine_time() * _host_excess(f["evidence"]),
}


def _hit_saves(f: dict) -> pl.Expr:
    """What a hit on the detector's per-request ``hit_tokens`` (the shared prefix in whole KV
    blocks) would have saved a missed repeat: by the window's chunk cost model
    (``chunking.ChunkCost.hit_saves``) when the finding carries it; else the hit tokens' share of
    its prefill (chunks, their collectives, the waits between them), an upper bound."""
    e = f["evidence"]
    hit = pl.col("hit_tokens").fill_null(0)  # (null: a request the finding is not about)
    window = pl.col("prefill") + pl.col("allreduce") + pl.col("gap_chunk_wait")
    if "c_ns" in e:
        from .chunking import ChunkCost

        saves = ChunkCost(e["a_ns"], e["b_ns"], e["c_ns"], e["step_token_budget_seen"]).hit_saves(hit)
    else:
        saves = window * (hit / pl.col("prompt_tokens").cast(pl.Float64)).clip(upper_bound=1.0)
    # min_horizontal skips nulls: without the when, every request the finding is not about
    # "saved" its whole prefill window (27 of 30 requests, 10 ms at p50, in one demo profile)
    return pl.when(hit > 0).then(pl.min_horizontal(saves, window)).otherwise(0).fill_null(0)


def _engine_time() -> pl.Expr:
    """A request's time that engine steps make up: the wait for the engine loop (intake past
    the IPC hop), queue, its prefill steps whole (chunks, collectives, the scheduling before and
    the output processing after them: the gaps around its chunks) and, where the client waits
    for more tokens before it has one to show, those decode steps."""
    return (pl.col("intake") - pl.col("intake_ipc").fill_null(0) + pl.col("queue") + pl.col("prefill")
            + pl.col("allreduce") + pl.col("gap_schedule") + pl.col("gap_chunk_wait") + pl.col("gap_preempted")
            + pl.col("gap_deliver")
            + pl.col("deliver_generation"))


def _host_excess(evidence: dict) -> float:
    """Of every step, the part that goes if the engine core's Python per step (schedule +
    output processing) came down to a healthy one (``engine_host.HEALTHY_HOST_MS``), the model
    time unchanged: a step of host ``h`` and model ``m`` ms shrinks by ``(h - h0) / (h + m)``."""
    from .engine_host import HEALTHY_HOST_MS

    host = evidence["host_ms_per_step"]  # (what the workers waited for: less what ran behind a step in flight)
    step = host + evidence["execute_ms_per_step"]
    return max(host - HEALTHY_HOST_MS, 0.0) / step if step > 0 else 0.0


#: the columns of a request's time before the engine's scheduler has it (the registry's host-side
#: phases, and the host-side gap between them)
BEFORE_THE_QUEUE = [p.name for p in SWEPT if p.host_side] + ["gap_host"]
#: findings whose cause is time before the queue: what removing it saves goes through the queue
UPSTREAM = {f"{c}_dominates" for c in BEFORE_THE_QUEUE if c in DOMINANCE} | {"tokenizer_long_prompts", "host_gap"}


def through_the_queue(df: pl.DataFrame, removed: pl.Expr) -> pl.Series:
    """What removing ``removed`` (ns per request, time before the scheduler has the request) saves
    each request once its earlier arrival goes through vLLM's queue. Subtracting it from TTFT
    takes the engine to be free: in a burst that keeps it busy, a request that arrives earlier
    waits longer in the queue instead — a tokenizer that serves a burst one request at a time,
    planted at ~3 ms a request on real vLLM, cost the client ~6 ms at p50 (twenty bursts of each)
    while subtracting it named tokenization first with ~90 ms (tests/truth/test_burst_tokenizer.py). The engine's
    admissions are replayed, first come first served: its ``k``-th
    admission came ``g_k`` after the one before it where the request admitted waited for it
    (``g_k`` = that interval, at most the request's own queue wait; 0 for a request the engine took as
    it came), so with the arrivals ``a'`` sorted, ``admit'_k = max(a'_k, admit'_{k-1} + g_k)``,
    i.e. ``G_k + cummax(a'_k - G_k)`` with ``G`` the running sum of ``g``. A request saves its
    admission's shift (the replay with the time removed against the replay without), between 0
    and what was removed: all of it where the engine took it as it
    came (an idle engine) or where every request's arrival moved alike (the whole queue moves).
    One engine's queue, as the requests' order in the window (engines of a data-parallel
    deployment are replayed as one, their admissions interleaved; priorities are not)."""
    pre = pl.sum_horizontal(*[pl.col(c) for c in BEFORE_THE_QUEUE])
    wait = pl.col("queue") + pl.col("gap_schedule")
    d = df.select(pl.int_range(pl.len()).alias("_i"), (pl.col("t0") + pre).alias("_a"), wait.alias("_q"),
                  removed.cast(pl.Int64).fill_null(0).clip(lower_bound=0).alias("_x"))
    gaps = d.sort(pl.col("_a") + pl.col("_q"), "_i").select(
        pl.min_horizontal((pl.col("_a") + pl.col("_q")).diff().fill_null(0).clip(lower_bound=0), pl.col("_q"))
        .cum_sum().alias("_G"))["_G"]

    def admitted(arrival: pl.Expr) -> pl.Series:
        r = d.with_columns(arrival.alias("_t")).sort("_t", "_i").with_columns(gaps.alias("_G"))
        return r.select("_i", (pl.col("_G") + (pl.col("_t") - pl.col("_G")).cum_max()).alias("_adm")).sort("_i")["_adm"]

    # the replay's own error (a request the engine took as it came is replayed without the step
    # boundary it waited for) is in both replays alike: their difference is the shift
    shift = admitted(pl.col("_a")) - admitted(pl.col("_a") - pl.col("_x"))
    return d.select(pl.min_horizontal(shift.clip(lower_bound=0), pl.col("_x")).alias("_s"))["_s"]


def impact_ms(df: pl.DataFrame, removed: pl.Expr) -> tuple[dict[str, float], int]:
    """({p50, p95, p99: ms the percentile drops without the cause}, requests touched)."""
    d = df.select(pl.col("ttft"), removed.cast(pl.Int64).fill_null(0).clip(lower_bound=0).alias("_r"))
    d = d.with_columns((pl.col("ttft") - pl.min_horizontal(pl.col("_r"), pl.col("ttft"))).alias("_cf"))
    out = {}
    for name, q in QUANTILES.items():
        out[name] = max(float(d["ttft"].quantile(q, "linear")) - float(d["_cf"].quantile(q, "linear")), 0.0) / 1e6
    return out, int((d["_r"] > 0).sum())


def tightest(df: pl.DataFrame, slo: SLO) -> tuple[str, float, float]:
    """(quantile, target ms, measured ms) where measured/target is largest."""
    best = None
    for q, target in slo.ttft_targets_ms.items():
        measured = float(df["ttft"].quantile(_Q[q], "linear")) / 1e6
        if best is None or measured / target > best[2] / best[1]:
            best = (q, target, measured)
    return best


def finding_impact(df: pl.DataFrame, f: dict) -> tuple[dict[str, float], int]:
    """:func:`impact_ms` of finding ``f``'s cause (``REMOVED`` by its kind) over the requests of
    ``df``; time before the queue saved only as far as the queue lets it through
    (:func:`through_the_queue`). The report's figure, and the one the truth tests hold to the
    client's stopwatch."""
    removed = REMOVED[f["kind"]](f)
    if f["kind"] in UPSTREAM:
        df = df.with_columns(through_the_queue(df, removed).alias("_through"))
        removed = pl.col("_through")
    return impact_ms(df, removed)


def calibrate(findings: list[dict], df: pl.DataFrame, slo: SLO) -> list[dict]:
    """Add ``impact_ms`` and ``affected_requests`` to every finding whose cause is time in
    requests, cap its severity by that impact against the SLO, rank by impact at the SLO's
    tightest percentile."""
    if df.height == 0:
        for f in findings:
            f.pop("per_request", None)
        return findings
    q, target, measured = tightest(df, slo)
    qk = q if q in QUANTILES else "p99"
    for f in findings:
        if f["kind"] not in REMOVED:
            f["impact_ms"] = None
            continue
        per_request = f.pop("per_request", None)  # a detector's per-request numbers (by trace id)
        d = df if per_request is None else df.join(per_request, on="trace_id", how="left")
        imp, n = finding_impact(d, f)
        f["impact_ms"], f["affected_requests"] = imp, n
        f["impact_at"] = qk
        i = imp[qk]
        fixes = measured > target and measured - i <= target
        by_impact = "high" if fixes or i >= 0.25 * target else "medium" if i >= 0.1 * target else "low"
        if _ORDER[by_impact] > _ORDER[f["severity"]]:
            f["evidence"]["severity_by_detector"] = f["severity"]
            f["severity"] = by_impact
    def key(f: dict):
        imp = f.get("impact_ms")
        # equal impact (within half a ms): a specific cause before the phase it inflates
        return (_ORDER[f["severity"]], -round(imp[qk] * 2) / 2 if imp else 0.0,
                f["kind"].endswith("_dominates"), -f["score"])

    return causes_first(sorted(findings, key=key), qk)


#: specific causes -> the phases whose time they inflate (a phase's dominance finding says
#: where the time went; these say why)
INFLATES: dict[str, tuple[str, ...]] = {
    "scheduling_bubbles": ("queue", "intake"),
    "engine_host_overhead": ("queue", "intake", "prefill"),
    "chunk_budget": ("prefill",),
    "chunk_wait": ("prefill",),
    "kv_preemption": ("prefill",),
    "prefix_cache_misses": ("prefill",),
    "tokenizer_long_prompts": ("tokenize",),
    "allreduce_concurrency": ("allreduce",),
}


#: causes -> the other findings whose time they bring about: a prompt whose shared prefix missed
#: the cache computes those tokens too, in chunks it would not have needed (chunk_budget and
#: chunk_wait size the chunking the misses add to)
CAUSES: dict[str, tuple[str, ...]] = {
    "prefix_cache_misses": ("chunk_budget", "chunk_wait"),
}


def _brings_about(cause: str) -> set[str]:
    """The finding kinds whose time ``cause`` explains: the dominance findings of the phases it
    inflates (``INFLATES``) and the findings it brings about (``CAUSES``)."""
    return {f"{p}_dominates" for p in INFLATES.get(cause, ())} | set(CAUSES.get(cause, ()))


def causes_first(ranked: list[dict], qk: str, explains: float = 0.5) -> list[dict]:
    """A finding moves behind a cause of its time ranked after it at the same severity, when
    the cause's impact is at least ``explains`` of its own: the cause is the answer to why that
    time is long. A phase's dominance finding is behind the specific causes that inflate the
    phase (``INFLATES``: idle engine-loop bubbles behind a long queue); a finding is behind what
    brings it about (``CAUSES``: prefix-cache misses behind the chunk budget's extra chunks)."""
    out = list(ranked)
    for d in [f for f in ranked if f.get("impact_ms")]:
        i = out.index(d)
        later = [c for c in out[i + 1:] if d["kind"] in _brings_about(c["kind"]) and c.get("impact_ms")
                 and c["severity"] == d["severity"] and c["impact_ms"][qk] >= explains * d["impact_ms"][qk]]
        if later:
            c = later[0]
            out.remove(c)
            out.insert(i, c)
    return out
