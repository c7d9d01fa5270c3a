"""The ttftscope web UI (Streamlit): `ttftscope ui`."""
