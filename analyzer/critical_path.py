"""Critical path of each request (CRISP-style walk-back), aggregated per percentile band.

From the first token backwards: take the phase span that finishes last (no later than the
current point, with a tolerance of ``skew`` of TTFT for clock skew between processes), put it
on the path, move the point to its start, repeat; time between path spans is the root's own
time (``gap``). All requests walk back in lockstep, one polars join per step, so there is no
Python loop over spans or requests — only over path depth (a few dozen at most).
"""

from __future__ import annotations

import polars as pl
from ttftscope.schemas.phases import is_phase_span_sql, phase_sql
from ttftscope.schemas.vocabulary import Attr, SpanName

from .decompose import by_band, percentile_band
from .window import Window


def request_phase_spans(store, window: Window) -> pl.DataFrame:
    """Phase spans of the requests in ``window`` relative to the start of their TTFT window
    (ns), with each TTFT: the client's (``ttftscope.http``) when recorded, else vLLM's."""
    return store.query(f"""
        WITH vreqs AS (
          SELECT TraceId, min(toUnixTimestamp64Nano(Timestamp)) AS t0,
                 any(toInt64(round(toFloat64OrZero(SpanAttributes['{Attr.VLLM_TTFT}']) * 1e9))) AS ttft
          FROM otel_traces WHERE SpanName = '{SpanName.REQUEST}' AND {Window.time_filter()} AND {Window.request_filter()}
          GROUP BY TraceId),
        http AS (
          SELECT TraceId, min(toUnixTimestamp64Nano(Timestamp)) AS h0, argMin(toInt64(Duration), Timestamp) AS hdur
          FROM otel_traces WHERE SpanName = '{SpanName.HTTP}' AND {Window.time_filter(60, 600)}
            AND TraceId IN (SELECT TraceId FROM vreqs)
          GROUP BY TraceId),
        reqs AS (
          SELECT v.TraceId AS TraceId, if(ifNull(h.hdur, 0) > 0, h.h0, v.t0) AS t0,
                 if(ifNull(h.hdur, 0) > 0, h.hdur, v.ttft) AS ttft
          FROM vreqs AS v LEFT JOIN http AS h ON v.TraceId = h.TraceId)
        SELECT s.TraceId AS trace_id, {phase_sql('s.SpanName', 's.SpanAttributes')} AS phase, s.SpanName AS name,
               toUnixTimestamp64Nano(s.Timestamp) - r.t0 AS st, st + toInt64(s.Duration) AS en, r.ttft AS ttft
        FROM otel_traces AS s INNER JOIN reqs AS r ON s.TraceId = r.TraceId
        WHERE {is_phase_span_sql('s.SpanName', 's.SpanAttributes')}
          AND {Window.time_filter(60, 600, 's.Timestamp')} AND r.ttft > 0""", window.params())


def walk_back(spans: pl.DataFrame, skew: float = 0.01, max_depth: int = 256) -> pl.DataFrame:
    """One row per span on each request's critical path: trace_id, step (0 = last), phase, name, st, en."""
    if spans.height == 0:
        return pl.DataFrame(schema={"trace_id": pl.Utf8, "step": pl.Int32, "phase": pl.Utf8, "name": pl.Utf8,
                                    "st": pl.Int64, "en": pl.Int64})
    sp = (spans.with_columns(pl.col("en").clip(upper_bound=pl.col("ttft")), pl.col("st").clip(lower_bound=0))
          .filter(pl.col("en") > pl.col("st")).with_row_index("sid"))
    front = sp.group_by("trace_id").agg(pl.col("ttft").first().alias("point"), (pl.col("ttft").first() * skew).alias("tol"))
    path = []
    for step in range(max_depth):
        cand = (sp.join(front, on="trace_id")
                .filter((pl.col("en") <= pl.col("point") + pl.col("tol")) & (pl.col("st") < pl.col("point")))
                .sort(["trace_id", "en", "st"], descending=[False, True, False])
                .group_by("trace_id", maintain_order=True).first())
        if cand.height == 0:
            break
        path.append(cand.select("trace_id", pl.lit(step, pl.Int32).alias("step"), "phase", "name", "st", "en"))
        front = cand.select("trace_id", pl.col("st").alias("point"), "tol")
    return pl.concat(path) if path else walk_back(pl.DataFrame())


def path_by_band(path: pl.DataFrame, decomposition: pl.DataFrame) -> list[dict]:
    """Mean time on the critical path per phase, per TTFT percentile band (the flame per percentile),
    with the remainder of TTFT as the root's own time (gap)."""
    if path.height == 0 or decomposition.height == 0:
        return []
    d = decomposition.select("trace_id", "ttft")
    per = (path.with_columns((pl.col("en") - pl.col("st")).alias("d")).group_by("trace_id", "phase").agg(pl.col("d").sum())
           .pivot(on="phase", index="trace_id", values="d").fill_null(0))
    full = d.join(per, on="trace_id", how="left").fill_null(0)
    phases = [c for c in full.columns if c not in ("trace_id", "ttft")]
    full = full.with_columns((pl.col("ttft") - pl.sum_horizontal(phases)).clip(lower_bound=0).alias("gap"),
                             percentile_band(d["ttft"]))
    return [{"band": r["band"], "requests": r["requests"], "path_ms": {c: r[c] / 1e6 for c in [*phases, "gap"]}}
            for r in by_band(full, [*phases, "gap"])]
