"""The chDB decoder (``collector/otlp_sql.py``) stores exactly what the Python decoder does.

The Python decoder is the reference the bad-input and round-trip tests already hold to the
OTLP spec and the OpenTelemetry SDK; here every awkward case it handles (rejected spans,
clipped maps, values of every type, events, links, nested values, doubles that only an
exponent can print) is sent through ``accept_protobuf`` + ``decode_bodies`` and compared
column by column, and the report the client gets must be the same too.
"""

from __future__ import annotations

import random
import struct

import pyarrow as pa
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from ttftscope.collector.otlp import Limits, accept_protobuf, decode, format_double
from ttftscope.collector.otlp_sql import decode_bodies

T0 = 1_780_000_000 * 10**9


def _req(n: int = 4, seed: int = 0) -> trace_service_pb2.ExportTraceServiceRequest:
    rng = random.Random(seed)
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for k, v in (("service.name", "svc"), ("host.name", "h1")):
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = k, v
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "scope", "1.2"
    for i in range(n):
        sp = ss.spans.add()
        sp.trace_id = bytes([seed + 1]) * 8 + struct.pack(">Q", i + 1)
        sp.span_id = struct.pack(">Q", 1000 * (seed + 1) + i + 1)
        if i:
            sp.parent_span_id = struct.pack(">Q", 1000 * (seed + 1) + 1)
        sp.name = f"span-{i}"
        sp.kind = i % 7  # 6 is out of range: Unspecified
        sp.start_time_unix_nano = T0 + i * 1000
        sp.end_time_unix_nano = T0 + i * 1000 + rng.randint(1, 10**9)
        sp.status.code = i % 4
        sp.status.message = "bad" if i % 4 == 2 else ""
        kv = sp.attributes.add()
        kv.key, kv.value.int_value = "n", rng.randint(-(2**63), 2**63 - 1)
        kv = sp.attributes.add()
        kv.key, kv.value.string_value = "s", "ünï\tcödé \"q\" " + str(i)
    return req


def _doubles() -> list[float]:
    rng = random.Random(7)
    fixed = [0.0, -0.0, 1.0, -2.5, 0.1, 0.30000000000000004, 1e-7, 1.5e-7, -1e-5, 1e-4, 123456.789,
             1e15, 1e16, 1.5e16, 1e21, 1.7976931348623157e308, 5e-324, 2.2250738585072014e-308,
             float("inf"), float("-inf"), float("nan"), 12345678901234567890.0, 0.000123456789]
    rnd = [rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30) for _ in range(300)]
    rnd += [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(300)]
    return fixed + rnd


