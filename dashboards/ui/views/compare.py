"""Compare: two versions or two windows side by side, phase by phase."""

import datetime as dt

import plotly.graph_objects as go
import polars as pl
import streamlit as st
from ttftscope.analyzer import Window
from ttftscope.analyzer.compare import significant_shifts
from ttftscope.analyzer.requests import choices
from ttftscope.dashboards.ui.common import (
    analyzer,
    compare,
    decomposition,
    guard,
    sidebar_window,
    table,
)

st.title("Compare")
with guard():
    w = sidebar_window("cp")
    df = decomposition(w)
    mode = st.radio("Compare", ["two versions", "two time windows"], horizontal=True)
    if mode == "two versions":
        vs = choices(df)["version"]
        if len(vs) < 2:
            st.info("This window holds fewer than two versions (service.version); compare two time windows instead.")
            st.stop()
        c = st.columns(2)
        va = c[0].selectbox("A", vs, index=0)
        vb = c[1].selectbox("B", vs, index=len(vs) - 1)
        a, b = Window(w.since_ns, w.until_ns, w.model, va), Window(w.since_ns, w.until_ns, w.model, vb)
        la, lb = va, vb
    else:
        mid = (w.since_ns + w.until_ns) // 2
        c = st.columns(2)
        def pick(col, label, lo, hi):
            r = col.slider(label, min_value=dt.datetime.fromtimestamp(w.since_ns / 1e9, dt.timezone.utc),
                           max_value=dt.datetime.fromtimestamp(w.until_ns / 1e9, dt.timezone.utc),
                           value=(dt.datetime.fromtimestamp(lo / 1e9, dt.timezone.utc), dt.datetime.fromtimestamp(hi / 1e9, dt.timezone.utc)),
                           format="HH:mm:ss")
            return int(r[0].timestamp() * 1e9), int(r[1].timestamp() * 1e9) + 1
        a = Window(*pick(c[0], "A", w.since_ns, mid), w.model, w.version)
        b = Window(*pick(c[1], "B", mid, w.until_ns), w.model, w.version)
        la, lb = "A", "B"
    analyzer()  # a clear message if the store cannot be opened
    # the slot is what the viewer picked (relative to the window), so a moved slider computes
    # now while the window's own drift with the clock refreshes in the background
    picked = (a.since_ns - w.since_ns, a.until_ns - w.since_ns, b.since_ns - w.since_ns, b.until_ns - w.since_ns)
    res = compare(f"{w.slot}|{mode}|{la}|{lb}|{picked if mode != 'two versions' else ''}", a, b)
    if "error" in res:
        st.info(f"Nothing to compare: {res['error']} (A: {res['a']['requests']}, B: {res['b']['requests']} requests).")
        st.stop()
    sig = {s["phase"] for s in significant_shifts(res)}
    rows = [{"phase": k, f"median {la} ms": v["median_a_ms"], f"median {lb} ms": v["median_b_ms"], "shift": v["shift"],
             "p-value": v["p_value"], "significant": k in sig} for k, v in res["phases"].items()]
    table(pl.DataFrame(rows), hide_index=True, width="stretch")
    fig = go.Figure()
    fig.add_bar(x=[r["phase"] for r in rows], y=[r[f"median {la} ms"] for r in rows], name=str(la))
    fig.add_bar(x=[r["phase"] for r in rows], y=[r[f"median {lb} ms"] for r in rows], name=str(lb))
    fig.update_layout(barmode="group", height=340, yaxis_title="median ms", margin={"t": 10})
    st.plotly_chart(fig, width="stretch")
    if sig:
        st.warning("Significant shifts (p < 0.001, ≥ 10%): " + ", ".join(sorted(sig)))
    else:
        st.success("No phase shifted significantly.")
