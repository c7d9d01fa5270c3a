"""Alerts: the SLO, the generated rules and thresholds, firing state, regenerate and download."""

import io
import os
import tempfile
import zipfile
from pathlib import Path

import requests
import streamlit as st
from ttftscope.alerts.rules import generate as gen_rules
from ttftscope.dashboards.grafana import generate as gen_grafana
from ttftscope.dashboards.ui.common import table
from ttftscope.schemas.slo import SLOFileError, load_slo

st.title("Alerts")
example = Path(__file__).resolve().parents[3] / "alerts" / "slo.example.yaml"
if not example.exists():
    example = Path(__file__).resolve().parents[2] / "alerts" / "slo.example.yaml"
default = Path(os.environ["TTFTSCOPE_SLO"]).read_text() if os.environ.get("TTFTSCOPE_SLO") else (
    example.read_text() if example.exists() else "version: 1\n")
text = st.text_area("SLO file (YAML)", value=default, height=300)
with tempfile.TemporaryDirectory() as d:
    slo_path = Path(d) / "slo.yaml"
    slo_path.write_text(text)
    try:
        slo = load_slo(slo_path)
    except SLOFileError as e:
        st.error(str(e).replace(str(slo_path), "SLO file"))
        st.stop()
    rules_dir, graf_dir = Path(d) / "rules", Path(d) / "grafana"
    gen_rules(slo, rules_dir)
    gen_grafana(graf_dir, targets_ms=slo.ttft_targets_ms)
    rules_text = (rules_dir / "ttftscope-rules.yml").read_text()
    import yaml

    groups = yaml.safe_load(rules_text)["groups"]
    rows = [{"alert": r["alert"], "severity": r["labels"]["severity"], "for": r["for"], "summary": r["annotations"]["summary"]}
            for g in groups for r in g["rules"] if "alert" in r]
    st.subheader(f"{len(rows)} alerts from this SLO")
    table(rows, hide_index=True, width="stretch")
    with st.expander("Prometheus rules (YAML)"):
        st.code(rules_text, language="yaml")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for p in list(rules_dir.rglob("*")) + list(graf_dir.rglob("*")):
            if p.is_file():
                z.write(p, p.relative_to(d))
    st.download_button("Download rules, Alertmanager config and Grafana dashboards (zip)", buf.getvalue(),
                       file_name="ttftscope-alerts.zip", mime="application/zip")
st.subheader("Firing now")
# The server fetches this URL, so it comes from the operator's configuration (`ttftscope ui
# --prometheus URL`), never from what a viewer types: a page that fetched any URL would let
# every viewer make the UI's host request internal addresses.
prom = os.environ.get("TTFTSCOPE_PROMETHEUS", "")
if prom:
    st.caption(f"Prometheus: {prom} (set with `ttftscope ui --prometheus URL`)")
    try:
        r = requests.get(prom.rstrip("/") + "/api/v1/alerts", timeout=3)
        r.raise_for_status()
        alerts = [a for a in r.json()["data"]["alerts"] if a["labels"].get("alertname")]
        if alerts:
            table([{"alert": a["labels"]["alertname"], "state": a["state"], "severity": a["labels"].get("severity"),
                           "since": a.get("activeAt"), **{k: v for k, v in a["labels"].items() if k not in ("alertname", "severity")}}
                          for a in alerts], hide_index=True)
        else:
            st.success("No alert is pending or firing.")
    except (requests.RequestException, ValueError, KeyError) as e:
        st.error(f"Cannot read alerts from {prom}: {e}")
else:
    st.caption("Start the UI with `ttftscope ui --prometheus URL` to see the current firing state.")
