"""Decompose: every request's TTFT split into phases that sum exactly to the measured TTFT.

TTFT is what the client sees: the ``ttftscope.http`` span the plugin's middleware records in
the API server (request received -> the first bytes carrying a generated token written;
non-streaming: the response written, ``streaming`` false). vLLM's own
``gen_ai.latency.time_to_first_token`` (its arrival -> its output processor has the token) is
a narrower window inside it and stays a column, ``ttft_vllm``. Without the middleware
(stock vLLM, or an older plugin) the window is vLLM's, and ``client`` is false.

One ClickHouse query does the per-request work inside the store: the request's phase spans
are clipped to its TTFT window and swept; each instant goes to the highest-priority phase
covering it (the registry's sweep priority, ``schemas/phases.py``: prefill > load > tokenize >
deliver > queue > intake > receive) and what no
span covers is ``gap``, itself classified by its neighbours (host-side gap before the engine
has the request, wait between prefill chunks, the wait of a request vLLM preempted in its
prefill for KV-cache blocks (the gap before the chunk that resumed it, ``ttftscope.prefill.resumed``),
scheduling wait, delivery wait, other).
Allreduce time is the part of each prefill chunk spent in its step's collectives (the least
any rank spent in them: see ``step_collectives_sql``), carved out of prefill. All sums are
integer nanoseconds, so the phases add up to ``ttft`` exactly. ``intake_ipc`` is the part of ``intake`` before the engine core's input
thread had the request (IPC and decoding; the rest is the engine core's preprocessing and the
wait for its loop), not a phase of its own.

With stock vLLM only (no plugin spans), the ``llm_request`` attributes give queue and
prefill; the rest of TTFT is ``gap`` ("everything else"), and ``coarse`` is true.
"""

from __future__ import annotations

import polars as pl
from ttftscope.schemas.phases import (
    GAP_SWEEP,
    LOAD_SPANS,
    PHASES,
    SPECS,
    SWEPT,
    is_phase_span_sql,
    sweep_sql,
)
from ttftscope.schemas.sql import in_list
from ttftscope.schemas.sql import quote as _q
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

from .window import Window

PHASE_COLUMNS = list(PHASES)  # the registry's order; sums to ttft exactly
GAP_COLUMNS = ["gap_host", "gap_chunk_wait", "gap_preempted", "gap_schedule", "gap_deliver", "gap_other"]
#: what each kind of gap is, in words (the UI's)
GAP_LABELS = {"gap_host": "host side, before the engine", "gap_chunk_wait": "between prefill chunks",
              "gap_preempted": "preempted, waiting for KV-cache blocks", "gap_schedule": "queued -> computing",
              "gap_deliver": "delivery", "gap_other": "other"}

# sweep priorities the gap classes and the allreduce carve-out refer to (from the registry)
_P_PREFILL, _P_LOAD, _P_DELIVER, _P_QUEUE = (SPECS[p].sweep for p in ("prefill", "load", "deliver", "queue"))
_P_HOST = [p.sweep for p in SWEPT if p.host_side]


