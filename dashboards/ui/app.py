"""ttftscope web UI: `ttftscope ui [--store URL] [--port N]` (or `streamlit run` this file)."""

import streamlit as st

st.set_page_config(page_title="ttftscope", page_icon=":material/timer:", layout="wide")

pages = [
    st.Page("views/overview.py", title="Overview", icon=":material/monitoring:", url_path="overview", default=True),
    st.Page("views/breakdown.py", title="Breakdown", icon=":material/local_fire_department:", url_path="breakdown"),
    st.Page("views/requests.py", title="Requests", icon=":material/timeline:", url_path="requests"),
    st.Page("views/gaps.py", title="Gaps & bottlenecks", icon=":material/troubleshoot:", url_path="gaps"),
    st.Page("views/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    st.Page("views/coldstart.py", title="Cold start", icon=":material/ac_unit:", url_path="coldstart"),
    st.Page("views/alerts.py", title="Alerts", icon=":material/notifications_active:", url_path="alerts"),
    st.Page("views/runbook.py", title="Runbook", icon=":material/menu_book:", url_path="runbook"),
]
st.navigation(pages).run()
