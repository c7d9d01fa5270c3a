"""Bad input gets the right OTLP/HTTP status and a clear message; the collector keeps serving."""

from __future__ import annotations

import gzip
import time

import orjson
import pytest
import requests
from conftest import CollectorProc, ttftscope_sql
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from support.otlp import otlp_request

PB = {"Content-Type": "application/x-protobuf"}
JS = {"Content-Type": "application/json"}


def _request(n_spans: int = 3, name: str = "ok", start: int | None = None, end: int | None = None,
             n_attrs: int = 2, service: str = "svc-bad"):
    return otlp_request(n_spans, name=name, start=start, end=end, n_attrs=n_attrs, service=service)


def _pb_error(r: requests.Response) -> str:
    st = status_pb2.Status()
    st.ParseFromString(r.content)
    return st.message


def _still_serving(col) -> None:
    r = requests.post(col.url + "/v1/traces", data=_request(1, "after").SerializeToString(), headers=PB, timeout=10)
    assert r.status_code == 200


@pytest.fixture(scope="module")
def _shared(tmp_path_factory):
    """One collector for the module's bad inputs (each test checks it still serves after)."""
    tmp = tmp_path_factory.mktemp("bad-input")
    c = CollectorProc(str(tmp / "store"), tmp / "spool", extra=["--max-body", "1M"]).start()
    yield c
    assert c.terminate() == 0


@pytest.fixture
def col(_shared):
    yield _shared
    _still_serving(_shared)


def test_truncated_protobuf_is_400(col):
    body = _request(5).SerializeToString()
    r = requests.post(col.url + "/v1/traces", data=body[: len(body) // 2], headers=PB, timeout=10)
    assert r.status_code == 400
    assert "invalid protobuf" in _pb_error(r)


def test_garbage_protobuf_is_400(col):
    r = requests.post(col.url + "/v1/traces", data=b"\xff" * 64, headers=PB, timeout=10)
    assert r.status_code == 400


@pytest.mark.parametrize(
    "doc, where",
    [
        ({"resourceSpans": "nope"}, "resourceSpans: expected an array"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "00" * 16, "spanId": "01" * 8,
                                                         "startTimeUnixNano": {"x": 1}}]}]}]},
         "resourceSpans[0].scopeSpans[0].spans[0].startTimeUnixNano: expected an integer"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 42}]}]}]},
         "spans[0].traceId: expected a hex string"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz" * 16}]}]}]}, "is not hex"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "ab" * 16, "spanId": "cd" * 8,
                                                         "attributes": [{"key": "a", "value": {"intValue": "x1"}}]}]}]}]},
         "attributes[0].value.intValue: 'x1' is not an integer"),
        ({"resourceSpans": [{"scopeSpans": [{"spans": [{"kind": "SPAN_KIND_WRONG"}]}]}]}, "unknown enum value"),
        ([1, 2, 3], "$: expected an object"),
    ],
)
def test_wrong_json_types_are_400_with_path(col, doc, where):
    r = requests.post(col.url + "/v1/traces", data=orjson.dumps(doc), headers=JS, timeout=10)
    assert r.status_code == 400
    assert where in r.json()["message"]


def test_invalid_json_is_400(col):
    r = requests.post(col.url + "/v1/traces", data=b'{"resourceSpans": [', headers=JS, timeout=10)
    assert r.status_code == 400 and "invalid JSON" in r.json()["message"]


def test_invalid_utf8_in_protobuf_string_is_400(col):
    body = bytearray(_request(1, name="NAMEMARK").SerializeToString())
    i = body.find(b"NAMEMARK")
    body[i : i + 2] = b"\xc3\x28"  # an invalid UTF-8 sequence inside a proto3 string
    r = requests.post(col.url + "/v1/traces", data=bytes(body), headers=PB, timeout=10)
    assert r.status_code == 400


def test_invalid_utf8_in_json_is_400(col):
    r = requests.post(col.url + "/v1/traces", data=b'{"resourceSpans": [{"x": "\xc3\x28"}]}', headers=JS, timeout=10)
    assert r.status_code == 400


def test_oversized_body_is_413(col):
    body = _request(1, name="x" * (2 << 20)).SerializeToString()
    r = requests.post(col.url + "/v1/traces", data=body, headers=PB, timeout=10)
    assert r.status_code == 413
    assert "exceeds the limit" in _pb_error(r)


