"""The arrival check's compiled scan (collector/otlp_scan.py) against its definition: the
same request checked with the scan and span by span in Python must give the same stored
bytes and the same partial-success report — on well-made requests, on every kind of bad
span, and on valid requests with random bytes changed (whatever upb still parses)."""

from __future__ import annotations

import random

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from ttftscope.collector import otlp_scan
from ttftscope.collector.otlp import DecodeError, Limits, accept_protobuf

from support.otlp import plugin_like_request

pytestmark = pytest.mark.skipif(not otlp_scan.available(), reason="numba is not installed")


@pytest.fixture(autouse=True, scope="module")
def _compiled():
    assert otlp_scan.warm_up(), "numba is installed: the scan compiles"

NOW = 1_790_000_000 * 10**9


def _both(body: bytes, monkeypatch, limits: Limits | None = None):
    """(scanned, Python-only) results of the arrival check: (body, report fields, events_links)."""
    def run():
        a = accept_protobuf(body, limits, now_ns=NOW)
        r = a.report
        return a.body, (r.accepted, r.rejected, dict(r.reasons), dict(r.warnings)), a.events_links
    used = []  # per compiled pass that judged the spans: did it vouch for them?
    real_scan, real_validate = otlp_scan.scan, otlp_scan.validate

    def spy(*args):
        out = real_scan(*args)
        used.append(out is not None)
        return out

    def spy_validate(*args):
        out = real_validate(*args)
        if out is not None and out[4] == out[0]:  # every span judged plainly fine in the one walk
            used.append(True)
        return out
    with monkeypatch.context() as m:
        m.setattr(otlp_scan, "scan", spy)
        m.setattr(otlp_scan, "validate", spy_validate)
        fast = run()
    with monkeypatch.context() as m:
        m.setattr(otlp_scan, "scan", lambda *a: None)
        m.setattr(otlp_scan, "validate", lambda *a: None)
        slow = run()
    return fast, slow, used


def _request(seed: int) -> trace_service_pb2.ExportTraceServiceRequest:
    """Two resources, three scopes, spans of every kind the check tells apart."""
    rng = random.Random(seed)
    req = trace_service_pb2.ExportTraceServiceRequest()
    for r in range(2):
        rs = req.resource_spans.add()
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = "service.name", f"svc{r}"
        for _ in range(1 + r):
            ss = rs.scope_spans.add()
            ss.scope.name = "t"
            for k in range(rng.randint(0, 40)):
                sp = ss.spans.add()
                sp.trace_id = bytes([1 + k % 250]) * 16
                sp.span_id = bytes([1 + (k * 7) % 250]) * 8
                sp.name = "s"
                sp.start_time_unix_nano = NOW - 10**9
                sp.end_time_unix_nano = NOW - 10**9 + rng.randint(0, 10**8)
                for a in range(rng.randint(0, 4)):
                    kv = sp.attributes.add()
                    kv.key, kv.value.int_value = f"a{a}", a
                flaw = rng.random()
                if flaw < 0.05:
                    sp.trace_id = bytes(16)
                elif flaw < 0.10:
                    sp.span_id = b"\x01" * 7
                elif flaw < 0.13:
                    sp.parent_span_id = b"\x02" * 5
                elif flaw < 0.16:
                    sp.end_time_unix_nano = sp.start_time_unix_nano - 1
                elif flaw < 0.19:
                    sp.start_time_unix_nano = 5
                elif flaw < 0.22:
                    sp.start_time_unix_nano = NOW + 10**16
                elif flaw < 0.25:
                    sp.end_time_unix_nano = sp.start_time_unix_nano + 10**17
                elif flaw < 0.30:
                    ev = sp.events.add()
                    ev.name, ev.time_unix_nano = "e", NOW
                elif flaw < 0.33:
                    ln = sp.links.add()
                    ln.trace_id, ln.span_id = b"\x03" * 16, b"\x04" * 8
                elif flaw < 0.36:
                    ln = sp.links.add()
                    ln.trace_id, ln.span_id = b"\x03" * 15, b"\x04" * 8
                elif flaw < 0.40:
                    for a in range(12):
                        kv = sp.attributes.add()
                        kv.key, kv.value.string_value = f"many{a}", "x"
                elif flaw < 0.43:
                    kv = sp.attributes.add()
                    kv.key, kv.value.string_value = "long", "y" * 3000
                elif flaw < 0.46:
                    sp.name = "n" * 1500
    return req