def decompose_sql() -> str:
    a = lambda k: f"SpanAttributes[{_q(k)}]"  # noqa: E731
    sums = ",\n  ".join(f"arraySum(arrayMap((sg, q) -> if(q = {p.sweep}, sg.2 - sg.1, 0), segs, segp)) AS {p.name}"
                        for p in SWEPT if p.sweep != _P_PREFILL)
    host = f"x.2 IN (0, {', '.join(map(str, _P_HOST))})"
    return f"""
SELECT * EXCEPT (nb, prefill_all, resumed_st, rs) FROM (
WITH
  (SELECT groupArray((toUnixTimestamp64Nano(Timestamp), toUnixTimestamp64Nano(Timestamp) + toInt64(Duration)))
     FROM otel_traces WHERE SpanName IN ({in_list(LOAD_SPANS)}) AND {Window.time_filter(86400, 0)}) AS loads,
  reqs AS (
    SELECT TraceId,
           any({a(Attr.REQUEST_ID)}) AS request_id,
           min(toUnixTimestamp64Nano(Timestamp)) AS t0,
           any(toInt64(round(toFloat64OrZero({a(Attr.VLLM_TTFT)}) * 1e9))) AS ttft_attr,
           any(toInt64(round(toFloat64OrZero({a(Attr.VLLM_QUEUE)}) * 1e9))) AS queue_attr,
           any(toInt64(round(toFloat64OrZero({a(Attr.VLLM_PREFILL)}) * 1e9))) AS prefill_attr,
           any(toInt64(round(toFloat64OrZero({a(Attr.VLLM_E2E)}) * 1e9))) AS e2e,
           any(toUInt32OrZero({a(Attr.PROMPT_TOKENS)})) AS prompt_tokens,
           any(toUInt32OrZero({a(Attr.COMPLETION_TOKENS)})) AS completion_tokens,
           any(if({a(Attr.MODEL)} != '', {a(Attr.MODEL)}, ResourceAttributes[{_q(ResourceAttr.MODEL)}])) AS model,
           any(ResourceAttributes[{_q(ResourceAttr.SERVICE_VERSION)}]) AS version,
           any(ResourceAttributes[{_q(ResourceAttr.RUN)}]) AS run,
           any({a(Attr.PRIORITY)}) AS priority
    FROM otel_traces
    WHERE SpanName = {_q(SpanName.REQUEST)} AND {Window.time_filter()} AND {Window.request_filter()}
    GROUP BY TraceId
  ),
  http AS (
    SELECT TraceId, argMin(toUnixTimestamp64Nano(Timestamp), Timestamp) AS h0,
           argMin(toInt64(Duration), Timestamp) AS hdur,
           argMin({a(Attr.HTTP_STREAMING)}, Timestamp) = 'true' AS streaming,
           argMin(toInt64OrZero({a(Attr.HTTP_TEXT_WAIT_NS)}), Timestamp) AS text_wait,
           argMin(toInt64OrZero({a(Attr.HTTP_TEXT_WAIT_TOKENS)}), Timestamp) AS text_wait_tokens
    FROM otel_traces
    WHERE SpanName = {_q(SpanName.HTTP)} AND {Window.time_filter(60, 600)} AND TraceId IN (SELECT TraceId FROM reqs)
    GROUP BY TraceId
  ),
  ar AS ({step_collectives_sql(Window.time_filter(60, 600))}),
  spans AS (
    SELECT s.TraceId AS TraceId,
           groupArray((s.prio, s.st, s.en)) AS iv,
           sum(if(s.prio = {_P_PREFILL}, least(s.en - s.st, ifNull(ar.ar_ns, 0)), 0)) AS ar_total,
           countIf(s.prio = {_P_PREFILL}) AS chunks,
           groupArrayIf(s.st, s.resumed) AS resumed_st,
           sum(s.ipc) AS ipc_total,
           anyIf(s.priority, s.priority != '') AS span_priority
    FROM (
      SELECT TraceId, {sweep_sql()} AS prio, toUnixTimestamp64Nano(Timestamp) AS st, st + toInt64(Duration) AS en,
             {a(Attr.ENGINE)} AS engine, {a(Attr.STEP)} AS step, {a(Attr.PRIORITY)} AS priority,
             {a(Attr.PREFILL_RESUMED)} = 'true' AS resumed,
             if(SpanName = {_q(SpanName.INTAKE)}, toInt64OrZero({a(Attr.INTAKE_IPC_NS)}), 0) AS ipc
      FROM otel_traces
      WHERE {is_phase_span_sql()} AND {Window.time_filter(60, 600)}
        AND TraceId IN (SELECT TraceId FROM reqs)
    ) AS s
    LEFT JOIN ar ON s.engine = ar.engine AND s.step = ar.step
    GROUP BY s.TraceId
  )
SELECT
  TraceId AS trace_id, request_id, w0 AS t0, ttft, ttft_vllm, client, streaming, coarse, prompt_tokens,
  completion_tokens, model, version, run, priority, e2e, chunks, text_wait, text_wait_tokens,
  arraySum(arrayMap((sg, q) -> if(q = {_P_PREFILL}, sg.2 - sg.1, 0), segs, segp)) AS prefill_all,
  least(prefill_all, ar_total) AS allreduce,
  prefill_all - allreduce AS prefill,
  {sums},
  least(ipc_total, intake) AS intake_ipc,
  arraySum(arrayMap((sg, q) -> if(q = {GAP_SWEEP}, sg.2 - sg.1, 0), segs, segp)) AS gap,
  arrayMap(i -> (segp[i], if(i = 1, 0, segp[i - 1]), if(i = length(segp), 0, segp[i + 1])), arrayEnumerate(segp)) AS nb,
  arraySum(arrayMap((sg, x) -> if(x.1 = {GAP_SWEEP} AND {host}, sg.2 - sg.1, 0), segs, nb)) AS gap_host,
  arrayMap(x -> x - w0, resumed_st) AS rs,
  arraySum(arrayMap((sg, x) -> if(x.1 = {GAP_SWEEP} AND x.2 = {_P_PREFILL} AND x.3 = {_P_PREFILL} AND has(rs, sg.2),
                                  sg.2 - sg.1, 0), segs, nb)) AS gap_preempted,
  arraySum(arrayMap((sg, x) -> if(x.1 = {GAP_SWEEP} AND x.2 = {_P_PREFILL} AND x.3 = {_P_PREFILL}, sg.2 - sg.1, 0), segs, nb))
    - gap_preempted AS gap_chunk_wait,
  arraySum(arrayMap((sg, x) -> if(x.1 = {GAP_SWEEP} AND x.2 = {_P_QUEUE} AND x.3 = {_P_PREFILL}, sg.2 - sg.1, 0), segs, nb)) AS gap_schedule,
  arraySum(arrayMap((sg, x) -> if(x.1 = {GAP_SWEEP} AND x.2 IN ({_P_PREFILL}, {_P_DELIVER}) AND (x.3 = {_P_DELIVER} OR x.3 = 0), sg.2 - sg.1, 0), segs, nb)) AS gap_deliver,
  gap - gap_host - gap_chunk_wait - gap_preempted - gap_schedule - gap_deliver AS gap_other
FROM (
  SELECT r.* EXCEPT (t0, TraceId) REPLACE (if(r.priority != '', r.priority, ifNull(sp.span_priority, '')) AS priority),
         r.TraceId AS TraceId,
         sp.chunks AS chunks, sp.ar_total AS ar_total, ifNull(sp.ipc_total, 0) AS ipc_total,
         sp.resumed_st AS resumed_st,
         length(sp.iv) = 0 AS coarse,
         ifNull(h.hdur, 0) > 0 AS client,
         ifNull(h.streaming, 0) AS streaming,
         ifNull(h.text_wait, 0) AS text_wait,
         ifNull(h.text_wait_tokens, 0) AS text_wait_tokens,
         if(client, h.h0, r.t0) AS w0,
         r.ttft_attr AS ttft_vllm,
         if(client, h.hdur,
            if(r.ttft_attr > 0, r.ttft_attr,
               arrayMax(arrayConcat([toInt64(0)], arrayMap(x -> if(x.1 = {_P_DELIVER}, x.3, 0), sp.iv))) - r.t0)) AS ttft,
         r.t0 + r.ttft_attr - w0 AS vend,
         arrayConcat(
           if(coarse,
              [(toUInt8({_P_QUEUE}), vend - r.prefill_attr - r.queue_attr, vend - r.prefill_attr),
               (toUInt8({_P_PREFILL}), vend - r.prefill_attr, vend)],
              arrayMap(x -> (toUInt8(x.1), x.2 - w0, x.3 - w0), sp.iv)),
           arrayMap(x -> (toUInt8({_P_LOAD}), x.1 - w0, x.2 - w0),
                    arrayFilter(x -> x.2 > w0 AND x.1 < w0 + ttft, loads))) AS ivs,
         arraySort(arrayDistinct(arrayConcat([toInt64(0), ttft],
             arrayMap(x -> least(greatest(x.2, 0), ttft), ivs),
             arrayMap(x -> least(greatest(x.3, 0), ttft), ivs)))) AS b,
         arrayMap(i -> (b[i], b[i + 1]), range(1, toUInt32(length(b)))) AS segs,
         arrayMap(sg -> arrayMin(arrayConcat([toUInt8({GAP_SWEEP})], arrayMap(x -> if(x.2 <= sg.1 AND x.3 >= sg.2, x.1, toUInt8({GAP_SWEEP})), ivs))), segs) AS segp
  FROM reqs AS r LEFT JOIN spans AS sp ON r.TraceId = sp.TraceId LEFT JOIN http AS h ON r.TraceId = h.TraceId
)
WHERE ttft > 0
)
"""


