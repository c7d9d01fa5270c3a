"""Gaps: idle time inside TTFT, classified, sized and linked to the requests it delayed.

* request gaps (from the decomposition): host-side (tokenisation -> engine), waits between
  prefill chunks, scheduling waits (queued -> computing), output IPC, other;
* engine bubbles: idle intervals between consecutive engine steps while requests were
  waiting (a scheduler that could have run but did not);
* cold-start gaps come from :mod:`coldstart`.
"""

from __future__ import annotations

import polars as pl
from ttftscope.schemas.vocabulary import Attr, SpanName

from .decompose import GAP_COLUMNS
from .window import Window


def request_gaps(df: pl.DataFrame) -> dict:
    if df.height == 0:
        return {}
    total = df["ttft"].sum()
    out = {}
    for c in GAP_COLUMNS:
        col = df[c]
        top = df.filter(pl.col(c) > 0).sort(c, descending=True).head(5)
        out[c.removeprefix("gap_")] = {
            "total_ms": col.sum() / 1e6, "share_of_ttft": col.sum() / total if total else 0.0,
            "requests_affected": int((col > 0).sum()), "p99_ms": float(col.quantile(0.99, "linear")) / 1e6,
            "top": [{"request_id": r["request_id"], "trace_id": r["trace_id"], "ms": r[c] / 1e6}
                    for r in top.select("request_id", "trace_id", c).iter_rows(named=True)],
        }
    return out


def step_gaps(store, window: Window) -> pl.DataFrame:
    """Every engine step in the window with the end of the step before it on the same engine:
    ``engine, st, en, waiting, prev_en, idle, observed`` (ns; the first step of each engine left
    out). A stretch of quiet steps the plugin did not watch one by one (its ``unobserved`` span,
    TTFTSCOPE_QUIET_STEPS) is on the timeline as a row with ``observed`` false: the engine was
    stepping there, so the time it covers is no idle gap. The one step query that
    :func:`engine_bubbles` and :func:`bubble_delays` share (the report computes it once, on its
    :class:`~.findings.Context`)."""
    return store.query(f"""
        SELECT engine, st, en, waiting, prev_en, st - prev_en AS idle, observed FROM (
          SELECT SpanAttributes['{Attr.ENGINE}'] AS engine, toUnixTimestamp64Nano(Timestamp) AS st,
                 st + toInt64(Duration) AS en, toUInt32OrZero(SpanAttributes['{Attr.WAITING}']) AS waiting,
                 SpanName = '{SpanName.STEP}' AS observed,
                 lagInFrame(en, 1, toInt64(0)) OVER (PARTITION BY engine ORDER BY st
                     ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS prev_en
          FROM otel_traces WHERE SpanName IN ('{SpanName.STEP}', '{SpanName.UNOBSERVED}') AND {Window.time_filter()})
        WHERE prev_en > 0""", window.params())


def engine_bubbles(store, window: Window, min_idle_ms: float = 2.0, top: int = 10,
                   steps: pl.DataFrame | None = None) -> dict:
    """Idle intervals on each engine timeline while requests waited (``steps``: a
    :func:`step_gaps` frame already computed for the window)."""
    df = step_gaps(store, window) if steps is None else steps
    if df.height == 0:
        return {"steps": 0, "bubbles": 0, "idle_ms": 0.0, "busy_ms": 0.0, "idle_share": 0.0, "top": []}
    seen = df.filter(pl.col("observed").cast(pl.Boolean))
    busy = float((seen["en"] - seen["st"]).sum())  # the steps watched (an unobserved stretch may hold idle time)
    b = seen.filter((pl.col("idle") > int(min_idle_ms * 1e6)) & (pl.col("waiting") > 0))
    idle = float(b["idle"].sum()) if b.height else 0.0
    tops = []
    for r in b.sort("idle", descending=True).head(top).iter_rows(named=True):
        delayed = store.query(
            f"SELECT SpanAttributes['{Attr.REQUEST_ID}'] AS request_id, TraceId AS trace_id FROM otel_traces "
            f"WHERE SpanName = '{SpanName.QUEUE}' AND Timestamp < fromUnixTimestamp64Nano({{e:Int64}}) "
            "AND Timestamp >= fromUnixTimestamp64Nano(toInt64({e:Int64} - 600000000000)) "
            "AND toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) > {s:Int64} LIMIT 20",
            {"s": int(r["prev_en"]), "e": int(r["st"])})
        tops.append({"engine": r["engine"], "start_ns": int(r["prev_en"]), "idle_ms": r["idle"] / 1e6,
                     "waiting": int(r["waiting"]), "delayed_requests": delayed.to_dicts()})
    return {"steps": seen.height, "bubbles": b.height, "idle_ms": idle / 1e6, "busy_ms": busy / 1e6,
            "idle_share": idle / (idle + busy) if busy else 0.0, "top": tops}