SMALL_LIMITS = Limits(max_attributes=10, max_value_bytes=2000, max_name_bytes=1000, max_events=1, max_links=1)


@pytest.mark.parametrize("seed", range(12))
def test_the_scan_agrees_with_the_python_checks_on_every_kind_of_span(seed, monkeypatch):
    body = _request(seed).SerializeToString()
    for limits in (None, SMALL_LIMITS):
        fast, slow, used = _both(body, monkeypatch, limits)
        assert used and all(used), "the scan vouched for a well-formed request"
        assert fast == slow


def test_a_plugin_like_request_is_checked_by_the_scan_alone(monkeypatch):
    body = plugin_like_request(300, seed=3, t0=NOW - 10**9)
    fast, slow, used = _both(body, monkeypatch)
    assert used == [True] and fast == slow
    assert fast[0] is body or fast[0] == body, "nothing to change: the bytes received are stored"
    assert fast[1][:2] == (300, 0)


def test_unknown_and_repeated_fields_read_as_the_parser_reads_them(monkeypatch):
    """A repeated singular field (the last wins), unknown fields of every wire type."""
    sp = trace_service_pb2.ExportTraceServiceRequest()
    s = sp.resource_spans.add().scope_spans.add().spans.add()
    s.trace_id, s.span_id, s.start_time_unix_nano, s.end_time_unix_nano = b"\x01" * 16, b"\x02" * 8, NOW - 5, NOW
    span = s.SerializeToString()
    extras = [
        b"\x0a\x10" + bytes(16),  # trace_id again, all zero: the last one wins (invalid)
        b"\xa8\x1f\x05",  # field 501, varint
        b"\xb1\x1f" + bytes(8),  # field 502, fixed64
        b"\xbd\x1f" + bytes(4),  # field 503, fixed32
        b"\xc2\x1f\x03abc",  # field 504, bytes
        b"\x39" + (NOW + 10**18).to_bytes(8, "little"),  # start again (absurd)
        b"\x30\x05",  # kind as a varint (known field)
        b"\x0a\x03abc" + b"\x0a\x10" + b"\x05" * 16,  # trace id short, then fine again
    ]
    for extra in extras:
        for with_extra in (span + extra, extra + span):
            body = b"\x0a" + _len(b"\x12" + _len(b"\x12" + _len(with_extra)))
            try:
                accept_protobuf(body, now_ns=NOW)
            except DecodeError:
                continue
            fast, slow, _ = _both(body, monkeypatch)
            assert fast == slow, extra


def _len(b: bytes) -> bytes:
    n, out = len(b), bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + b


def _damaged(rng: random.Random, base: bytes, most: int = 3) -> bytes:
    """``base`` with 1 to ``most`` bytes flipped, runs cut or repeated."""
    b = bytearray(base)
    for _ in range(rng.randint(1, most)):
        op, i = rng.random(), rng.randrange(len(b))
        if op < 0.6:
            b[i] = rng.randrange(256)
        elif op < 0.8:
            del b[i:i + rng.randint(1, 8)]
        else:
            b[i:i] = b[i:i + rng.randint(1, 16)]
    return bytes(b)


def test_random_damage_never_makes_the_scan_disagree(monkeypatch):
    """Valid requests with bytes flipped, cut, repeated: whatever upb still parses is checked
    the same way by both paths; nothing crashes."""
    rng = random.Random(7)
    bases = [_request(s).SerializeToString() for s in range(4)] + [plugin_like_request(40, seed=1, t0=NOW - 10**9)]
    compared = scanned = 0
    for trial in range(2000):
        body = _damaged(rng, rng.choice(bases), most=2)
        try:
            accept_protobuf(body, now_ns=NOW)
        except DecodeError:
            continue
        fast, slow, used = _both(body, monkeypatch)
        assert fast == slow, trial
        compared += 1
        scanned += bool(used) and all(used)
    print(f"{compared} damaged requests parsed, {scanned} of them vouched for by the scan")
    assert scanned > 100, "enough damaged requests still parse to say something"


