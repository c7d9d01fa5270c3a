"""OTLP/HTTP for the plugin's own spans: protobuf written as bytes.

Building ``Span``/``KeyValue``/``AnyValue`` message objects for every span is the costly part
of exporting from inside vLLM's processes; writing the same wire format directly, with the
encoded attribute keys and span names cached, costs a fraction of that (figures: README,
bench/overhead). The bytes are the OTLP ``ExportTraceServiceRequest`` schema exactly (checked
against the official protobuf classes in the tests); repeated fields concatenate, so a request
made of SDK-encoded spans and ours is the two byte strings joined.

``OtlpHttpPoster`` sends a serialized request with ``http.client`` on one kept-alive
connection, without the per-post work of the SDK's ``requests`` session (proxy lookup in the
environment, cookies, adapters). It honours the standard ``OTEL_EXPORTER_OTLP_[TRACES_]HEADERS``,
``..._COMPRESSION`` (gzip) and ``..._CERTIFICATE``.
"""

from __future__ import annotations

import gzip
import http.client
import os
import socket
import ssl
import struct
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

_MASK64 = (1 << 64) - 1
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack
_SMALL = [bytes((i,)) for i in range(128)]  # one-byte varints


def varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint (up to four bytes unrolled: lengths, counts,
    nanosecond durations under 0.27 s)."""
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0x200000:
        return bytes(((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, n >> 14))
    if n < 0x10000000:
        return bytes(((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, ((n >> 14) & 0x7F) | 0x80, n >> 21))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte, the payload's length, the payload."""
    return tag + varint(len(payload)) + payload


_KEYS: dict[str, bytes] = {}  # attribute key -> KeyValue.key field, encoded
_NAMES: dict[str, bytes] = {}  # span name -> Span.name field, encoded
_CACHE_CAP = 4096  # keys and names are a small fixed vocabulary; never unbounded
#: field tag -> {(key, value): the encoded KeyValue} for ints under 1024 and strings of at most
#: 16 bytes (phases, engines, priorities, counts): most of a span's attributes repeat, and a
#: lookup costs less than writing the entry (a span's attributes 25-35 % less CPU, warm). Keyed by
#: exact type (int or str: a bool, a float or a subclass never looks up), bounded per tag
_PAIRS: dict[bytes, dict] = {}
_PAIRS_CAP = 8192


def _cached(cache: dict[str, bytes], tag: bytes, s: str) -> bytes:
    b = cache.get(s)
    if b is None:
        b = field(tag, s.encode())
        if len(cache) < _CACHE_CAP:
            cache[s] = b
    return b


def any_value(v) -> bytes:
    """An ``AnyValue`` (string 1, bool 2, int64 3, double 4); other types as their str().
    (``key_values`` inlines the common str and small-int cases before calling this.)"""
    if isinstance(v, str):
        return field(b"\x0a", v.encode())
    if isinstance(v, bool):  # before int: a bool is an int
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + varint(int(v) & _MASK64)
    if isinstance(v, float):
        return b"\x21" + _pack_d(float(v))
    return field(b"\x0a", str(v).encode())


def key_values(tag: bytes, attrs: Mapping) -> bytes:
    """Repeated ``KeyValue`` under field ``tag`` (None values left out). The hot loop of
    every export: pairs seen before reused whole (``_PAIRS``), strings and ints inline, lengths
    summed rather than measured on joined pieces, every piece joined once at the end (~30 %
    less than building each entry)."""
    out: list[bytes] = []
    ext = out.extend
    app = out.append
    small, keys, pairs = _SMALL, _KEYS, _PAIRS.get(tag)
    if pairs is None:
        pairs = _PAIRS[tag] = {}
    for k, v in attrs.items():
        t = type(v)
        if t is int or t is str:
            got = pairs.get((k, v))
            if got is not None:
                app(got)
                continue
        if t is int and 0 <= v < 0x10000000:  # counts, steps, ns durations: the common case
            kb = keys.get(k) or _cached(keys, b"\x0a", k)
            vb = small[v] if v < 128 else varint(v)
            n = len(vb) + 1  # AnyValue: int_value's tag and varint
            m = len(kb) + n + 2  # KeyValue: key, value's tag and one-byte length, value
            e = (tag, small[m] if m < 128 else varint(m), kb, b"\x12", small[n], b"\x18", vb)
            if v < 1024 and len(pairs) < _PAIRS_CAP:
                pairs[(k, v)] = b"".join(e)
            ext(e)
            continue
        if t is str:
            vb = v.encode()
            n = len(vb)
            av = b"\x0a" + (small[n] if n < 128 else varint(n)) + vb
            if n <= 16 and len(pairs) < _PAIRS_CAP:
                kb = keys.get(k) or _cached(keys, b"\x0a", k)
                n = len(av)
                m = len(kb) + 2 + n
                pairs[(k, v)] = e = b"".join((tag, small[m] if m < 128 else varint(m), kb, b"\x12", small[n], av))
                app(e)
                continue
        elif v is None:
            continue
        else:
            av = any_value(v)
        kb = keys.get(k) or _cached(keys, b"\x0a", k)
        n = len(av)
        nb = small[n] if n < 128 else varint(n)
        m = len(kb) + 1 + len(nb) + n
        ext((tag, small[m] if m < 128 else varint(m), kb, b"\x12", nb, av))
    return b"".join(out)


