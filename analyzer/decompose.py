"""Decompose: every request's TTFT split into phases that sum exactly to the measured TTFT.

One ClickHouse query does the per-request work inside the store: the request's phase spans
are clipped to its TTFT window ``[arrival, arrival + TTFT]`` and swept; each instant goes to
the highest-priority phase covering it (prefill > load > tokenize > output > queue) and
what no span covers is ``gap``, itself classified by its neighbours (host-side gap between
tokenisation and queueing, wait between prefill chunks, scheduling wait, output IPC).
Allreduce time is the part of each prefill chunk spent in its step's collectives (slowest
rank), carved out of prefill. All sums are integer nanoseconds, so
``load + tokenize + queue + prefill + allreduce + output + gap == ttft`` holds exactly.

With stock vLLM only (no plugin spans), the ``llm_request`` attributes give queue and
prefill; the rest of TTFT is ``gap`` ("everything else"), and ``coarse`` is true.
"""

from __future__ import annotations

import polars as pl
from ttftscope.schemas.vocabulary import VLLM_SPAN_PHASE, Attr, ResourceAttr, SpanName

from .window import Window

PHASE_COLUMNS = ["load", "tokenize", "queue", "prefill", "allreduce", "output", "gap"]
GAP_COLUMNS = ["gap_host", "gap_chunk_wait", "gap_schedule", "gap_output", "gap_other"]

# sweep priorities (lower wins); 99 = uncovered (gap)
_PRIO = {SpanName.PREFILL: 1, "load": 2, SpanName.TOKENIZE: 3, SpanName.OUTPUT: 4, SpanName.QUEUE: 5}
_P_PREFILL, _P_LOAD, _P_TOK, _P_OUT, _P_QUEUE = 1, 2, 3, 4, 5


