"""ttftscope analyzer (see the issues: built on the data path)."""