def span(trace_id: bytes, span_id: bytes, parent_id: bytes, state: str, name: str,
         start_ns: int, end_ns: int, attrs: Mapping, kind: bytes = b"\x30\x01") -> bytes:
    """One ``Span``; ``kind``: the field as written (``span_kind``: INTERNAL unless told)."""
    head = b"\x0a\x10" + trace_id + b"\x12\x08" + span_id
    if state:
        head += field(b"\x1a", state.encode())
    if parent_id:
        head += (b"\x22\x08" + parent_id) if len(parent_id) == 8 else field(b"\x22", parent_id)
    return b"".join((head, _NAMES.get(name) or _cached(_NAMES, b"\x2a", name), kind, b"\x39",
                     _pack_q(start_ns & _MASK64), b"\x41", _pack_q(end_ns & _MASK64), key_values(b"\x4a", attrs)))


def span_kind(kind: int) -> bytes:
    """``Span.kind`` as ``span`` takes it, from the OpenTelemetry API's ``SpanKind`` value
    (INTERNAL 0, SERVER 1 ...; OTLP counts from 1)."""
    return b"\x30" + _SMALL[kind + 1]


def resource_spans(resource_attrs: Mapping, scope: tuple[str, str], spans: list[bytes]) -> bytes:
    """One ``ResourceSpans``: the resource, one scope, its spans."""
    scope_pb = field(b"\x0a", field(b"\x0a", scope[0].encode()) + field(b"\x12", scope[1].encode()))
    scope_spans = scope_pb + b"".join(field(b"\x12", s) for s in spans)
    return field(b"\x0a", key_values(b"\x0a", resource_attrs)) + field(b"\x12", scope_spans)


_SCALARS = (str, int, float, bool)
_STATUS_UNSET = b"\x7a\x00"  # Span.status (field 15), an empty Status: code UNSET, no message
_FLAGS_TAG = b"\x85\x01"  # Span.flags (field 16, fixed32)


def _scalars(attrs: Mapping) -> bool:
    return all(v.__class__ in _SCALARS or v is None for v in attrs.values())


def _sdk_span(s) -> bytes | None:
    """One SDK ``ReadableSpan`` as the SDK's OTLP encoder writes it; None when it has what
    this writer leaves to that encoder (events, links, dropped counts, array values)."""
    if s.events or s.links or s.dropped_attributes or s.dropped_events or s.dropped_links:
        return None
    attrs = s.attributes or {}
    if not _scalars(attrs):
        return None
    c, parent = s.context, s.parent
    state = ",".join(f"{k}={v}" for k, v in c.trace_state.items()) if c.trace_state else ""
    parts = [b"\x0a\x10", c.trace_id.to_bytes(16, "big"), b"\x12\x08", c.span_id.to_bytes(8, "big")]
    if state:
        parts.append(field(b"\x1a", state.encode()))
    if parent is not None:
        parts.append(field(b"\x22", parent.span_id.to_bytes(8, "big")))
    parts += [_cached(_NAMES, b"\x2a", s.name), b"\x30", _SMALL[s.kind.value + 1],  # OTLP kinds count from 1
              b"\x39", _pack_q(s.start_time & _MASK64), b"\x41", _pack_q(s.end_time & _MASK64),
              key_values(b"\x4a", attrs)]
    st = s.status
    code, desc = (st.status_code.value, st.description) if st is not None else (0, None)
    if st is not None:
        body = (field(b"\x12", desc.encode()) if desc else b"") + (b"\x18" + varint(code) if code else b"")
        parts.append(field(b"\x7a", body) if body else _STATUS_UNSET)
    flags = 0x100 | (0x200 if parent is not None and parent.is_remote else 0)  # has-is-remote, is-remote
    parts += [_FLAGS_TAG, struct.pack("<I", flags)]
    return b"".join(parts)


_RESOURCES: dict = {}  # SDK Resource -> its encoded Resource message (a process has one or two)