def bubble_delays(store, window: Window, min_idle_ms: float = 2.0,
                  steps: pl.DataFrame | None = None) -> pl.DataFrame:
    """Per request (``trace_id``, ``bubble_ns``): the engine-loop idle time (intervals of at
    least ``min_idle_ms`` between consecutive steps of its engine) inside the request's wait
    for its first token on the engine — from when the engine core's input thread had it (its
    intake span's IPC part ends; else when the scheduler had it) to the end of its last prefill
    chunk. The engine had work then (this request), so every such interval delayed it: removing
    the bubbles removes that time (impact's ``scheduling_bubbles``). Idle before the request
    reached the engine core is not counted, nor the loop's own few hundred microseconds between
    steps. ``steps``: a :func:`step_gaps` frame already computed for the window."""
    q = Window.time_filter()
    g = step_gaps(store, window) if steps is None else steps
    steps = (g.filter(pl.col("idle") >= int(min_idle_ms * 1e6))
              .select("engine", pl.col("prev_en").alias("b0"), pl.col("st").alias("b1")))
    rx = f"mapContains(SpanAttributes, '{Attr.INTAKE_IPC_NS}')"
    reqs = store.query(f"""
        SELECT TraceId AS trace_id, anyIf(SpanAttributes['{Attr.ENGINE}'], SpanName = '{SpanName.PREFILL}') AS engine,
               if(countIf(SpanName = '{SpanName.INTAKE}' AND {rx}) > 0,
                  minIf(toUnixTimestamp64Nano(Timestamp) + toInt64OrZero(SpanAttributes['{Attr.INTAKE_IPC_NS}']),
                        SpanName = '{SpanName.INTAKE}' AND {rx}),
                  minIf(toUnixTimestamp64Nano(Timestamp), SpanName = '{SpanName.QUEUE}')) AS r0,
               maxIf(toUnixTimestamp64Nano(Timestamp) + toInt64(Duration), SpanName = '{SpanName.PREFILL}') AS r1
        FROM otel_traces
        WHERE SpanName IN ('{SpanName.INTAKE}', '{SpanName.QUEUE}', '{SpanName.PREFILL}') AND {q}
        GROUP BY TraceId HAVING countIf(SpanName = '{SpanName.QUEUE}') > 0
                           AND countIf(SpanName = '{SpanName.PREFILL}') > 0""", window.params())
    if steps.height == 0 or reqs.height == 0:
        return pl.DataFrame(schema={"trace_id": pl.String, "bubble_ns": pl.Int64})
    hit = reqs.join_where(steps, pl.col("engine") == pl.col("engine_right"), pl.col("b1") > pl.col("r0"),
                          pl.col("b0") < pl.col("r1"))
    return (hit.group_by("trace_id")
               .agg((pl.min_horizontal("b1", "r1") - pl.max_horizontal("b0", "r0")).clip(lower_bound=0).sum()
                    .cast(pl.Int64).alias("bubble_ns")))
