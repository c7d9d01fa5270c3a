"""ttftscope dashboards (see the issues: built on the data path)."""
