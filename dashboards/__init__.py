"""Showing: the Streamlit web UI and the generated Grafana dashboards."""