def _cases() -> dict[str, bytes]:
    cases: dict[str, bytes] = {"plain": _req(6).SerializeToString()}

    req = _req(5, 1)
    spans = req.resource_spans[0].scope_spans[0].spans
    spans[0].trace_id = bytes(16)  # rejected: zero trace id
    spans[1].span_id = b"\x01" * 3  # rejected: short span id
    spans[2].start_time_unix_nano = 5  # rejected: before 2000
    spans[3].end_time_unix_nano = spans[3].start_time_unix_nano - 1  # rejected: end before start
    cases["rejected"] = req.SerializeToString()

    req = _req(3, 2)
    sp = req.resource_spans[0].scope_spans[0].spans[0]
    for i, d in enumerate(_doubles()):
        kv = sp.attributes.add()
        kv.key, kv.value.double_value = f"d{i}", d
    sp = req.resource_spans[0].scope_spans[0].spans[1]
    for k, setter in (("t", lambda v: setattr(v, "bool_value", True)), ("f", lambda v: setattr(v, "bool_value", False)),
                      ("b", lambda v: setattr(v, "bytes_value", b"\x00\xffbytes")), ("empty", lambda v: None),
                      ("zero", lambda v: setattr(v, "int_value", 0)), ("es", lambda v: setattr(v, "string_value", ""))):
        kv = sp.attributes.add()
        kv.key = k
        setter(kv.value)
    cases["value types"] = req.SerializeToString()

    req = _req(3, 3)
    sp = req.resource_spans[0].scope_spans[0].spans[1]
    ev = sp.events.add()
    ev.time_unix_nano, ev.name = T0 + 5, "exception"
    kv = ev.attributes.add()
    kv.key, kv.value.double_value = "x", 2.5
    ln = sp.links.add()
    ln.trace_id, ln.span_id, ln.trace_state = b"\x05" * 16, b"\x06" * 8, "k=v"
    kv = ln.attributes.add()
    kv.key, kv.value.bool_value = "l", True
    sp2 = req.resource_spans[0].scope_spans[0].spans[2]
    ev = sp2.events.add()
    ev.time_unix_nano = 1 << 63  # rejected: past int64
    cases["events and links"] = req.SerializeToString()

    req = _req(2, 4)
    sp = req.resource_spans[0].scope_spans[0].spans[0]
    kv = sp.attributes.add()
    kv.key = "arr"
    for x in (1, 2):
        kv.value.array_value.values.add().int_value = x
    kv.value.array_value.values.add().string_value = "three"
    kv = sp.attributes.add()
    kv.key = "kv"
    inner = kv.value.kvlist_value.values.add()
    inner.key, inner.value.double_value = "d", 0.5
    cases["nested values (Python decoder)"] = req.SerializeToString()

    req = _req(2, 5)
    sp = req.resource_spans[0].scope_spans[0].spans[0]
    for i in range(300):  # capped at 256
        kv = sp.attributes.add()
        kv.key, kv.value.string_value = f"k{i}", "v"
    sp = req.resource_spans[0].scope_spans[0].spans[1]
    sp.name = "n" * 5000
    kv = sp.attributes.add()
    kv.key, kv.value.string_value = "long", "é" * 70_000
    kv = sp.attributes.add()
    kv.key, kv.value.bytes_value = "longbytes", b"\x01" * 60_000  # base64 text over the limit
    cases["clipped"] = req.SerializeToString()

    req = _req(2, 6)
    rs2 = req.resource_spans.add()  # a second resource, two scopes
    kv = rs2.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "other"
    for s in range(2):
        ss = rs2.scope_spans.add()
        ss.scope.name = f"sc{s}"
        sp = ss.spans.add()
        sp.trace_id, sp.span_id = b"\x09" * 16, bytes([s + 1]) * 8
        sp.start_time_unix_nano, sp.end_time_unix_nano = T0, T0 + 10
    cases["two resources"] = req.SerializeToString()
    return cases


CASES = _cases()


def _sorted(t: pa.Table) -> pa.Table:
    return t.sort_by([("SpanId", "ascending"), ("Timestamp", "ascending")])


@pytest.mark.parametrize("name", list(CASES))
def test_chdb_decoder_stores_what_the_python_decoder_stores(name):
    body = CASES[name]
    ref, ref_report = decode(body, "protobuf", Limits(), )
    clean, report, events_links = accept_protobuf(body, Limits())
    assert (report.accepted, report.rejected, report.reasons, report.warnings) == (
        ref_report.accepted, ref_report.rejected, ref_report.reasons, ref_report.warnings)
    got = decode_bodies([clean], events_links=events_links)
    assert got.schema == ref.schema
    assert got.num_rows == ref.num_rows == report.accepted
    ref, got = _sorted(ref), _sorted(got)
    for col in ref.column_names:
        assert got.column(col).to_pylist() == ref.column(col).to_pylist(), col


def test_many_bodies_in_one_query_keep_each_requests_resource():
    bodies = [accept_protobuf(b).body for b in CASES.values()]
    got = decode_bodies(bodies)
    ref = pa.concat_tables([decode(b, "protobuf")[0] for b in CASES.values()])
    def pairs(t: pa.Table) -> list[tuple[str, str]]:
        return sorted(zip(t.column("SpanId").to_pylist(), t.column("ServiceName").to_pylist(), strict=True))

    assert pairs(got) == pairs(ref)


def test_doubles_are_spelled_as_go_does():
    """The SQL spelling of doubles against ``format_double`` (Go's FormatFloat 'f', -1),
    which the decoder tests hold to the exporter's output."""
    ds = _doubles()
    req = _req(len(ds) // 200 + 1, 8)
    spans = req.resource_spans[0].scope_spans[0].spans
    for i, d in enumerate(ds):  # 200 per span: under the 256-attribute cap
        kv = spans[i // 200].attributes.add()
        kv.key, kv.value.double_value = f"d{i}", d
    got = decode_bodies([accept_protobuf(req.SerializeToString()).body], events_links=False)
    attrs = {k: v for m in got.column("SpanAttributes").to_pylist() for k, v in m}
    for i, d in enumerate(ds):
        assert attrs[f"d{i}"] == format_double(d), d
    assert attrs[f"d{ds.index(1e-7)}"] == "0.0000001"


def test_unchanged_body_is_stored_as_received():
    body = CASES["plain"]
    assert accept_protobuf(body).body is body