def sdk_request(spans, tick=None) -> bytes | None:
    """SDK ``ReadableSpan``s as a serialized ``ExportTraceServiceRequest``, grouped by resource
    and scope as the SDK's encoder groups them (the same message, at a fraction of its cost);
    None if any span or resource needs what only that encoder writes. ``tick``, when given, is
    called before each span (the export thread gives the GIL away there now and then)."""
    groups: dict = {}
    for s in spans:
        if tick is not None:
            tick()
        b = _sdk_span(s)
        if b is None:
            return None
        groups.setdefault(s.resource, {}).setdefault(s.instrumentation_scope, []).append(b)
    out = []
    for res, scopes in groups.items():
        rb = _RESOURCES.get(res)
        if rb is None:
            if not _scalars(res.attributes):
                return None
            rb = field(b"\x0a", key_values(b"\x0a", res.attributes))
            if len(_RESOURCES) < 64:
                _RESOURCES[res] = rb
        parts = [rb]
        for scope, encoded in scopes.items():
            if scope is not None and getattr(scope, "attributes", None):
                return None
            sc = b"\x0a\x00"  # no scope: an empty one, as the SDK's encoder writes it
            if scope is not None:
                sc = field(b"\x0a", (field(b"\x0a", scope.name.encode()) if scope.name else b"")
                           + (field(b"\x12", scope.version.encode()) if scope.version else b""))
                if scope.schema_url:
                    sc += field(b"\x1a", scope.schema_url.encode())
            parts.append(field(b"\x12", sc + b"".join(field(b"\x12", x) for x in encoded)))
        if res.schema_url:
            parts.append(field(b"\x1a", res.schema_url.encode()))
        out.append(request_entry(b"".join(parts)))
    return b"".join(out)


def request_entry(rs: bytes) -> bytes:
    """``ExportTraceServiceRequest.resource_spans`` entry: append to any serialized request."""
    return field(b"\x0a", rs)


def _env(env: Mapping[str, str], name: str) -> str | None:
    return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}")


def parse_headers(spec: str | None) -> dict[str, str]:
    """``k1=v1,k2=v2`` (URL-encoded), as the OTLP exporter specification defines it."""
    out = {}
    for item in (spec or "").split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            if k.strip():
                out[unquote(k.strip()).lower()] = unquote(v.strip())
    return out


class OtlpHttpPoster:
    """POST serialized OTLP requests to ``endpoint`` (http or https) on one kept-alive connection.

    ``export(body) -> bool``: True on 2xx. Never raises; a failed connection is reopened on the
    next call (the processor backs off until its next interval). ``unsent`` after a False: no
    connection could be made, so the body may be sent again (the processor keeps it)."""

    def __init__(self, endpoint: str, timeout: float = 2.0, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        u = urlsplit(endpoint)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"OTLP endpoint must be http(s)://host[:port]/path, got {endpoint!r}")
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname, u.port or (443 if self.https else 80)
        self.path = (u.path or "/v1/traces") + (f"?{u.query}" if u.query else "")
        self.timeout = timeout
        self.gzip = (_env(env, "COMPRESSION") or "").strip().lower() == "gzip"
        self.headers = {"Content-Type": "application/x-protobuf", **parse_headers(_env(env, "HEADERS"))}
        if self.gzip:
            self.headers["Content-Encoding"] = "gzip"
        self._ssl = None
        if self.https:
            self._ssl = ssl.create_default_context(cafile=_env(env, "CERTIFICATE") or None)
        self._conn: http.client.HTTPConnection | None = None
        self.last_status = 0  # of the last export; 0 when no answer came (refused, reset, timed out)
        self.retry_after: str | None = None  # the last answer's Retry-After header
        #: the last export never reached the collector (no connection could be made: it is down or
        #: restarting): nothing of it can have been stored, so it may be sent again
        self.unsent = False

    def reachable(self, timeout_s: float = 0.25) -> bool:
        """Whether the collector takes a TCP connection now (nothing is sent): at a serving
        process's exit, whether waiting for its export sidecar to post can do any good."""
        try:
            socket.create_connection((self.host, self.port), timeout=timeout_s).close()
        except OSError:
            return False
        return True

    def _connect(self) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._ssl)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def export(self, body: bytes) -> bool:
        if self.gzip:
            body = gzip.compress(body, compresslevel=1)
        self.last_status, self.retry_after, self.unsent = 0, None, False
        for _ in (0, 1):
            reused = self._conn is not None
            conn = self._conn or self._connect()
            self._conn = None
            if not reused:
                try:
                    conn.connect()
                except OSError:  # refused, unreachable, timed out connecting: nothing was sent
                    conn.close()
                    self.unsent = True
                    return False
            try:
                conn.request("POST", self.path, body, self.headers)
                resp = conn.getresponse()
                resp.read()
                self.last_status, self.retry_after = resp.status, resp.getheader("Retry-After")
                if not resp.will_close:
                    self._conn = conn
                else:
                    conn.close()
                return 200 <= resp.status < 300
            except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
                # (RemoteDisconnected is a ConnectionResetError) a kept-alive connection the
                # server had closed: it never read this request, so one fresh try is safe
                conn.close()
                if not reused:
                    return False
            except (OSError, http.client.HTTPException):
                # a timeout or anything else: the server may have stored the spans; sending them
                # again would store them twice, so they count as failed (at most lost, never doubled)
                conn.close()
                return False
        return False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
