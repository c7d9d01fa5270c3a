"""Cold start: process start -> ready per process, split into its loading phases, vs the target."""

import plotly.graph_objects as go
import streamlit as st
from ttftscope.analyzer import Window
from ttftscope.dashboards.ui.common import analyzer, guard, sidebar_window

st.title("Cold start")
with guard():
    w = sidebar_window("cs")
    target = st.number_input("Target (s)", min_value=1.0, value=90.0, step=5.0)
    cold = analyzer().cold_start(Window(w.since_ns - 7 * 86400 * 10**9, w.until_ns), target)
    if not cold:
        st.info("No start-up spans in this window (they are emitted when vLLM starts with the plugin).")
        st.stop()
    fig = go.Figure()
    for c in cold:
        base = 0.0
        for name, sec in sorted(c["phases_s"].items(), key=lambda kv: -kv[1]):
            fig.add_bar(y=[c["instance"]], x=[sec], base=[base], orientation="h", name=name, legendgroup=name,
                        showlegend=c is cold[0], hovertemplate=f"{name}: %{{x:.1f}} s<extra></extra>")
            base += sec
        if c["idle_s"] > 0:
            fig.add_bar(y=[c["instance"]], x=[c["idle_s"]], base=[base], orientation="h", name="idle",
                        marker_color="#d3d3d3", legendgroup="idle", showlegend=c is cold[0])
    fig.add_vline(x=target, line_dash="dash", line_color="red", annotation_text=f"target {target:.0f} s")
    fig.update_layout(barmode="overlay", height=140 + 50 * len(cold), xaxis_title="seconds (phases stacked, idle last)",
                      margin={"t": 30})
    st.plotly_chart(fig, width="stretch")
    for c in cold:
        g = c.get("largest_gap") or {}
        st.markdown(f"**{c['instance']}** ({c['role'] or 'process'}): {c['cold_start_s']:.1f} s "
                    f"{'⚠️ over target' if c['over_target'] else '✅'}; idle {c['idle_share']:.0%}"
                    + (f"; largest gap {g['seconds']:.1f} s between *{g['after']}* and *{g['before']}*" if g else ""))
