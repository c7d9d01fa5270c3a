"""Cold start: process start -> ready per process, its loading phases where they ran (parts inside
the phase that holds them), vs the target."""

import plotly.express as px
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
    palette = px.colors.qualitative.Plotly + px.colors.qualitative.Pastel
    color: dict[str, str] = {}  # one colour a phase, in every process's row
    for c in cold:  # each phase where it ran; a phase's parts drawn inside it, thinner (gaps: idle)
        depth: dict[str, int] = {}
        for p in c.get("phases", []):
            depth[p["name"]] = d = depth.get(p["within"], -1) + 1 if p["within"] else 0
            first = p["name"] not in color  # (its legend entry, once)
            color.setdefault(p["name"], palette[len(color) % len(palette)])
            fig.add_bar(y=[c["instance"]], x=[p["seconds"]], base=[p["start_s"]], orientation="h", name=p["name"],
                        marker_color=color[p["name"]], legendgroup=p["name"], showlegend=first, width=0.8 * 0.7**d,
                        hovertemplate=f"{p['name']}: %{{x:.1f}} s from %{{base:.1f}} s"
                                      + (f" (in {p['within']})" if p["within"] else "") + "<extra></extra>")
    fig.add_vline(x=target, line_dash="dash", line_color="red", annotation_text=f"target {target:.0f} s")
    fig.update_layout(barmode="overlay", height=140 + 50 * len(cold), xaxis_title="seconds from the process's start (a phase's parts inside it; gaps: idle)",
                      margin={"t": 30})
    st.plotly_chart(fig, width="stretch")
    for c in cold:
        g = c.get("largest_gap") or {}
        st.markdown(f"**{c['instance']}** ({c['role'] or 'process'}): {c['cold_start_s']:.1f} s "
                    f"{'⚠️ over target' if c['over_target'] else '✅'}; idle {c['idle_share']:.0%}"
                    + (f"; largest gap {g['seconds']:.1f} s between *{g['after']}* and *{g['before']}*"
                       if g.get("seconds", 0) >= 0.05 else ""))
