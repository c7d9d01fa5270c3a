"""Requests: filters, time series, the slowest requests and one request's spans across processes.

Everything the UI shows about requests comes from here (the UI holds no analysis logic).
"""

from __future__ import annotations

import polars as pl
from ttftscope.schemas.phases import phase_sql
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

from .decompose import PHASE_COLUMNS

PROMPT_BUCKETS = [(0, 512, "<512"), (512, 2048, "512–2k"), (2048, 8192, "2k–8k"), (8192, 32768, "8k–32k"),
                  (32768, 1 << 31, "≥32k")]


def prompt_bucket_expr() -> pl.Expr:
    e = pl.lit("≥32k")
    for lo, hi, name in reversed(PROMPT_BUCKETS[:-1]):
        e = pl.when((pl.col("prompt_tokens") >= lo) & (pl.col("prompt_tokens") < hi)).then(pl.lit(name)).otherwise(e)
    return e


def filter_requests(df: pl.DataFrame, *, prompt_bucket: str | None = None, priority: str | None = None,
                    model: str | None = None, version: str | None = None) -> pl.DataFrame:
    """Narrow a decomposition. Unknown values raise ValueError (shown to the user, not a traceback)."""
    if prompt_bucket and prompt_bucket not in [b[2] for b in PROMPT_BUCKETS]:
        raise ValueError(f"unknown prompt-length bucket {prompt_bucket!r}")
    if df.height == 0:
        return df
    out = df.with_columns(prompt_bucket_expr().alias("prompt_bucket"))
    if prompt_bucket:
        out = out.filter(pl.col("prompt_bucket") == prompt_bucket)
    for col, v in (("priority", priority), ("model", model), ("version", version)):
        if v:
            out = out.filter(pl.col(col) == v)
    return out


def choices(df: pl.DataFrame) -> dict[str, list[str]]:
    if df.height == 0:
        return {"model": [], "version": [], "priority": [], "prompt_bucket": [b[2] for b in PROMPT_BUCKETS]}
    return {c: sorted(v for v in df[c].unique().to_list() if v) for c in ("model", "version", "priority")} | {
        "prompt_bucket": [b[2] for b in PROMPT_BUCKETS]}


