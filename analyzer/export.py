"""Export requests as Chrome-trace JSON that Perfetto (ui.perfetto.dev) opens.

One process track per service instance (API server, engine core, each worker rank), spans
as complete (``X``) events on their process; each request also gets an async track (``b``/``e``
with the request's id) so overlapping requests never collide on one thread.
"""

from __future__ import annotations

from ttftscope.schemas.phases import phase_of
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

from .window import Window


def export_perfetto(store, *, trace_ids: list[str] | None = None, request_ids: list[str] | None = None,
                    window: Window | None = None, limit: int = 200) -> dict:
    params: dict = {}
    if trace_ids:
        cond = "TraceId IN {ids:Array(String)}"
        params["ids"] = trace_ids
    elif request_ids:
        cond = (f"TraceId IN (SELECT TraceId FROM otel_traces WHERE SpanName = '{SpanName.REQUEST}' "
                f"AND SpanAttributes['{Attr.REQUEST_ID}'] IN {{rids:Array(String)}})")
        params["rids"] = request_ids
    elif window is not None:
        cond = (f"TraceId IN (SELECT TraceId FROM otel_traces WHERE SpanName = '{SpanName.REQUEST}' "
                f"AND {Window.time_filter()} ORDER BY Timestamp LIMIT {int(limit)})")
        params.update(window.params())
    else:
        raise ValueError("give trace ids, request ids or a window")
    df = store.query(f"""
        SELECT TraceId, SpanId, ParentSpanId, SpanName, toUnixTimestamp64Nano(Timestamp) AS ts, Duration,
               ResourceAttributes['{ResourceAttr.SERVICE_INSTANCE}'] AS inst, ServiceName,
               ResourceAttributes['{ResourceAttr.ROLE}'] AS role, SpanAttributes AS attrs
        FROM otel_traces WHERE {cond} ORDER BY ts""", params)
    events: list[dict] = []
    if df.height == 0:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    procs = sorted({(r["inst"] or r["ServiceName"] or "unknown") for r in df.select("inst", "ServiceName").iter_rows(named=True)})
    pid = {p: i + 1 for i, p in enumerate(procs)}
    for p, i in pid.items():
        events.append({"name": "process_name", "ph": "M", "pid": i, "tid": 0, "args": {"name": p}})
    events.append({"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "requests"}})
    for r in df.iter_rows(named=True):
        proc = r["inst"] or r["ServiceName"] or "unknown"
        attrs = dict(r["attrs"]) if not isinstance(r["attrs"], dict) else r["attrs"]
        ts_us, dur_us = r["ts"] / 1e3, r["Duration"] / 1e3
        args = {"trace_id": r["TraceId"], "span_id": r["SpanId"], **attrs}
        cat = phase_of(r["SpanName"], attrs.get(Attr.PHASE, "")) or "span"
        events.append({"name": r["SpanName"], "cat": cat, "ph": "X", "ts": ts_us, "dur": dur_us,
                       "pid": pid[proc], "tid": 1, "args": args})
        if r["SpanName"] == SpanName.REQUEST:
            rid = attrs.get(Attr.REQUEST_ID) or r["TraceId"]
            events.append({"name": rid, "cat": "request", "ph": "b", "id": r["TraceId"], "ts": ts_us, "pid": 0, "tid": 0,
                           "args": args})
            events.append({"name": rid, "cat": "request", "ph": "e", "id": r["TraceId"], "ts": ts_us + dur_us, "pid": 0,
                           "tid": 0})
        elif r["ParentSpanId"] and cat != "span" and r["SpanName"] not in (SpanName.ALLREDUCE,):
            events.append({"name": r["SpanName"], "cat": "request", "ph": "b", "id": r["TraceId"], "ts": ts_us, "pid": 0,
                           "tid": 0})
            events.append({"name": r["SpanName"], "cat": "request", "ph": "e", "id": r["TraceId"], "ts": ts_us + dur_us,
                           "pid": 0, "tid": 0})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


__all__ = ["export_perfetto"]