def step_collectives_sql(where: str, running: bool = False) -> str:
    """Per (engine, step): ``ar_ns``, the time the step spent in its tensor-parallel collectives,
    taken as the least any rank spent in them. A rank that reaches a collective early waits
    there for the last one; that wait is the last rank's compute (skew: CPU contention, uneven
    work), not communication, and faster collectives would not give it back. The last rank's
    time is the collectives' own (the transfer, and whatever slows every rank alike). Per rank
    first the longest of its spans (the hook's and a profiler window's may both cover a step).
    With ``running``, also the requests running in that step, from the engine's step span (a
    merged run of decode steps covers ``step`` to ``step.last``; the workers do not know it),
    0 when no step span covers it. And one ``trace_id``."""
    a = lambda k: f"SpanAttributes[{_q(k)}]"  # noqa: E731
    per_step = f"""
    SELECT engine, step, toUInt64OrZero(step) AS step_n, min(r_ns) AS ar_ns, any(r_trace) AS trace_id
    FROM (SELECT {a(Attr.ENGINE)} AS engine, {a(Attr.STEP)} AS step, {a(Attr.RANK)} AS rank,
                 max(toInt64(Duration)) AS r_ns, any(TraceId) AS r_trace
          FROM otel_traces WHERE SpanName = {_q(SpanName.ALLREDUCE)} AND {where}
          GROUP BY engine, step, rank)
    GROUP BY engine, step"""
    if not running:
        return per_step
    return f"""
    SELECT c.engine AS engine, c.step AS step, c.ar_ns AS ar_ns, c.trace_id AS trace_id,
           if(s.engine = c.engine AND c.step_n <= s.last, s.running, 0) AS running
    FROM ({per_step}) AS c
    ASOF LEFT JOIN
         (SELECT {a(Attr.ENGINE)} AS engine, toUInt64OrZero({a(Attr.STEP)}) AS first,
                 greatest(toUInt64OrZero({a(Attr.STEP_LAST)}), first) AS last,
                 toUInt32OrZero({a(Attr.RUNNING)}) AS running
          FROM otel_traces WHERE SpanName = {_q(SpanName.STEP)} AND {where}) AS s
    ON c.engine = s.engine AND c.step_n >= s.first"""


