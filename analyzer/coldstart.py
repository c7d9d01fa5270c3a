"""Cold start: per process, start -> ready, split into its loading phases, against a target.

Uses the plugin's ``ttftscope.process`` span (process start -> ready) and the loading spans
(vLLM's own: "Load model", "Allocate KV cache", ...). Idle time inside the cold start
(no loading phase running) is reported with the largest such gap and its neighbours.
"""

from __future__ import annotations

import polars as pl
from ttftscope.schemas.phases import LOAD_SPANS
from ttftscope.schemas.sql import in_list
from ttftscope.schemas.sql import quote as _q
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

from .window import Window


def cold_start(store, window: Window, target_s: float = 90.0) -> list[dict]:
    ra = lambda k: f"ResourceAttributes[{_q(k)}]"  # noqa: E731
    pid, vpid, host = ra(ResourceAttr.PROCESS_PID), ra(ResourceAttr.VLLM_PROCESS_ID), ra(ResourceAttr.HOST_NAME)
    stage = f"SpanAttributes[{_q(Attr.LOAD_STAGE)}]"
    df = store.query(f"""
        SELECT multiIf({pid} != '', concat({host}, '/', {pid}), {vpid} != '', concat({host}, '/', {vpid}),
                       TraceId) AS trace,
               TraceId AS trace_id,
               if(SpanName = {_q(SpanName.LOAD)} AND {stage} != '', {stage}, SpanName) AS name,
               toUnixTimestamp64Nano(Timestamp) AS s, s + toInt64(Duration) AS e,
               multiIf({ra(ResourceAttr.SERVICE_INSTANCE)} != '', {ra(ResourceAttr.SERVICE_INSTANCE)},
                       {ra(ResourceAttr.VLLM_PROCESS_NAME)} != '', {ra(ResourceAttr.VLLM_PROCESS_NAME)}, {pid}) AS instance,
               {ra(ResourceAttr.ROLE)} AS role,
               ServiceName AS service
        FROM otel_traces
        WHERE SpanName IN ({in_list([SpanName.PROCESS_START, *LOAD_SPANS])})
          AND Timestamp >= fromUnixTimestamp64Nano(toInt64({{since:Int64}} - 86400000000000))
          AND Timestamp < fromUnixTimestamp64Nano({{until:Int64}})
        ORDER BY trace, s""", window.params())
    if df.height == 0:
        return []
    proc = df.filter(pl.col("name") == SpanName.PROCESS_START).select(
        "trace", pl.col("s").alias("p0"), pl.col("e").alias("ready"), "instance", "role", "service", "trace_id")
    loads = df.filter(pl.col("name") != SpanName.PROCESS_START)
    # stock vLLM: no process span -> the loading spans' own extent is the cold start
    missing = loads.join(proc.select("trace"), on="trace", how="anti")
    if missing.height:
        extra = missing.group_by("trace").agg(pl.col("s").min().alias("p0"), pl.col("e").max().alias("ready"),
                                              pl.col("instance").first(), pl.col("role").first(),
                                              pl.col("service").first(), pl.col("trace_id").first())
        proc = pl.concat([proc, extra.select(proc.columns)])
    # without a ttftscope process span, a sub-second extent is not a cold start (e.g. "API server setup")
    proc = proc.filter(~(pl.col("trace").is_in(missing["trace"].unique().implode()) & ((pl.col("ready") - pl.col("p0")) < 10**9)))
    # a cold start belongs to the window it ended (became ready) in
    proc = proc.filter((pl.col("ready") >= window.since_ns) & (pl.col("ready") <= window.until_ns))
    if proc.height == 0:
        return []
    # union of loading intervals per process; blocks of overlapping spans
    lo = (loads.sort("trace", "s")
          .with_columns(_reach("trace").alias("prev_max"))
          .with_columns(((pl.col("prev_max").is_null()) | (pl.col("s") > pl.col("prev_max"))).cast(pl.Int32)
                        .cum_sum().over("trace").alias("block")))
    blocks = (lo.group_by("trace", "block").agg(pl.col("s").min(), pl.col("e").max(),
                                                pl.col("name").first().alias("first"),
                                                # a gap follows the span that ended last before it
                                                # (nested spans: not the one that started last)
                                                pl.col("name").sort_by("e").last().alias("last"))
              .sort("trace", "s")
              .with_columns(pl.col("e").shift(1).over("trace").alias("prev_e"),
                            pl.col("last").shift(1).over("trace").alias("prev_name")))
    busy = blocks.group_by("trace").agg((pl.col("e") - pl.col("s")).sum().alias("busy"))
    worst = (blocks.filter(pl.col("prev_e").is_not_null())
             .with_columns((pl.col("s") - pl.col("prev_e")).alias("gap"))
             .sort("gap", descending=True).group_by("trace").first()
             .select("trace", "gap", pl.col("prev_name").alias("gap_after"), pl.col("first").alias("gap_before")))
    out = []
    rows = proc.join(busy, on="trace", how="left").join(worst, on="trace", how="left").sort("instance")
    phase_map: dict[str, list[dict]] = {}
    for r in _phases(loads).iter_rows(named=True):  # a few rows per process
        phase_map.setdefault(r["trace"], []).append(r)
    for r in rows.iter_rows(named=True):
        dur = (r["ready"] - r["p0"]) / 1e9
        busy_s = (r["busy"] or 0) / 1e9
        phases = [{"name": p["name"], "start_s": (p["s0"] - r["p0"]) / 1e9, "seconds": p["d"] / 1e9,
                   "within": p["within"]} for p in phase_map.get(r["trace"], [])]
        out.append({
            "instance": r["instance"] or r["service"], "role": r["role"], "trace_id": r["trace_id"],
            "cold_start_s": dur, "target_s": target_s, "over_target": dur > target_s, "ready_ns": int(r["ready"]),
            "phases_s": {p["name"]: p["seconds"] for p in phases}, "phases": phases,
            "idle_s": max(dur - busy_s, 0.0), "idle_share": max(dur - busy_s, 0.0) / dur if dur > 0 else 0.0,
            "largest_gap": ({"seconds": r["gap"] / 1e9, "after": r["gap_after"], "before": r["gap_before"]}
                            if r["gap"] is not None else None),
        })
    return out