def _q(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def decompose_sql() -> str:
    load_names = ", ".join(_q(n) for n in sorted(VLLM_SPAN_PHASE))
    phase_names = ", ".join(_q(n) for n in (SpanName.TOKENIZE, SpanName.QUEUE, SpanName.PREFILL, SpanName.OUTPUT))
    prio = (f"multiIf(SpanName = {_q(SpanName.PREFILL)}, {_P_PREFILL}, SpanName = {_q(SpanName.TOKENIZE)}, {_P_TOK}, "
            f"SpanName = {_q(SpanName.OUTPUT)}, {_P_OUT}, {_P_QUEUE})")
    a = lambda k: f"SpanAttributes[{_q(k)}]"  # noqa: E731
    return f"""
SELECT * EXCEPT (nb, prefill_all) FROM (
WITH
  (SELECT groupArray((toUnixTimestamp64Nano(Timestamp), toUnixTimestamp64Nano(Timestamp) + toInt64(Duration)))
     FROM otel_traces WHERE SpanName IN ({load_names}) AND {Window.time_filter(86400, 0)}) AS loads,
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
  ar AS (
    SELECT {a(Attr.ENGINE)} AS engine, {a(Attr.STEP)} AS step, max(toInt64(Duration)) AS ar_ns
    FROM otel_traces
    WHERE SpanName = {_q(SpanName.ALLREDUCE)} AND {Window.time_filter(60, 600)}
    GROUP BY engine, step
  ),
  spans AS (
    SELECT s.TraceId AS TraceId,
           groupArray((s.prio, s.st, s.en)) AS iv,
           sum(if(s.prio = {_P_PREFILL}, least(s.en - s.st, ifNull(ar.ar_ns, 0)), 0)) AS ar_total,
           countIf(s.prio = {_P_PREFILL}) AS chunks,
           anyIf(s.priority, s.priority != '') AS span_priority
    FROM (
      SELECT TraceId, {prio} AS prio, toUnixTimestamp64Nano(Timestamp) AS st, st + toInt64(Duration) AS en,
             {a(Attr.ENGINE)} AS engine, {a(Attr.STEP)} AS step, {a(Attr.PRIORITY)} AS priority
      FROM otel_traces
      WHERE SpanName IN ({phase_names}) AND {Window.time_filter(60, 600)}
        AND TraceId IN (SELECT TraceId FROM reqs)
    ) AS s
    LEFT JOIN ar ON s.engine = ar.engine AND s.step = ar.step
    GROUP BY s.TraceId
  )
SELECT
  TraceId AS trace_id, request_id, t0, ttft, coarse, prompt_tokens, completion_tokens, model, version, run, priority, e2e,
  chunks,
  arraySum(arrayMap((sg, q) -> if(q = {_P_PREFILL}, sg.2 - sg.1, 0), segs, segp)) AS prefill_all,
  least(prefill_all, ar_total) AS allreduce,
  prefill_all - allreduce AS prefill,
  arraySum(arrayMap((sg, q) -> if(q = {_P_LOAD}, sg.2 - sg.1, 0), segs, segp)) AS load,
  arraySum(arrayMap((sg, q) -> if(q = {_P_TOK}, sg.2 - sg.1, 0), segs, segp)) AS tokenize,
  arraySum(arrayMap((sg, q) -> if(q = {_P_OUT}, sg.2 - sg.1, 0), segs, segp)) AS output,
  arraySum(arrayMap((sg, q) -> if(q = {_P_QUEUE}, sg.2 - sg.1, 0), segs, segp)) AS queue,
  arraySum(arrayMap((sg, q) -> if(q = 99, sg.2 - sg.1, 0), segs, segp)) AS gap,
  arrayMap(i -> (segp[i], if(i = 1, 0, segp[i - 1]), if(i = length(segp), 0, segp[i + 1])), arrayEnumerate(segp)) AS nb,
  arraySum(arrayMap((sg, x) -> if(x.1 = 99 AND (x.2 = {_P_TOK} OR x.2 = 0), sg.2 - sg.1, 0), segs, nb)) AS gap_host,
  arraySum(arrayMap((sg, x) -> if(x.1 = 99 AND x.2 = {_P_PREFILL} AND x.3 = {_P_PREFILL}, sg.2 - sg.1, 0), segs, nb)) AS gap_chunk_wait,
  arraySum(arrayMap((sg, x) -> if(x.1 = 99 AND x.2 = {_P_QUEUE} AND x.3 = {_P_PREFILL}, sg.2 - sg.1, 0), segs, nb)) AS gap_schedule,
  arraySum(arrayMap((sg, x) -> if(x.1 = 99 AND x.2 = {_P_PREFILL} AND (x.3 = {_P_OUT} OR x.3 = 0), sg.2 - sg.1, 0), segs, nb)) AS gap_output,
  gap - gap_host - gap_chunk_wait - gap_schedule - gap_output AS gap_other
FROM (
  SELECT r.* REPLACE (if(r.priority != '', r.priority, ifNull(sp.span_priority, '')) AS priority),
         sp.chunks AS chunks, sp.ar_total AS ar_total,
         length(sp.iv) = 0 AS coarse,
         if(r.ttft_attr > 0, r.ttft_attr,
            arrayMax(arrayConcat([toInt64(0)], arrayMap(x -> if(x.1 = {_P_OUT}, x.3, 0), sp.iv))) - r.t0) AS ttft,
         arrayConcat(
           if(coarse,
              [(toUInt8({_P_QUEUE}), ttft - r.prefill_attr - r.queue_attr, ttft - r.prefill_attr),
               (toUInt8({_P_PREFILL}), ttft - r.prefill_attr, ttft)],
              arrayMap(x -> (toUInt8(x.1), x.2 - r.t0, x.3 - r.t0), sp.iv)),
           arrayMap(x -> (toUInt8({_P_LOAD}), x.1 - r.t0, x.2 - r.t0),
                    arrayFilter(x -> x.2 > r.t0 AND x.1 < r.t0 + ttft, loads))) AS ivs,
         arraySort(arrayDistinct(arrayConcat([toInt64(0), ttft],
             arrayMap(x -> least(greatest(x.2, 0), ttft), ivs),
             arrayMap(x -> least(greatest(x.3, 0), ttft), ivs)))) AS b,
         arrayMap(i -> (b[i], b[i + 1]), range(1, toUInt32(length(b)))) AS segs,
         arrayMap(sg -> arrayMin(arrayConcat([toUInt8(99)], arrayMap(x -> if(x.2 <= sg.1 AND x.3 >= sg.2, x.1, toUInt8(99)), ivs))), segs) AS segp
  FROM reqs AS r LEFT JOIN spans AS sp ON r.TraceId = sp.TraceId
)
WHERE ttft > 0
)
"""


def decompose(store, window: Window) -> pl.DataFrame:
    """One row per request in ``window``: TTFT and its phases in ns (see the module doc)."""
    df = store.query(decompose_sql(), window.params())
    if df.height == 0:
        return empty()
    return df.with_columns(
        pl.col("coarse").cast(pl.Boolean),
        *[pl.col(c).cast(pl.Int64) for c in ["ttft", *PHASE_COLUMNS, *GAP_COLUMNS, "t0", "e2e"]],
    )


def empty() -> pl.DataFrame:
    schema = {"trace_id": pl.Utf8, "request_id": pl.Utf8, "t0": pl.Int64, "ttft": pl.Int64, "coarse": pl.Boolean,
              "prompt_tokens": pl.UInt32, "completion_tokens": pl.UInt32, "model": pl.Utf8, "version": pl.Utf8,
              "run": pl.Utf8, "priority": pl.Utf8, "e2e": pl.Int64, "chunks": pl.UInt64,
              **{c: pl.Int64 for c in PHASE_COLUMNS + GAP_COLUMNS}}
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


def by_percentile_band(df: pl.DataFrame) -> list[dict]:
    """Mean phase times for the bands ≤p50, p50–p95, p95–p99, ≥p99 (the flame per percentile)."""
    if df.height == 0:
        return []
    q = [df["ttft"].quantile(v, "lower") for v in (0.5, 0.95, 0.99)]
    band = (pl.when(pl.col("ttft") <= q[0]).then(pl.lit("≤p50"))
            .when(pl.col("ttft") <= q[1]).then(pl.lit("p50–p95"))
            .when(pl.col("ttft") < q[2]).then(pl.lit("p95–p99"))
            .otherwise(pl.lit("≥p99")))
    g = (df.with_columns(band.alias("band")).group_by("band")
         .agg(pl.len().alias("requests"), pl.col("ttft").mean().alias("ttft"),
              *[pl.col(c).mean() for c in PHASE_COLUMNS + GAP_COLUMNS]))
    order = {"≤p50": 0, "p50–p95": 1, "p95–p99": 2, "≥p99": 3}
    rows = sorted(g.to_dicts(), key=lambda r: order[r["band"]])
    return [{"band": r["band"], "requests": r["requests"], "ttft_ms": r["ttft"] / 1e6,
             "phases_ms": {c: r[c] / 1e6 for c in PHASE_COLUMNS + GAP_COLUMNS}} for r in rows]