def decompose(store, window: Window) -> pl.DataFrame:
    """One row per request in ``window``: TTFT and its phases in ns (see the module doc)."""
    df = store.query(decompose_sql(), window.params())
    if df.height == 0:
        return empty()
    df = df.with_columns(
        pl.col("coarse").cast(pl.Boolean),
        pl.col("client").cast(pl.Boolean),
        pl.col("streaming").cast(pl.Boolean),
        *[pl.col(c).cast(pl.Int64) for c in ["ttft", "ttft_vllm", *PHASE_COLUMNS, *GAP_COLUMNS, "t0", "e2e", "text_wait",
                                              "text_wait_tokens", "intake_ipc"]],
    )
    # the engine's step period is needed only when a stream waited for a token with text
    step_ns = decode_step_ns(store, window) if df["text_wait_tokens"].max() else 0
    return df.with_columns(deliver_generation(step_ns))


def decode_step_ns(store, window: Window) -> int:
    """The engine's mean decode-only step period in ``window`` (ns, from the step spans:
    engine-side clocks, which a stalled API server does not stretch); 0 without step spans."""
    r = store.query(f"""
        SELECT sum(toInt64(Duration)) AS ns, sum(greatest(toUInt64OrZero(SpanAttributes[{_q(Attr.STEP_COUNT)}]), 1)) AS n
        FROM otel_traces
        WHERE SpanName = {_q(SpanName.STEP)} AND {Window.time_filter()}
          AND toUInt64OrZero(SpanAttributes[{_q(Attr.STEP_PREFILL_TOKENS)}]) = 0
          AND mapContains(SpanAttributes, {_q(Attr.STEP_SCHEDULE_NS)})""", window.params())
    if r.height == 0 or not r["n"][0]:
        return 0
    return int(r["ns"][0] // r["n"][0])


def deliver_generation(step_ns: int = 0) -> pl.Expr:
    """Of ``deliver``, the time the engine spends generating more tokens before the client
    has one it can show: a non-streaming response's remaining tokens (vLLM's e2e minus its
    TTFT: its TTFT is the whole response), a stream's first tokens that decode to no text yet
    (of ``text_wait``, the first chunk with a token -> the first with text, one engine decode
    step, ``step_ns``, per token without text: the rest of that wait is the delivery path's).
    The client waits for it, but it is decoding, not a delivery stall; detectors of the
    delivery path look at ``deliver - deliver_generation``."""
    gen = (pl.col("e2e") - pl.col("ttft_vllm")).clip(lower_bound=0)
    return (pl.when(pl.col("client") & ~pl.col("streaming") & (pl.col("e2e") > 0))
            .then(pl.min_horizontal(gen, pl.col("deliver")))
            .when(pl.col("client") & pl.col("streaming"))
            .then(pl.min_horizontal(pl.col("text_wait"), pl.col("text_wait_tokens") * step_ns, pl.col("deliver")))
            .otherwise(0).cast(pl.Int64).alias("deliver_generation"))


def empty() -> pl.DataFrame:
    schema = {"trace_id": pl.Utf8, "request_id": pl.Utf8, "t0": pl.Int64, "ttft": pl.Int64, "ttft_vllm": pl.Int64,
              "client": pl.Boolean, "streaming": pl.Boolean, "coarse": pl.Boolean,
              "prompt_tokens": pl.UInt32, "completion_tokens": pl.UInt32, "model": pl.Utf8, "version": pl.Utf8,
              "run": pl.Utf8, "priority": pl.Utf8, "e2e": pl.Int64, "chunks": pl.UInt64, "text_wait": pl.Int64,
              "text_wait_tokens": pl.Int64,
              **{c: pl.Int64 for c in PHASE_COLUMNS + GAP_COLUMNS}, "intake_ipc": pl.Int64,
              "deliver_generation": pl.Int64}
    return pl.DataFrame(schema=schema)


def phase_stats(df: pl.DataFrame) -> dict:
    """Per phase p50/p95/p99 (ms) and share of total TTFT; TTFT percentiles."""
    if df.height == 0:
        return {"requests": 0}
    total = df["ttft"].sum()
    out = {"requests": df.height,
           "ttft_ms": {q: float(df["ttft"].quantile(v, "linear")) / 1e6 for q, v in (("p50", .5), ("p95", .95), ("p99", .99))},
           "phases": {}}
    out["ttft_ms"]["mean"] = float(df["ttft"].mean()) / 1e6
    qs = df.select([pl.col(c).quantile(v, "linear").alias(f"{c}|{q}") for c in PHASE_COLUMNS
                    for q, v in (("p50", .5), ("p95", .95), ("p99", .99))]
                   + [pl.col(c).sum().alias(f"{c}|sum") for c in PHASE_COLUMNS]).row(0, named=True)
    for c in PHASE_COLUMNS:
        out["phases"][c] = {"p50_ms": qs[f"{c}|p50"] / 1e6, "p95_ms": qs[f"{c}|p95"] / 1e6,
                            "p99_ms": qs[f"{c}|p99"] / 1e6, "share": qs[f"{c}|sum"] / total if total else 0.0}
    out["coarse_requests"] = int(df["coarse"].sum())
    return out


def tail_attribution(df: pl.DataFrame, quantile: float = 0.99) -> dict:
    """Which phases make the requests at or above the TTFT ``quantile`` slow (share of their TTFT)."""
    if df.height == 0:
        return {}
    cut = df["ttft"].quantile(quantile, "lower")
    tail = df.filter(pl.col("ttft") >= cut)
    tot = tail["ttft"].sum()
    cols = PHASE_COLUMNS + GAP_COLUMNS
    sums = tail.select([pl.col(c).sum() for c in cols]).row(0, named=True)
    return {"quantile": quantile, "threshold_ms": cut / 1e6, "requests": tail.height,
            "share": {c: (sums[c] / tot if tot else 0.0) for c in cols},
            "slowest": tail.sort("ttft", descending=True).head(5).select("request_id", "trace_id", "ttft").to_dicts()}


BANDS = ("≤p50", "p50–p95", "p95–p99", "≥p99")


def percentile_band(ttft: pl.Series) -> pl.Expr:
    """The TTFT band (one of :data:`BANDS`) of each row, cut at ``ttft``'s p50, p95 and p99."""
    q = [ttft.quantile(v, "lower") for v in (0.5, 0.95, 0.99)]
    return (pl.when(pl.col("ttft") <= q[0]).then(pl.lit(BANDS[0]))
            .when(pl.col("ttft") <= q[1]).then(pl.lit(BANDS[1]))
            .when(pl.col("ttft") < q[2]).then(pl.lit(BANDS[2]))
            .otherwise(pl.lit(BANDS[3]))).alias("band")


def by_band(df: pl.DataFrame, cols: list[str]) -> list[dict]:
    """Request count and the mean of ``cols`` per band, in band order (``df`` has a ``band``)."""
    g = df.group_by("band").agg(pl.len().alias("requests"), *[pl.col(c).mean() for c in cols])
    return sorted(g.to_dicts(), key=lambda r: BANDS.index(r["band"]))


def by_percentile_band(df: pl.DataFrame) -> list[dict]:
    """Mean phase times for the bands ≤p50, p50–p95, p95–p99, ≥p99 (the flame per percentile)."""
    if df.height == 0:
        return []
    cols = PHASE_COLUMNS + GAP_COLUMNS
    rows = by_band(df.with_columns(percentile_band(df["ttft"])), ["ttft", *cols])
    return [{"band": r["band"], "requests": r["requests"], "ttft_ms": r["ttft"] / 1e6,
             "phases_ms": {c: r[c] / 1e6 for c in cols}} for r in rows]
