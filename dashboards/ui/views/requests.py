"""Requests: the slowest requests, search by request or trace id, one request as a timeline."""

import orjson
import plotly.graph_objects as go
import polars as pl
import streamlit as st
from ttftscope.analyzer.decompose import GAP_COLUMNS, GAP_LABELS, PHASE_COLUMNS
from ttftscope.analyzer.requests import gap_intervals, slowest
from ttftscope.dashboards.ui.common import (
    UIError,
    analyzer,
    decomposition,
    guard,
    sidebar_window,
    table,
)
from ttftscope.schemas.phases import COLOURS as PHASE_COLORS

st.title("Requests")
with guard():
    w = sidebar_window("rq")
    df = decomposition(w)
    top = slowest(df, 50)
    st.subheader("Slowest requests")
    if top.height == 0:
        st.info("No requests in this window.")
    else:
        table(top, hide_index=True, width="stretch", height=260)
    default = st.query_params.get("trace", "") or (top["trace_id"][0] if top.height else "")
    q = st.text_input("Request id or trace id", value=default)
    if not q:
        st.stop()
    a = analyzer()
    tid = a.find_trace(q)
    if tid is None:
        raise UIError(f"No request or trace matches {q!r}.")
    spans = a.request_spans(tid)
    root = spans.filter(pl.col("name") == "llm_request")
    st.subheader(f"Trace `{tid}`")
    t0 = int(spans["start_ns"].min())
    row = df.filter(pl.col("trace_id") == tid)
    ttft = int(row["ttft"][0]) if row.height else None
    if root.height and row.height:
        t0 = int(root["start_ns"][0])
    tracks = spans.with_columns(
        pl.when(pl.col("instance") != "").then(pl.col("role") + " · " + pl.col("instance")).otherwise(pl.col("role")).alias("track"),
        ((pl.col("start_ns") - t0) / 1e6).alias("start_ms"), (pl.col("dur_ns") / 1e6).alias("dur_ms"))
    fig = go.Figure()
    for phase, g in tracks.group_by("phase"):
        p = phase[0]
        fig.add_bar(y=g["track"].to_list(), x=g["dur_ms"].to_list(), base=g["start_ms"].to_list(), orientation="h",
                    name=p or "other", marker_color=PHASE_COLORS.get(p, "#7f7f7f"),
                    customdata=g["name"].to_list(), hovertemplate="%{customdata}: %{x:.2f} ms at %{base:.2f} ms<extra></extra>")
    if ttft:
        for gi in gap_intervals(spans, t0, ttft).iter_rows(named=True):
            fig.add_vrect(x0=(gi["start_ns"] - t0) / 1e6, x1=(gi["end_ns"] - t0) / 1e6, fillcolor="red", opacity=0.15,
                          line_width=0)
        fig.add_vline(x=ttft / 1e6, line_dash="dash", annotation_text="first token")
        fig.update_xaxes(range=[-0.05 * ttft / 1e6, 1.25 * ttft / 1e6])  # the TTFT window; zoom out for decode
    fig.update_layout(barmode="overlay", height=120 + 40 * tracks["track"].n_unique(),
                      xaxis_title="ms since arrival (red: gaps inside TTFT)",
                      margin={"t": 30, "b": 10})
    st.plotly_chart(fig, width="stretch")
    if row.height:
        r = row.row(0, named=True)
        st.caption("TTFT " + f"{r['ttft'] / 1e6:.2f} ms = " + " + ".join(
            f"{p} {r[p] / 1e6:.2f}" for p in PHASE_COLUMNS if r[p]))
        if r["gap"]:  # what the red stretches were (analyzer.decompose: gaps by their neighbours)
            st.caption("gap: " + ", ".join(f"{GAP_LABELS.get(c, c)} {r[c] / 1e6:.2f} ms" for c in GAP_COLUMNS if r[c]))
    st.download_button("Download as Perfetto JSON", orjson.dumps(a.export_perfetto(trace_ids=[tid])),
                       file_name=f"{tid}.perfetto.json", mime="application/json")
    st.subheader("Spans and attributes")
    table(tracks.select("name", "track", "start_ms", "dur_ms", "span_id", "parent",
                               pl.col("attributes").map_elements(lambda m: orjson.dumps(dict(m)).decode(), return_dtype=pl.Utf8)),
                 hide_index=True, width="stretch")