def test_gzip_bomb_is_413(col):
    bomb = gzip.compress(b"\0" * (8 << 20))  # 8 MiB of zeros in a few KiB
    r = requests.post(col.url + "/v1/traces", data=bomb, headers={**PB, "Content-Encoding": "gzip"}, timeout=10)
    assert r.status_code == 413


def test_corrupt_gzip_is_400(col):
    r = requests.post(col.url + "/v1/traces", data=b"\x1f\x8b\x08garbage", headers={**PB, "Content-Encoding": "gzip"}, timeout=10)
    assert r.status_code == 400


@pytest.mark.parametrize("ctype", ["text/plain", "application/xml", ""])
def test_wrong_content_type_is_415(col, ctype):
    r = requests.post(col.url + "/v1/traces", data=b"{}", headers={"Content-Type": ctype}, timeout=10)
    assert r.status_code == 415
    assert "application/x-protobuf or application/json" in r.json()["message"]


def test_unknown_encoding_is_415(col):
    r = requests.post(col.url + "/v1/traces", data=b"x", headers={**PB, "Content-Encoding": "br"}, timeout=10)
    assert r.status_code == 415


def test_wrong_route_and_method(col):
    assert requests.post(col.url + "/v1/logs", data=b"", headers=PB, timeout=10).status_code == 404
    assert requests.get(col.url + "/v1/traces", timeout=10).status_code == 405


def test_absurd_timestamps_rejected_by_partial_success(col):
    rejected = col.metric("ttftscope_collector_spans_rejected_total")
    now = time.time_ns()
    cases = [
        _request(2, "zero-start", start=0, end=10),
        _request(2, "far-future", start=now + 10**18, end=now + 10**18 + 5),
        _request(2, "end-before-start", start=now, end=now - 5),
    ]
    for req in cases:
        r = requests.post(col.url + "/v1/traces", data=req.SerializeToString(), headers=PB, timeout=10)
        assert r.status_code == 200
        resp = trace_service_pb2.ExportTraceServiceResponse()
        resp.ParseFromString(r.content)
        assert resp.partial_success.rejected_spans == 2
        assert "rejected" in resp.partial_success.error_message
    # JSON clients get the same answer in JSON
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": "ab" * 16, "spanId": "cd" * 8, "startTimeUnixNano": "5", "endTimeUnixNano": "6"}]}]}]}
    r = requests.post(col.url + "/v1/traces", data=orjson.dumps(doc), headers=JS, timeout=10)
    assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "1"
    assert col.metric("ttftscope_collector_spans_rejected_total") - rejected == 7


def test_huge_attribute_map_is_capped_and_reported(col):
    req = _request(1, name="huge-attrs", n_attrs=5000)
    r = requests.post(col.url + "/v1/traces", data=req.SerializeToString(), headers=PB, timeout=10)
    assert r.status_code == 200
    resp = trace_service_pb2.ExportTraceServiceResponse()
    resp.ParseFromString(r.content)
    assert resp.partial_success.rejected_spans == 0
    assert "attributes dropped beyond 256" in resp.partial_success.error_message
    _still_serving(col)
    assert col.terminate() == 0
    rows = ttftscope_sql(col.store, "SELECT length(mapKeys(SpanAttributes)) AS n FROM otel_traces "
                                    "WHERE SpanName = 'huge-attrs'")
    assert [int(r["n"]) for r in rows] == [256]
    col.start()  # the fixture's teardown checks it still serves


def test_bearer_token(collector_factory):
    c = collector_factory(extra=["--token", "s3cret"]).start()
    body = _request(1).SerializeToString()
    assert requests.post(c.url + "/v1/traces", data=body, headers=PB, timeout=10).status_code == 401
    bad = {**PB, "Authorization": "Bearer nope"}
    assert requests.post(c.url + "/v1/traces", data=body, headers=bad, timeout=10).status_code == 401
    good = {**PB, "Authorization": "Bearer s3cret"}
    assert requests.post(c.url + "/v1/traces", data=body, headers=good, timeout=10).status_code == 200
    assert c.terminate() == 0


# ---------------------------------------------------------- the request line and headers, raw
# The collector reads headers with its own lean parser (collector/server.py): it must read them
# as http.server did — any case, folded lines, Expect: 100-continue, HTTP/1.0 and keep-alive —
# and refuse what http.server refused (431).

def _raw(col, data: bytes, *, until_close: bool = True) -> bytes:
    import socket

    host, port = col.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        if not until_close:
            return s.recv(65536)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _post_head(body: bytes, headers: str, version: str = "HTTP/1.1") -> bytes:
    return f"POST /v1/traces {version}\r\n{headers}Content-Length: {len(body)}\r\n\r\n".encode()


