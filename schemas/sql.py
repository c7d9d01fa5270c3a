"""ClickHouse SQL spelling shared by every module that writes SQL: one string-literal quoter."""

from __future__ import annotations

from collections.abc import Iterable


def quote(s: str) -> str:
    """``s`` as a ClickHouse string literal (backslashes and single quotes escaped)."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def in_list(values: Iterable[str]) -> str:
    """``'a', 'b'`` for ``x IN (...)``, sorted so generated SQL is stable."""
    return ", ".join(quote(v) for v in sorted(values))
