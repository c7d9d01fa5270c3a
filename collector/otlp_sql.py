"""OTLP protobuf request bodies -> one Arrow table in ``otel_traces`` layout, decoded by chDB.

The flush hands this query only the bodies the compiled pass (``otlp_compiled``) leaves: span
events or links, array, key-value-list or bytes values; and every body until that pass has
compiled, or where numba is missing.

ClickHouse's ``Protobuf`` input format reads a stream of length-delimited
``ExportTraceServiceRequest`` messages with the schema in ``otlp_columns.proto`` (nested
repeated messages become arrays of tuples), and one SELECT flattens them with ARRAY JOIN and
spells every value as the Python decoder (``otlp.py``) and the OpenTelemetry Collector's
ClickHouse exporter do (ClickHouse and Go both print the shortest digits that read back as
the same double). The work per span and per attribute stays in C++; Python touches
each request body once, to frame it.

The bodies must already be checked and clipped (``otlp.accept_protobuf``): this query
rejects and truncates nothing. A request carrying an array or key-value-list attribute
value (recursive JSON, rare in tracing) or a double that needs an exponent is decoded by the
Python decoder instead.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from ttftscope.schemas import engine
from ttftscope.schemas.columns import ARROW_SCHEMA
from ttftscope.schemas.vocabulary import SPAN_KINDS, STATUS_CODES

PROTO = Path(__file__).with_name("otlp_columns.proto")

#: ``value`` names the member of the oneof that is set (input_format_protobuf_oneof_presence)
_VALUE = ("Tuple(value Enum8('' = 0, 'string_value' = 1, 'bool_value' = 2, 'int_value' = 3, "
          "'double_value' = 4, 'array_value' = 5, 'kvlist_value' = 6, 'bytes_value' = 7), "
          "string_value String, bool_value Bool, int_value Int64, double_value Float64, "
          "array_value String, kvlist_value String, bytes_value String)")
_KV = f"Array(Tuple(key String, value {_VALUE}))"

#: an attribute value as text, as ``otlp._pb_value`` spells it
_VALUE_TEXT = (
    "multiIf(v.value = 'string_value', v.string_value, v.value = 'int_value', toString(v.int_value), "
    "v.value = 'bool_value', if(v.bool_value, 'true', 'false'), "
    "v.value = 'double_value', toString(v.double_value), "
    "v.value = 'bytes_value', base64Encode(v.bytes_value), '')"
)


def _span(events_links: bool) -> str:
    ev = (f", events Array(Tuple(time_unix_nano UInt64, name String, attributes {_KV})), "
          f"links Array(Tuple(trace_id String, span_id String, trace_state String, attributes {_KV}))"
          if events_links else "")
    return (
        "Tuple(trace_id String, span_id String, trace_state String, parent_span_id String, name String, "
        "kind Int32, start_time_unix_nano UInt64, end_time_unix_nano UInt64, "
        f"attributes {_KV}{ev}, status Tuple(message String, code Int32))"
    )


def structure(events_links: bool) -> str:
    """The ClickHouse structure the Protobuf input format fills (fields left out are skipped)."""
    return (f"resource_spans Array(Tuple(resource Tuple(attributes {_KV}), scope_spans Array(Tuple("
            f"scope Tuple(name String, version String), spans Array({_span(events_links)})))))")


def _map(kvs: str) -> str:
    return f"mapFromArrays({kvs}.key, arrayMap(v -> {_VALUE_TEXT}, {kvs}.value))"


def _nested(kvs: str) -> str:
    """1 when a map holds a value this query does not spell as the Python decoder does: an
    array or key-value list (recursive JSON), or a double ClickHouse prints with an exponent,
    or inf/nan (Go prints ``0.0000001``, ``+Inf``, ``NaN``). Such requests are rare and go
    to the Python decoder: spelling them in SQL would lengthen every query's analysis several
    times over, a fixed cost paid on each flush."""
    return (f"arrayExists(v -> v.value IN ('array_value', 'kvlist_value') OR "
            f"(v.value = 'double_value' AND match(toString(v.double_value), '[a-z]')), {kvs}.value)")


def _enum(x: str, names: tuple[str, ...]) -> str:
    arr = "[" + ",".join(f"'{n}'" for n in names) + "]"
    return f"if({x} >= 0 AND {x} < {len(names)}, arrayElement({arr}, {x} + 1), '{names[0]}')"


def _sql(events_links: bool) -> str:
    ev = f"""
  arrayMap(e -> fromUnixTimestamp64Nano(toInt64(e.time_unix_nano), 'UTC'), sp.events) AS `Events.Timestamp`,
  arrayMap(e -> e.name, sp.events) AS `Events.Name`,
  arrayMap(e -> {_map('e.attributes')}, sp.events) AS `Events.Attributes`,
  arrayMap(l -> lower(hex(l.trace_id)), sp.links) AS `Links.TraceId`,
  arrayMap(l -> lower(hex(l.span_id)), sp.links) AS `Links.SpanId`,
  arrayMap(l -> l.trace_state, sp.links) AS `Links.TraceState`,
  arrayMap(l -> {_map('l.attributes')}, sp.links) AS `Links.Attributes`,""" if events_links else ""
    ev_nested = f"""
    OR arrayExists(e -> {_nested('e.attributes')}, sp.events)
    OR arrayExists(l -> {_nested('l.attributes')}, sp.links)""" if events_links else ""
    return f"""