def test_headers_in_any_case_and_folded_are_read(col):
    body = _request(2, "hdr").SerializeToString()
    got = _raw(col, _post_head(body, "content-TYPE:application/x-protobuf\r\nConnection:  close \r\n") + body)
    assert got.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in got
    folded = _post_head(body, "Content-Type:\r\n application/x-protobuf\r\nConnection: close\r\n") + body
    assert _raw(col, folded).startswith(b"HTTP/1.1 200 ")


def test_expect_100_continue_then_the_body(col):
    import socket

    body = _request(2, "expect").SerializeToString()
    host, port = col.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(_post_head(body, "Content-Type: application/x-protobuf\r\nExpect: 100-continue\r\n"))
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue")
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_one_connection_gets_each_answer_with_its_own_length_and_close(col):
    """Response heads are reused within a second (a fleet's 200s): each answer on a keep-alive
    connection still carries its own Content-Length, and only the last one Connection: close."""
    import http.client

    bodies = [_request(3, "fine"), _request(2, "zero-start", start=0, end=10), _request(3, "fine-again"),
              _request(2, "zero-start-2", start=0, end=10)]
    conn = http.client.HTTPConnection(col.url.split("//")[1], timeout=10)
    got = []
    for i, req in enumerate(bodies):
        headers = dict(PB, **({"Connection": "close"} if i == len(bodies) - 1 else {}))
        conn.request("POST", "/v1/traces", body=req.SerializeToString(), headers=headers)
        r = conn.getresponse()
        data = r.read()
        assert int(r.getheader("Content-Length")) == len(data) and r.getheader("Date")
        got.append((r.status, len(data), r.getheader("Connection")))
    conn.close()
    assert [g[0] for g in got] == [200] * 4
    assert got[0][1] == got[2][1] and got[1][1] > got[0][1], got  # partial success says more
    assert [g[2] for g in got] == [None, None, None, "close"]


def test_http_1_0_closes_unless_kept_alive(col):
    body = _request(2, "old").SerializeToString()
    closed = _raw(col, _post_head(body, "Content-Type: application/x-protobuf\r\n", "HTTP/1.0") + body)
    assert closed.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in closed
    kept = _post_head(body, "Content-Type: application/x-protobuf\r\nConnection: keep-alive\r\n", "HTTP/1.0") + body
    first = _raw(col, kept + kept, until_close=False)
    assert first.startswith(b"HTTP/1.1 200 ") and b"Connection: close" not in first


@pytest.mark.parametrize("headers", ["".join(f"X-{i}: y\r\n" for i in range(101)), "X-Long: " + "y" * 70_000 + "\r\n"])
def test_too_many_or_too_long_headers_are_431(col, headers):
    got = _raw(col, f"POST /v1/traces HTTP/1.1\r\n{headers}\r\n".encode())
    assert got.startswith(b"HTTP/1.1 431 "), got[:80]


def test_a_bad_request_line_is_refused(col):
    # (as http.server: a line whose version is unreadable is answered as HTTP/0.9, a body alone)
    assert b"Error code: 400" in _raw(col, b"POST /v1/traces HTTP/1.x\r\n\r\n")
    assert b"Error code: 505" in _raw(col, b"POST /v1/traces HTTP/2.0\r\n\r\n")
    assert _raw(col, b"POST / v1 HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400 ")


# A plain header block (every OTLP exporter's) is read in a few calls where it lies, anything else
# line by line: both must give the same value for every name, and the fast path must step aside
# (None) for every block that is not plain.
_NAMES = ["Content-Type", "content-length", "CONTENT-ENCODING", "Connection", "Authorization", "Expect", "X-Absent"]


def _line_by_line(block: bytes):
    from ttftscope.collector.server import _headers

    return _headers([ln + b"\r\n" for ln in block.split(b"\r\n")[:-1]])


