"""The data contract: span vocabulary, the ``otel_traces`` columns and DDL, and the stores."""

from .columns import ARROW_SCHEMA, COLUMN_NAMES, SPAN_COLUMNS
from .ddl import SCHEMA_VERSION, TRACE_ID_TS, TRACES, DDLOptions
from .phases import PHASES, Phase
from .vocabulary import Attr, ResourceAttr, SpanName

__all__ = [
    "ARROW_SCHEMA",
    "COLUMN_NAMES",
    "SPAN_COLUMNS",
    "SCHEMA_VERSION",
    "TRACES",
    "TRACE_ID_TS",
    "DDLOptions",
    "PHASES",
    "Attr",
    "Phase",
    "ResourceAttr",
    "SpanName",
]
