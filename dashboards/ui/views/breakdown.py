"""Breakdown: where TTFT goes — a flame (icicle) of phases per percentile band, stacked shares."""

import plotly.express as px
import plotly.graph_objects as go
import polars as pl
import streamlit as st
from ttftscope.analyzer.decompose import PHASE_COLUMNS, by_percentile_band, phase_stats
from ttftscope.analyzer.requests import choices, filter_requests, share_by_band
from ttftscope.dashboards.ui.common import (
    decomposition,
    guard,
    report,
    sidebar_window,
    table,
)
from ttftscope.schemas.phases import COLOURS as PHASE_COLORS

st.title("Where TTFT goes")
with guard():
    w = sidebar_window("bd")
    df = decomposition(w)
    ch = choices(df)
    c = st.columns(4)
    bucket = c[0].selectbox("Prompt length", ["all", *ch["prompt_bucket"]])
    prio = c[1].selectbox("Priority class", ["all", *ch["priority"]])
    model = c[2].selectbox("Model", ["all", *ch["model"]])
    version = c[3].selectbox("Version", ["all", *ch["version"]])
    df = filter_requests(df, prompt_bucket=None if bucket == "all" else bucket, priority=None if prio == "all" else prio,
                         model=None if model == "all" else model, version=None if version == "all" else version)
    if df.height == 0:
        st.info("No requests match these filters in this window.")
        st.stop()
    bands = by_percentile_band(df)
    ids, parents, values, labels, colors = ["TTFT"], [""], [0.0], ["TTFT (mean ms)"], ["#ffffff"]
    for b in bands:
        bid = f"TTFT/{b['band']}"
        ids.append(bid)
        parents.append("TTFT")
        values.append(b["ttft_ms"])
        labels.append(f"{b['band']} ({b['requests']} req)")
        colors.append("#eeeeee")
        for p in PHASE_COLUMNS:
            if b["phases_ms"][p] > 0:
                ids.append(f"{bid}/{p}")
                parents.append(bid)
                values.append(b["phases_ms"][p])
                labels.append(p)
                colors.append(PHASE_COLORS[p])
    values[0] = sum(values[i] for i in range(len(ids)) if parents[i] == "TTFT")
    fig = go.Figure(go.Icicle(ids=ids, parents=parents, values=values, labels=labels, branchvalues="total",
                              marker={"colors": colors}, tiling={"orientation": "v"},
                              hovertemplate="%{label}: %{value:.2f} ms<extra></extra>"))
    fig.update_layout(height=420, margin={"t": 10, "b": 10})
    st.subheader("Flame: mean time per phase, per percentile band")
    st.plotly_chart(fig, width="stretch")
    st.subheader("Share of TTFT per phase, per percentile band")
    sh = share_by_band(bands)
    bar = px.bar(sh.to_pandas(), x="band", y="share", color="phase", color_discrete_map=PHASE_COLORS,
                 category_orders={"phase": PHASE_COLUMNS})
    bar.update_layout(height=320, yaxis_tickformat=".0%", margin={"t": 10, "b": 10})
    st.plotly_chart(bar, width="stretch")
    stats = phase_stats(df)
    table(pl.DataFrame([{"phase": p, **v} for p, v in stats["phases"].items()]), hide_index=True,
                 width="stretch")
    st.subheader("Critical path per percentile band (walk-back from the first token)")
    rep = report(w, st.session_state.get("slo_spec"))
    cp = rep.get("critical_path") or []
    if cp:
        rows = [{"band": b["band"], "phase": p, "ms": v} for b in cp for p, v in b["path_ms"].items()]
        cpf = px.bar(pl.DataFrame(rows).to_pandas(), x="ms", y="band", color="phase", orientation="h",
                     color_discrete_map=PHASE_COLORS, category_orders={"band": [b["band"] for b in cp]})
        cpf.update_layout(height=260, xaxis_title="mean ms on the critical path", margin={"t": 10, "b": 10})
        st.plotly_chart(cpf, width="stretch")
    else:
        st.caption("No phase spans to walk (stock vLLM traces carry only llm_request).")