@pytest.mark.parametrize("block", [
    b"",
    b"Content-Type: application/x-protobuf\r\nContent-Length: 12\r\n",
    b"content-TYPE:application/x-protobuf\r\nConnection:  close  \r\nX-Empty:\r\nX-Spaces:   \r\n",
    # the first of repeated fields, in any case
    b"Content-Type: application/x-protobuf\r\nCONTENT-TYPE: application/json\r\nExpect: 100-continue\r\n",
    b"Authorization: Bearer s3cret with spaces \r\nContent-Encoding: gzip\r\nX-Colon: a:b:c\r\n",
    b"".join(b"X-%d: y\r\n" % i for i in range(100)),
])
def test_a_plain_header_block_reads_as_line_by_line(block):
    from ttftscope.collector.server import _plain_headers

    fast, slow = _plain_headers(block), _line_by_line(block)
    assert fast is not None
    names = _NAMES + [ln.split(b":", 1)[0].decode() for ln in block.split(b"\r\n")[:-1]]
    assert [fast.get(n) for n in names] == [slow.get(n) for n in names]
    assert fast.get("X-Absent", "d") == "d"


@pytest.mark.parametrize("block", [
    b"Content-Type:\r\n application/x-protobuf\r\n",  # folded
    b"Content-Type : application/x-protobuf\r\n",  # a space before the colon
    b"Content-Type:\tapplication/x-protobuf\r\n",  # a tab
    b"Content-Type: application/x-protobuf\n",  # a bare LF
    b"X-Latin: caf\xe9\r\n",  # not ASCII
    b"no colon here\r\n",
    b"".join(b"X-%d: y\r\n" % i for i in range(101)),  # past 100 fields: 431 from the line-by-line path
])
def test_any_other_header_block_is_left_to_the_line_by_line_path(block):
    from ttftscope.collector.server import _plain_headers

    assert _plain_headers(block) is None


def test_random_header_blocks_read_the_same_both_ways():
    import random

    from ttftscope.collector.server import _plain_headers

    rng = random.Random(7)
    alphabet = [b"a", b"Z", b"-", b":", b" ", b"\t", b"x", b"1", b"\xe9", b"\r\n", b"\n", b"!", b"~"]
    plain = 0
    for _ in range(3000):
        lines = []
        for _ in range(rng.randint(0, 5)):
            name = rng.choice([b"Content-Type", b"connection", b"X-A", b"X A", b""])
            lines.append(name + rng.choice([b":", b" :", b""]) + b"".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))))
        block = b"".join(ln + b"\r\n" for ln in lines)
        fast = _plain_headers(block)
        if fast is None:
            continue
        plain += 1
        slow = _line_by_line(block)
        names = _NAMES + ["X-A", "x-a", "X A", ""]
        assert [fast.get(n) for n in names] == [slow.get(n) for n in names], block
    assert plain > 300  # the generator makes plain blocks too, not only ones the fast path refuses


def test_the_server_reads_a_plain_head_without_the_line_by_line_parser(tmp_path, monkeypatch):
    """The fast path is the one taken for an exporter's head (not dead code), and a folded head
    still goes line by line; both requests are answered 200 on one connection."""
    import asyncio

    import ttftscope.collector.server as srv_mod
    from ttftscope.collector.metrics import CollectorMetrics
    from ttftscope.collector.pipeline import Pipeline
    from ttftscope.collector.spool import Spool
    from ttftscope.schemas.store import open_store

    calls = []
    line_by_line = srv_mod._headers
    monkeypatch.setattr(srv_mod, "_headers", lambda lines: calls.append(len(lines)) or line_by_line(lines))
    monkeypatch.setattr(srv_mod, "_LINES", {})  # no request line known yet

    class Transport:
        def __init__(self) -> None:
            self.out: list[bytes] = []

        def write(self, b: bytes) -> None:
            self.out.append(b)

        def get_extra_info(self, _k):
            return None

        def close(self) -> None:
            pass

    pipeline = Pipeline(lambda: open_store(str(tmp_path / "store")), Spool(tmp_path / "spool", fsync=False),
                        CollectorMetrics())
    server = srv_mod.CollectorHTTPServer(srv_mod.ServerConfig(port=0), pipeline)
    loop = asyncio.new_event_loop()
    server.loop = loop
    try:
        conn, t = srv_mod._Conn(server), Transport()
        conn.connection_made(t)
        body = _request(2, "fast").SerializeToString()
        heads = [_post_head(body, "Host: x\r\nContent-Type: application/x-protobuf\r\nUser-Agent: OTel-OTLP-Exporter\r\n"),
                 _post_head(body, "Content-Type:\r\n application/x-protobuf\r\n")]
        for head in heads * 2:  # the first request line is read line by line, then it is known
            conn.data_received(head + body)
            loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        loop.close()
        server._sock.close()
    assert [o[:13] for o in t.out] == [b"HTTP/1.1 200 "] * 4, t.out
    assert calls == [4, 3, 3], calls  # the plain head once (its line unknown yet), the folded one twice
