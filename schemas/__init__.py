"""The data contract: span vocabulary, the ``otel_traces`` columns and DDL, and the stores.

The names below load on first use (PEP 562): the vLLM plugin and its export sidecar import
``schemas.vocabulary`` and ``schemas.phases`` only, and must not pay for pyarrow (the
columns) in every vLLM process."""

from __future__ import annotations

import importlib

_WHERE = {
    "ARROW_SCHEMA": "columns", "COLUMN_NAMES": "columns", "SPAN_COLUMNS": "columns",
    "SCHEMA_VERSION": "ddl", "TRACES": "ddl", "TRACE_ID_TS": "ddl", "DDLOptions": "ddl",
    "PHASES": "phases", "Phase": "phases",
    "Attr": "vocabulary", "ResourceAttr": "vocabulary", "SpanName": "vocabulary",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
