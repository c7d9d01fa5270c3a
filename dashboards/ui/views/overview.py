"""Overview: TTFT percentiles over time against the SLO, request rate, attainment, top findings."""

import plotly.graph_objects as go
import streamlit as st
from ttftscope.analyzer.requests import timeseries
from ttftscope.dashboards.ui.common import (
    SEVERITY_ICON,
    decomposition,
    fmt_ms,
    guard,
    live_tick,
    report,
    sidebar_window,
)

st.title("TTFT overview")
with guard():
    WINDOW = sidebar_window("ov")
live = st.sidebar.toggle("Live refresh (5 s)", value=False, key="live")


@st.fragment(run_every="5s" if live else None)
def body() -> None:
    with guard():
        w = WINDOW
        if live:  # a sliding window keeps moving with the load test
            import dataclasses
            import time

            span = w.until_ns - w.since_ns
            now = time.time_ns() + 10**9
            if w.until_ns >= now - 5 * 10**9:
                w = dataclasses.replace(w, since_ns=now - span, until_ns=now)
        r = report(w, st.session_state.get("slo_spec"), live_tick())
        if not r.get("requests"):
            st.info("No requests with a measurable TTFT in this window. Pick a wider window in the sidebar.")
            return
        slo = r["slo"]["classes"]["all"]
        c = st.columns(5)
        c[0].metric("requests", f"{r['requests']:,}")
        for i, q in enumerate(("p50", "p95", "p99")):
            tgt = slo.get(q, {}).get("target_ms")
            c[i + 1].metric(f"TTFT {q}", fmt_ms(r["ttft_ms"][q]),
                            delta=None if tgt is None else f"{r['ttft_ms'][q] - tgt:+,.0f} ms vs target",
                            delta_color="inverse")
        c[4].metric("SLO attainment (p99 target)", f"{slo.get('p99', {}).get('attainment', 0):.1%}")
        ts = timeseries(decomposition(w, live_tick()))
        fig = go.Figure()
        for q, color in (("p50", "#1f77b4"), ("p95", "#ff7f0e"), ("p99", "#d62728")):
            fig.add_scatter(x=ts["time"].to_list(), y=ts[q].to_list(), name=f"TTFT {q}", line={"color": color})
            if q in slo:
                fig.add_hline(y=slo[q]["target_ms"], line_dash="dot", line_color=color, annotation_text=f"SLO {q}")
        fig.update_layout(height=360, yaxis_title="ms", margin={"t": 30, "b": 10}, legend={"orientation": "h"})
        st.plotly_chart(fig, width="stretch")
        rate = go.Figure(go.Bar(x=ts["time"].to_list(), y=ts["rate"].to_list(), marker_color="#7f7f7f"))
        rate.update_layout(height=180, yaxis_title="req/s", margin={"t": 10, "b": 10})
        st.plotly_chart(rate, width="stretch")
        st.subheader("Top findings")
        if not r["findings"]:
            st.success("Nothing stands out in this window.")
        for f in r["findings"][:3]:
            st.markdown(f"{SEVERITY_ICON[f['severity']]} **{f['title']}**")
        if r["slo"]["violated"]:
            st.warning("SLO violated: " + "; ".join(r["slo"]["violated"]))
        st.page_link("views/gaps.py", label="All findings with their evidence →")


body()
