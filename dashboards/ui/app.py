"""ttftscope web UI: `ttftscope ui [--store URL] [--port N]` (or `streamlit run` this file)."""

import streamlit as st

st.set_page_config(page_title="ttftscope", page_icon="⏱️", layout="wide")

pages = [
    st.Page("pages/overview.py", title="Overview", icon="📈", url_path="overview", default=True),
    st.Page("pages/breakdown.py", title="Breakdown", icon="🔥", url_path="breakdown"),
    st.Page("pages/requests.py", title="Requests", icon="🧵", url_path="requests"),
    st.Page("pages/gaps.py", title="Gaps & bottlenecks", icon="🕳️", url_path="gaps"),
    st.Page("pages/compare.py", title="Compare", icon="⚖️", url_path="compare"),
    st.Page("pages/coldstart.py", title="Cold start", icon="🧊", url_path="coldstart"),
    st.Page("pages/alerts.py", title="Alerts", icon="🚨", url_path="alerts"),
]
st.navigation(pages).run()