def timeseries(df: pl.DataFrame, points: int = 60) -> pl.DataFrame:
    """TTFT p50/p95/p99 (ms) and request rate (req/s) per interval, ~``points`` intervals.
    An interval without requests is a row with null percentiles and rate 0, so a chart
    breaks its lines across idle periods instead of drawing them straight through."""
    if df.height == 0:
        return pl.DataFrame(schema={"time": pl.Datetime("ns", "UTC"), "p50": pl.Float64, "p95": pl.Float64,
                                    "p99": pl.Float64, "rate": pl.Float64, "requests": pl.UInt32})
    span = max(int(df["t0"].max() - df["t0"].min()), 1)
    step = max(span // points, 10**9)
    agg = (df.with_columns((pl.col("t0") // step * step).alias("b"))
           .group_by("b").agg(pl.col("ttft").quantile(0.5).alias("p50"), pl.col("ttft").quantile(0.95).alias("p95"),
                               pl.col("ttft").quantile(0.99).alias("p99"), pl.len().cast(pl.UInt32).alias("requests")))
    lo, hi = int(agg["b"].min()), int(agg["b"].max())
    every = pl.DataFrame({"b": pl.int_range(lo, hi + step, step, eager=True, dtype=pl.Int64)})
    return (every.join(agg.with_columns(pl.col("b").cast(pl.Int64)), on="b", how="left")
            .with_columns(pl.col("requests").fill_null(0))
            .sort("b")
            .with_columns(pl.from_epoch(pl.col("b"), "ns").dt.replace_time_zone("UTC").alias("time"),
                          *[(pl.col(c) / 1e6) for c in ("p50", "p95", "p99")],
                          (pl.col("requests") / (step / 1e9)).alias("rate"))
            .select("time", "p50", "p95", "p99", "rate", "requests"))


def share_by_band(bands: list[dict]) -> pl.DataFrame:
    """Long frame (band, phase, ms, share) for stacked shares per percentile band."""
    rows = []
    for b in bands:
        tot = sum(b["phases_ms"][p] for p in PHASE_COLUMNS) or 1.0
        for p in PHASE_COLUMNS:
            rows.append({"band": b["band"], "phase": p, "ms": b["phases_ms"][p], "share": b["phases_ms"][p] / tot})
    return pl.DataFrame(rows)


def slowest(df: pl.DataFrame, n: int = 50) -> pl.DataFrame:
    if df.height == 0:
        return df
    return (df.sort("ttft", descending=True).head(n)
            .select("request_id", "trace_id", (pl.col("ttft") / 1e6).alias("ttft_ms"),
                    *[(pl.col(c) / 1e6).alias(f"{c}_ms") for c in PHASE_COLUMNS], "prompt_tokens", "model", "version",
                    "priority"))


def find_trace(store, text: str) -> str | None:
    """A trace id from a trace id or a request id (bound parameters only)."""
    t = (text or "").strip()
    if not t:
        return None
    if len(t) == 32 and all(c in "0123456789abcdefABCDEF" for c in t):
        hit = store.query("SELECT count() FROM otel_traces WHERE TraceId = {t:String}", {"t": t.lower()}).item()
        if hit:
            return t.lower()
    r = store.query(f"SELECT TraceId FROM otel_traces WHERE SpanName = '{SpanName.REQUEST}' "
                    f"AND (SpanAttributes['{Attr.REQUEST_ID}'] = {{r:String}} OR startsWith(SpanAttributes['{Attr.REQUEST_ID}'], {{r:String}})) "
                    "LIMIT 1", {"r": t})
    return r.item() if r.height else None


def request_spans(store, trace_id: str, with_engine: bool = True) -> pl.DataFrame:
    """Every span of a request's trace, plus the engine steps and per-rank allreduce spans
    that ran while its prefill did (the rank tracks of the timeline)."""
    ph = phase_sql()
    base = store.query(f"""
        SELECT SpanId AS span_id, ParentSpanId AS parent, SpanName AS name, {ph} AS phase,
               toUnixTimestamp64Nano(Timestamp) AS start_ns, toInt64(Duration) AS dur_ns,
               multiIf(ResourceAttributes['{ResourceAttr.ROLE}'] != '', ResourceAttributes['{ResourceAttr.ROLE}'], 'process') AS role,
               ResourceAttributes['{ResourceAttr.SERVICE_INSTANCE}'] AS instance, SpanAttributes AS attributes, TraceId AS trace_id
        FROM otel_traces WHERE TraceId = {{t:String}} ORDER BY start_ns""", {"t": trace_id})
    if base.height == 0 or not with_engine:
        return base
    pre = base.filter(pl.col("name") == SpanName.PREFILL)
    if pre.height == 0:
        return base
    lo, hi = int(pre["start_ns"].min()), int((pre["start_ns"] + pre["dur_ns"]).max())
    eng = store.query(f"""
        SELECT SpanId AS span_id, ParentSpanId AS parent, SpanName AS name, {ph} AS phase,
               toUnixTimestamp64Nano(Timestamp) AS start_ns, toInt64(Duration) AS dur_ns,
               if(SpanName = '{SpanName.ALLREDUCE}', concat('rank ', SpanAttributes['{Attr.RANK}']),
                  ResourceAttributes['{ResourceAttr.ROLE}']) AS role,
               ResourceAttributes['{ResourceAttr.SERVICE_INSTANCE}'] AS instance, SpanAttributes AS attributes, TraceId AS trace_id
        FROM otel_traces
        WHERE SpanName IN ('{SpanName.STEP}', '{SpanName.ALLREDUCE}')
          AND Timestamp >= fromUnixTimestamp64Nano({{lo:Int64}}) AND Timestamp <= fromUnixTimestamp64Nano({{hi:Int64}})
        ORDER BY start_ns LIMIT 2000""", {"lo": lo, "hi": hi})
    return pl.concat([base, eng], how="vertical_relaxed")


def gap_intervals(spans: pl.DataFrame, t0: int, ttft: int) -> pl.DataFrame:
    """Intervals inside the TTFT window ``[t0, t0 + ttft]`` that no phase span of the request
    covers (what the timeline shades as idle)."""
    ph = spans.filter((pl.col("phase") != "") & (pl.col("trace_id") == spans["trace_id"][0]) if spans.height else pl.lit(False))
    end = t0 + ttft
    if ph.height == 0:
        return pl.DataFrame({"start_ns": [t0], "end_ns": [end]})
    iv = (ph.select(pl.col("start_ns").clip(t0, end).alias("s"), (pl.col("start_ns") + pl.col("dur_ns")).clip(t0, end).alias("e"))
          .filter(pl.col("e") > pl.col("s")).sort("s")
          .with_columns(pl.col("e").cum_max().shift(1).alias("prev")))
    gaps = iv.filter(pl.col("prev").is_not_null() & (pl.col("s") > pl.col("prev"))).select(
        pl.col("prev").alias("start_ns"), pl.col("s").alias("end_ns"))
    first, last = iv["s"].min(), iv["e"].max()
    edges = []
    if first > t0:
        edges.append({"start_ns": t0, "end_ns": first})
    if last < end:
        edges.append({"start_ns": last, "end_ns": end})
    return pl.concat([gaps, pl.DataFrame(edges, schema=gaps.schema)]).sort("start_ns") if edges else gaps


def data_range(store) -> tuple[int, int] | None:
    """First and last request start in the store (ns), or None when it holds no requests."""
    r = store.query(f"SELECT toUnixTimestamp64Nano(min(Timestamp)) AS lo, toUnixTimestamp64Nano(max(Timestamp)) AS hi, "
                    f"count() AS n FROM otel_traces WHERE SpanName = '{SpanName.REQUEST}'")
    lo, hi, n = r.row(0)
    return (int(lo), int(hi)) if n else None
