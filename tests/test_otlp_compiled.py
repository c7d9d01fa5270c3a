"""The compiled decode pass (collector/otlp_compiled.py) stores what the Python decoder, the
reference, stores: every awkward case of tests/test_otlp_sql.py it takes, plugin-like load,
spans of every kind the arrival check tells apart, and randomly damaged requests that still
pass the check — and it leaves to the chDB query exactly the bodies it must not spell itself
(events, links, arrays, key-value lists, bytes)."""

from __future__ import annotations

import random
import threading

import pyarrow as pa
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from test_otlp_scan import NOW, _request
from test_otlp_sql import CASES, T0, _doubles, _req
from ttftscope.collector import otlp_compiled, otlp_scan
from ttftscope.collector.otlp import DecodeError, accept_protobuf, decode
from ttftscope.collector.otlp_sql import decode_bodies

from support.otlp import plugin_like_request

pytestmark = pytest.mark.skipif(not otlp_scan.available(), reason="numba is not installed")

LEFT = {"value types", "events and links", "nested values (Python decoder)"}  # bytes, events, nesting


@pytest.fixture(autouse=True, scope="module")
def _compiled():
    assert otlp_compiled.warm_up(), "numba is installed: the pass compiles"


def _rows(t: pa.Table) -> list[tuple]:
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True))


def _reference(bodies: list[bytes]) -> pa.Table:
    return pa.concat_tables([decode(b, "protobuf")[0] for b in bodies])


