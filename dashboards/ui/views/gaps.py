"""Gaps & bottlenecks: ranked findings with their evidence and links to the requests."""

import polars as pl
import streamlit as st
from ttftscope.dashboards.ui.common import SEVERITY_ICON, guard, report, sidebar_window, table

st.title("Gaps & bottlenecks")
with guard():
    w = sidebar_window("gp")
    r = report(w, st.session_state.get("slo_spec"))
    if not r.get("requests"):
        st.info("No requests in this window.")
        st.stop()
    st.subheader("Findings, ranked")
    if not r["findings"]:
        st.success("No findings: nothing stands out.")
    for i, f in enumerate(r["findings"]):
        with st.expander(f"{SEVERITY_ICON[f['severity']]} {f['title']}", expanded=i == 0):
            ev = dict(f["evidence"])
            ids = ev.pop("trace_ids", []) or []
            rids = ev.pop("request_ids", []) or []
            st.json(ev, expanded=False)
            advice = next((a for a in r["advice"] if a["finding"] == f["kind"]), None)
            if advice:
                st.markdown(f"**What to change:** {advice['change']}  \n*Expected:* {advice['expected_effect']}")
            for t in ids[:5]:
                st.page_link("views/requests.py", label=f"trace {t}", query_params={"trace": t})
            if rids:
                st.caption("requests: " + ", ".join(map(str, rids[:10])))
    st.subheader("Idle time inside TTFT, by kind")
    g = r["gaps"]["request"]
    table(pl.DataFrame([{"kind": k, "total_ms": v["total_ms"], "share_of_ttft": v["share_of_ttft"],
                                "requests": v["requests_affected"], "p99_ms": v["p99_ms"]} for k, v in g.items()]),
                 hide_index=True, width="stretch")
    e = r["gaps"]["engine"]
    st.subheader("Engine bubbles (idle while requests waited)")
    st.write(f"{e['bubbles']} bubbles, {e['idle_ms']:.1f} ms idle ({e['idle_share']:.1%} of engine time) over {e['steps']} steps")
    if e["top"]:
        table(pl.DataFrame([{k: v for k, v in t.items() if k != "delayed_requests"} | {
            "delayed": len(t["delayed_requests"])} for t in e["top"]]), hide_index=True)