def _reach(*by: str) -> pl.Expr:
    """How far the spans before each one (rows sorted by start within ``by``) reached: the end of
    the union so far (null for the first); a span past it starts a new block of overlapping ones."""
    return pl.col("e").cum_max().shift(1).over(*by)


def _phases(loads: pl.DataFrame) -> pl.DataFrame:
    """Each process's loading phases (``trace``, ``name``, ``d``: ns, ``s0``/``e1``: extent, ``within``),
    in the order they started. A phase's time is the union of its spans: vLLM nests a "Worker init"
    in another, which a sum counted twice. A phase sits ``within`` the innermost other phase of its
    process that spans it: vLLM's "EngineCoreProc init" holds "Executor init" and "Prepare model",
    whose times are parts of its, not added to it (a sum of every phase came to 34 s of a 20-s start)."""
    ph = (loads.sort("trace", "name", "s")
          .with_columns(_reach("trace", "name").alias("reach"))
          .with_columns((pl.col("e") - pl.max_horizontal("s", pl.col("reach").fill_null(pl.col("s")))).clip(0).alias("d"))
          .group_by("trace", "name").agg(pl.col("d").sum(), pl.col("s").min().alias("s0"), pl.col("e").max().alias("e1"))
          .sort("trace", "s0", pl.col("e1"), "name", descending=[False, False, True, False])
          .with_columns(pl.int_range(pl.len()).over("trace").alias("idx")))
    outer = ph.select("trace", pl.col("name").alias("within"), pl.col("s0").alias("os"), pl.col("e1").alias("oe"),
                      pl.col("idx").alias("oi"))
    within = (ph.join(outer, on="trace")
              .filter((pl.col("os") <= pl.col("s0")) & (pl.col("oe") >= pl.col("e1")) & (pl.col("oi") < pl.col("idx")))
              .group_by("trace", "name").agg(pl.col("within").sort_by("oi").last()))
    return ph.join(within, on=["trace", "name"], how="left").sort("trace", "idx")


def phase_text(c: dict) -> str:
    """A process's phases as a report line: in the order they started, each phase's parts in
    brackets after it ("EngineCoreProc init 14.7 s [Executor init 6.8 s, Prepare model 7.0 s]")."""
    kids: dict[str | None, list[dict]] = {}
    for p in c.get("phases", []):
        kids.setdefault(p["within"], []).append(p)

    def level(parent: str | None) -> str:
        return ", ".join(f"{p['name']} {p['seconds']:.1f} s" + (f" [{level(p['name'])}]" if p["name"] in kids else "")
                         for p in kids.get(parent, []))
    return level(None)


__all__ = ["cold_start", "phase_text"]