def _doubles_body() -> bytes:
    ds = _doubles()
    req = _req(len(ds) // 200 + 1, 8)
    spans = req.resource_spans[0].scope_spans[0].spans
    for i, d in enumerate(ds):
        kv = spans[i // 200].attributes.add()
        kv.key, kv.value.double_value = f"d{i}", d
    return req.SerializeToString()


@pytest.mark.parametrize("name", [*CASES, "doubles"])
def test_each_case_is_decoded_as_the_reference_or_left(name):
    raw = _doubles_body() if name == "doubles" else CASES[name]
    body = accept_protobuf(raw).body
    got, left = otlp_compiled.decode([body])
    if name in LEFT:
        assert left == [0] and got.num_rows == 0
        return
    assert left == []
    assert got.schema == _reference([body]).schema
    assert _rows(got) == _rows(_reference([body]))


def test_many_bodies_at_once_keep_their_own_resources_and_leave_the_rest():
    bodies = [accept_protobuf(b).body for b in CASES.values()]
    got, left = otlp_compiled.decode(bodies)
    names = list(CASES)
    assert sorted(names[i] for i in left) == sorted(LEFT)
    taken = [b for i, b in enumerate(bodies) if i not in left]
    assert _rows(got) == _rows(_reference(taken))


def test_plugin_like_load_and_every_kind_of_span_match_the_chdb_query_too():
    bodies = [plugin_like_request(200, seed=s, t0=NOW - 10**9) for s in range(3)]
    checked = [accept_protobuf(_request(s).SerializeToString(), now_ns=NOW).body for s in range(12)]
    bodies += checked + [_without_events_and_links(b) for b in checked]
    got, left = otlp_compiled.decode(bodies)
    kept = [b for i, b in enumerate(bodies) if i not in left]
    assert len(kept) == 3 + 12, "a body with events or links goes elsewhere; the rest are taken"
    assert _rows(got) == _rows(_reference(kept)) == _rows(decode_bodies(kept))


def _without_events_and_links(body: bytes) -> bytes:
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for sp in ss.spans:
                del sp.events[:]
                del sp.links[:]
    return req.SerializeToString()


def test_damaged_requests_that_pass_the_check_are_decoded_as_the_reference():
    rng = random.Random(11)
    base = [_req(6, s).SerializeToString() for s in range(3)]
    compared = 0
    for _ in range(1500):
        b = bytearray(rng.choice(base))
        i = rng.randrange(len(b))
        b[i] = rng.randrange(256)
        try:
            body = accept_protobuf(bytes(b), now_ns=T0 + 10**9).body
        except DecodeError:
            continue
        got, left = otlp_compiled.decode([body])
        if left:
            continue
        ref = _reference([body])
        assert _rows(got) == _rows(ref)
        compared += 1
    assert compared > 200


def _shuffled_times(seed: int, n: int) -> bytes:
    """A plugin-like body whose spans start in random order, one resource per ten spans."""
    rng = random.Random(seed)
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(plugin_like_request(n, seed=seed, t0=NOW - 10**9))
    spans = list(req.resource_spans[0].scope_spans[0].spans)
    for sp in spans:
        d = sp.end_time_unix_nano - sp.start_time_unix_nano
        sp.start_time_unix_nano = NOW - rng.randrange(10**9)
        sp.end_time_unix_nano = sp.start_time_unix_nano + d
    out = trace_service_pb2.ExportTraceServiceRequest()
    for k in range(0, n, 10):
        rs = out.resource_spans.add()
        rs.resource.CopyFrom(req.resource_spans[0].resource)
        rs.resource.attributes.add(key="part", value={"int_value": k})
        ss = rs.scope_spans.add()
        ss.spans.extend(spans[k:k + 10])
    return out.SerializeToString()


def test_rows_come_in_order_of_start_time_each_with_its_own_attributes():
    bodies = [accept_protobuf(_shuffled_times(s, 60), now_ns=NOW).body for s in range(4)]
    got, left = otlp_compiled.decode(bodies)
    assert left == []
    ts = got.column("Timestamp").cast(pa.int64()).to_pylist()
    assert ts == sorted(ts) and len(set(ts)) > 200
    assert _rows(got) == _rows(_reference(bodies))


def test_more_rows_than_the_size_guess_are_counted_then_filled(monkeypatch):
    monkeypatch.setattr(otlp_compiled, "_density", otlp_compiled._density * 0)  # the guess: nothing
    monkeypatch.setattr(otlp_compiled, "_scratch", threading.local())  # nor tables kept from other tests
    bodies = [accept_protobuf(_shuffled_times(s, 60), now_ns=NOW).body for s in range(4)]
    walks = []
    real = otlp_compiled._walk
    monkeypatch.setattr(otlp_compiled, "_walk", lambda *a: walks.append(a[4]) or real(*a))
    got, left = otlp_compiled.decode(bodies * 3)
    assert walks == [True, False, False], "a bounded walk that stopped, then count and fill"
    assert left == [] and _rows(got) == _rows(_reference(bodies * 3))
    walks.clear()
    otlp_compiled.decode(bodies * 3)
    assert walks == [True], "what it saw sizes the next walk"


def test_a_table_stays_whole_after_the_next_decode_reuses_the_tables():
    """The walk's tables are kept and reused: no column of a returned table may lie in them."""
    a = [plugin_like_request(200, seed=s, t0=NOW - 10**9 + s * 10**6) for s in range(3)]  # in order of start
    b = [accept_protobuf(_shuffled_times(s, 60), now_ns=NOW).body for s in range(3)]
    first, _ = otlp_compiled.decode(a)
    before = _rows(first)
    otlp_compiled.decode(b)
    otlp_compiled.decode(b[::-1])
    assert _rows(first) == before == _rows(_reference(a))


def test_views_of_one_buffer_are_read_where_they_lie():
    """A spool segment's records are views of one read of the file: the same rows as bytes."""
    bodies = [accept_protobuf(_shuffled_times(s, 40), now_ns=NOW).body for s in range(3)]
    buf = memoryview(b"junk" + b"".join(bodies) + b"tail")
    views, at = [], 4
    for body in bodies:
        views.append(buf[at:at + len(body)])
        at += len(body)
    got, left = otlp_compiled.decode(views)
    assert left == [] and _rows(got) == _rows(_reference(bodies))