SELECT
  fromUnixTimestamp64Nano(toInt64(sp.start_time_unix_nano), 'UTC') AS `Timestamp`,
  lower(hex(sp.trace_id)) AS TraceId,
  lower(hex(sp.span_id)) AS SpanId,
  lower(hex(sp.parent_span_id)) AS ParentSpanId,
  sp.trace_state AS TraceState,
  sp.name AS SpanName,
  {_enum('sp.kind', SPAN_KINDS)} AS SpanKind,
  ResourceAttributes['service.name'] AS ServiceName,
  ResourceAttributes,
  ss.scope.name AS ScopeName,
  ss.scope.version AS ScopeVersion,
  {_map('sp.attributes')} AS SpanAttributes,
  sp.end_time_unix_nano - sp.start_time_unix_nano AS Duration,
  {_enum('sp.status.code', STATUS_CODES)} AS StatusCode,
  sp.status.message AS StatusMessage,{ev}
  rec AS _record,
  resource_nested OR {_nested('sp.attributes')}{ev_nested} AS _nested
FROM (
  SELECT rec, rs, {_map('rs.resource.attributes')} AS ResourceAttributes,
         {_nested('rs.resource.attributes')} AS resource_nested
  FROM (SELECT rowNumberInAllBlocks() AS rec, resource_spans
        FROM file({{path:String}}, 'Protobuf', {{structure:String}}))
  ARRAY JOIN resource_spans AS rs
)
ARRAY JOIN rs.scope_spans AS ss
ARRAY JOIN ss.spans AS sp
SETTINGS format_schema = '{PROTO}:ExportTraceServiceRequest', max_threads = 1,
  input_format_protobuf_oneof_presence = 1
"""


#: the query for bodies whose spans carry events or links, and the lighter one for the rest
#: (the usual case: the Protobuf reader then skips those fields and the query builds fewer columns)
SQL = {True: _sql(True), False: _sql(False)}
STRUCTURE = {True: structure(True), False: structure(False)}


def warm_up() -> None:
    """Start the chDB engine now (about a second), not on the first flush."""
    with engine.LOCK:
        engine.session().query("SELECT 1", "CSV")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def decode_bodies(bodies: list[bytes], scratch_dir: str | os.PathLike | None = None, *,
                  events_links: bool = True) -> pa.Table:
    """Decode checked ``ExportTraceServiceRequest`` bodies into one table (``ARROW_SCHEMA``).

    ``events_links=False`` is for bodies known (from ``accept_protobuf``) to carry no span
    events or links: their columns come back empty. ``scratch_dir`` holds the framed stream
    chDB reads (deleted before returning)."""
    if not bodies:
        return ARROW_SCHEMA.empty_table()
    fd, path = tempfile.mkstemp(prefix=".otlp-", suffix=".pb", dir=scratch_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(b for body in bodies for b in (_varint(len(body)), body)))
        with engine.LOCK:
            res = engine.session().query(SQL[events_links], "ArrowStream",
                                         params={"path": path, "structure": STRUCTURE[events_links]})
    finally:
        os.unlink(path)
    table = pa.ipc.open_stream(res.bytes()).read_all()
    nested = table.column("_nested").cast(pa.bool_())
    if pc.any(nested).as_py():
        from .otlp import decode

        recs = pc.unique(pc.filter(table.column("_record"), nested)).to_pylist()
        keep = pc.invert(pc.is_in(table.column("_record"), pa.array(recs, table.column("_record").type)))
        return pa.concat_tables(
            [_conform(table.filter(keep))] + [decode(bodies[r], "protobuf")[0] for r in sorted(recs)]
        )
    return _conform(table)


def _conform(table: pa.Table) -> pa.Table:
    """The table in ``ARROW_SCHEMA``; event and link columns the query left out are empty."""
    n = table.num_rows
    zeros = None
    cols = []
    for field in ARROW_SCHEMA:
        if field.name in table.column_names:
            cols.append(table.column(field.name).cast(field.type))
        else:
            if zeros is None:
                zeros = pa.repeat(pa.scalar(0, pa.int32()), n + 1)
            cols.append(pa.ListArray.from_arrays(zeros, pa.array([], field.type.value_type)))
    return pa.Table.from_arrays(cols, schema=ARROW_SCHEMA)
