"""ttftscope alerts (see the issues: built on the data path)."""
