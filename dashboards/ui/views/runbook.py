"""Runbook: one section per alert ttftscope generates (the alerts' runbook_url points here).

The sections follow the SLO file in ``$TTFTSCOPE_SLO_FILE`` when set, else the defaults."""

import os

import streamlit as st
from ttftscope.alerts.runbook import runbook_markdown
from ttftscope.schemas.slo import SLO, SLOFileError, load_slo

path = os.environ.get("TTFTSCOPE_SLO_FILE")
try:
    slo = load_slo(path) if path else SLO()
except (OSError, SLOFileError) as e:
    st.error(f"Cannot read the SLO file: {e}; showing the defaults.")
    slo = SLO()
st.markdown(runbook_markdown(slo))