def test_the_validating_walk_judges_spans_as_the_scan_and_fine_do():
    """``validate`` judges every span in its one walk; on valid and damaged requests, under
    default and small limits, its count of plainly fine spans is what scan + fine count."""
    rng = random.Random(11)
    bases = [_request(s).SerializeToString() for s in range(6)] + [plugin_like_request(40, seed=2, t0=NOW - 10**9)]
    judged = partly = 0
    for trial in range(3000):
        body = rng.choice(bases) if trial < 200 else _damaged(rng, rng.choice(bases), most=2)
        lim = rng.choice((Limits(), SMALL_LIMITS))
        lo, hi, max_dur = lim.min_start_ns, NOW + lim.max_future_ns, lim.max_duration_ns
        small = rng.choice((-1, min(lim.max_value_bytes, lim.max_name_bytes) // 4))
        v = otlp_scan.validate(body, lo, hi, max_dur, lim.max_attributes, small)
        if v is None:
            continue
        scanned = otlp_scan.scan(body, v[0], v[1])
        assert scanned is not None, trial
        n, _ = otlp_scan.fine(scanned[0], scanned[1], lo, hi, max_dur, lim.max_attributes, small)
        assert v[4] == n, (trial, v, n)
        judged += 1
        partly += 0 < n < v[0]
    assert judged > 500 and partly > 50, (judged, partly)


def test_the_validation_table_is_the_installed_proto():
    """``otlp_scan.FIELDS`` says what every field of every message a request can hold is; it
    must be exactly the installed opentelemetry-proto's (a field it lacks is never judged, one
    it gets wrong would let upb disagree)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    kinds = {F.TYPE_STRING: otlp_scan.F_STRING, F.TYPE_BYTES: otlp_scan.F_BYTES, F.TYPE_MESSAGE: otlp_scan.F_MSG,
             F.TYPE_FIXED64: otlp_scan.F_FIXED64, F.TYPE_DOUBLE: otlp_scan.F_FIXED64, F.TYPE_SFIXED64: otlp_scan.F_FIXED64,
             F.TYPE_FIXED32: otlp_scan.F_FIXED32, F.TYPE_FLOAT: otlp_scan.F_FIXED32, F.TYPE_SFIXED32: otlp_scan.F_FIXED32,
             **{t: otlp_scan.F_VARINT for t in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_INT32, F.TYPE_INT64, F.TYPE_ENUM,
                                                 F.TYPE_BOOL)}}
    ours: dict[int, dict[int, tuple[int, int]]] = {}
    for m, f, k, c in otlp_scan.FIELDS:
        ours.setdefault(m, {})[f] = (k, c)
    number: dict[str, int] = {}
    todo, installed = [(trace_service_pb2.ExportTraceServiceRequest.DESCRIPTOR, otlp_scan.REQ)], {}
    while todo:
        d, m = todo.pop()
        if d.full_name in number:
            assert number[d.full_name] == m, d.full_name
            continue
        number[d.full_name] = m
        installed[m] = {}
        for f in d.fields:
            child = ours.get(m, {}).get(f.number, (None, None))[1] if f.message_type else 0
            installed[m][f.number] = (kinds[f.type], child)
            if f.message_type:
                assert child is not None, f"{d.full_name}.{f.name} is not in otlp_scan.FIELDS"
                todo.append((f.message_type, child))
    assert installed == ours


def _upb_parses(body: bytes) -> bool:
    try:
        trace_service_pb2.ExportTraceServiceRequest().ParseFromString(body)
        return True
    except Exception:  # noqa: BLE001 - any refusal
        return False


def test_validation_vouches_only_for_what_upb_parses():
    """Whatever ``validate`` says upb would parse, upb parses: on valid requests, thousands of
    damaged ones, invalid UTF-8 in every kind of string, unknown fields and deep nesting. And it
    does vouch for the valid ones (else the receiver would parse everything, as before)."""
    rng = random.Random(11)
    valid = [_request(s).SerializeToString() for s in range(6)] + [plugin_like_request(60, seed=2, t0=NOW)]
    for body in valid:
        assert otlp_scan.validate(body) is not None
    vouched = refused_by_upb = 0
    for _ in range(4000):
        body = _damaged(rng, rng.choice(valid))
        v = otlp_scan.validate(body)
        ok = _upb_parses(body)
        refused_by_upb += not ok
        if v is not None:
            vouched += 1
            assert ok, body
            r = trace_service_pb2.ExportTraceServiceRequest()
            r.ParseFromString(body)
            assert v[:2] == (sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans),
                             sum(len(rs.scope_spans) for rs in r.resource_spans))
    assert vouched > 500 and refused_by_upb > 500, (vouched, refused_by_upb)
    # invalid UTF-8 (a lone continuation byte, an overlong form, a surrogate, past U+10FFFF, cut
    # short) in a string of each message that has one: upb refuses, the validation does not vouch
    bad = [b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"ok\xff"]
    good = ["é", "€", "𝄞", "plain"]
    setters = [lambda r, s: setattr(r.resource_spans[0], "schema_url", s),
               lambda r, s: setattr(r.resource_spans[0].scope_spans[0].scope, "name", s),
               lambda r, s: setattr(r.resource_spans[0].scope_spans[0].spans[0], "name", s),
               lambda r, s: setattr(r.resource_spans[0].scope_spans[0].spans[0].status, "message", s),
               lambda r, s: setattr(r.resource_spans[0].resource.attributes[0], "key", s),
               lambda r, s: setattr(r.resource_spans[0].resource.attributes[0].value, "string_value", s)]
    marker = "\u2603MARK\u2603"
    for setter in setters:
        for text in good:
            r = _request(1)
            setter(r, text)
            assert otlp_scan.validate(r.SerializeToString()) is not None, text
        for raw in bad:
            r = _request(1)
            setter(r, marker)
            body = r.SerializeToString().replace(marker.encode(), raw.ljust(len(marker.encode()), b"a"))
            assert not _upb_parses(body), raw
            assert otlp_scan.validate(body) is None, raw
    # an unknown field (not judged: parsed by upb, which keeps it) and nesting past MAX_DEPTH
    unknown = valid[0] + b"\xa8\x1f\x05"
    assert _upb_parses(unknown) and otlp_scan.validate(unknown) is None
    r = _request(1)
    v = r.resource_spans[0].scope_spans[0].spans.add().attributes.add().value
    for _ in range(otlp_scan.MAX_DEPTH):
        v = v.array_value.values.add()
    v.string_value = "deep"
    assert _upb_parses(r.SerializeToString()) and otlp_scan.validate(r.SerializeToString()) is None


def test_a_plugin_like_request_is_accepted_without_parsing(monkeypatch):
    """The common request (spans all fine, small resources) never reaches upb's parse; a request
    with a span to reject still does (and gets the same answer as without the shortcut)."""
    from ttftscope.collector import otlp

    class NoParse:
        def ExportTraceServiceRequest(self):  # noqa: N802 - the module attribute it stands for
            raise AssertionError("parsed")

    body = plugin_like_request(300, seed=5, t0=NOW - 10**9)
    with monkeypatch.context() as m:
        m.setattr(otlp, "trace_service_pb2", NoParse())
        got = accept_protobuf(body, now_ns=NOW)
        assert got.body is body and got.report.accepted == 300 and not got.events_links
        r = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        r.resource_spans[0].scope_spans[0].spans[7].trace_id = bytes(16)
        with pytest.raises(AssertionError, match="parsed"):
            accept_protobuf(r.SerializeToString(), now_ns=NOW)
    got = accept_protobuf(r.SerializeToString(), now_ns=NOW)
    assert (got.report.accepted, got.report.rejected) == (299, 1)
