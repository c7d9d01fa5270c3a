"""The OTLP/HTTP receiver: ``POST /v1/traces``, ``GET /healthz``, ``GET /metrics``.

Statuses follow the OTLP/HTTP specification: 200 (with partial success when spans were
rejected), 400 malformed, 401 bad token, 413 too large, 415 wrong content type or
encoding, 431 past 100 headers or a 64 KiB header line, 429/503 with ``Retry-After`` when the
queue is full or the store is down.

One event loop serves every connection (uvloop when it is installed, asyncio's otherwise).
Why not a thread per connection: a fleet of vLLM processes posts tens of spans each every
half second, and a thread woken per small request cost ~1-2 ms of CPU under that load (the
thread switches, a buffered socket file per connection, the GIL handed around), 5-8x the
spans' own cost. Here a request is parsed from the bytes received, checked and written to the
spool where it completes; **group commit**: one ``fdatasync`` covers every request completed
in the same turn of the loop, then their 200s go out. Only JSON bodies and protobuf bodies
over :data:`OFFLOAD_BYTES` are decoded on worker threads, so one big body does not hold the
others up.
"""

from __future__ import annotations

import asyncio
import hmac
import html
import logging
import re
import resource
import socket
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from email.utils import formatdate
from http.server import DEFAULT_ERROR_CONTENT_TYPE, DEFAULT_ERROR_MESSAGE, BaseHTTPRequestHandler

import orjson
from google.rpc import status_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import otlp_compiled
from .otel_setup import name_native_thread
from .otlp import DecodeError, Limits, accept_protobuf, decode, encode_response
from .pipeline import Backpressure, Pipeline

log = logging.getLogger("ttftscope.collector")

PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
JSON_TYPES = ("application/json",)
#: what handling a request costs per decoded byte, reserved before it starts: a protobuf body
#: is parsed once for the arrival check (upb's arena, plus a re-serialised copy when a span is
#: clipped) and spooled as received; a JSON body is decoded to columns in the request (Python
#: objects per span and attribute). tests/test_reliability.py measures the peak against both.
DECODE_FACTOR = {"protobuf": 4, "json": 16}
#: protobuf bodies up to this size are checked on the loop (a 500-span body: ~0.3 ms); larger
#: ones on a worker thread, as every JSON body is
OFFLOAD_BYTES = 1 << 20
RESPONSES = BaseHTTPRequestHandler.responses
SERVER_HEADER = "ttftscope-collector"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 4318
    max_body_bytes: int = 16 * 1024 * 1024  # after decompression too
    max_inflight: int = 32
    bearer_token: str | None = None
    limits: Limits = Limits()
    #: bytes all requests together may hold (bodies, decompressed bodies, decoding); past
    #: it a request gets 429 before it is read. One request alone is always admitted.
    max_memory_bytes: int = 1 << 30
    #: a client that sends nothing for this long (headers or body) is cut off (408 on a body)
    read_timeout_s: float = 15.0
    #: open connections at most; more are answered 503 and closed at once. A fleet holds one
    #: kept-alive connection an exporting process (a vLLM server has an API server, an engine
    #: core and a worker a GPU, each exporting), so the cap is high; an idle one costs ~2.3 KB of
    #: RSS (1,000 kept-alive connections, each answered once: measured). Lowered to what the
    #: open-file limit allows (:func:`fit_open_files`)
    max_connections: int = 4096
    #: group commit: a small request waits at most this long for others to share its spool
    #: sync and its checks (not at all when every open connection is waiting)
    commit_window_s: float = 0.05


#: descriptors kept for everything but connections: the spool's segments, the store's part
#: files (a query or a merge opens one per part), chDB's own (an idle collector holds 39 in all)
FD_RESERVE = 256


def fit_open_files(max_connections: int) -> tuple[int, str | None]:
    """Make room for ``max_connections`` connections: this process's soft open-file limit raised
    as far as needed, up to the hard limit (the usual soft limit, 1,024, holds 768); where the
    hard limit is lower, the cap lowered to fit, so that a connection past it is answered 503
    instead of an accept failing for want of a descriptor. (the cap, a warning or None)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections, None
    cap = max(soft - FD_RESERVE, soft // 4, 1)
    return cap, (f"--max-connections lowered to {cap}: the open-file limit is {soft} (hard {hard}) and "
                 f"{FD_RESERVE} descriptors are kept for the spool and the store; raise it (ulimit -n, "
                 f"systemd's LimitNOFILE=, docker's --ulimit nofile=) for {max_connections} connections")


_date = [0, ""]


def _http_date() -> str:
    """The ``Date`` header's value, formatted once a second."""
    now = int(time.time())
    if _date[0] != now:
        _date[:] = [now, formatdate(now, usegmt=True)]
    return _date[1]


class _TooLarge(Exception):
    pass


class _OverBudget(Exception):
    pass


class MemoryBudget:
    """Bytes reserved by requests in flight; a reservation past the budget is refused
    unless nothing else holds any (so one request larger than the budget still passes)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def try_reserve(self, n: int) -> bool:
        with self._lock:
            if self.used and self.used + n > self.limit:
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n


_MAX_LINE, _MAX_HEADERS = 65536, 100  # as http.client's
_MAX_BUFFERED = 1 << 20  # bytes read ahead of the request being handled before reading pauses
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: 63\r\n\r\n"
            b'{"code":503,"message":"too many open connections; retry later"}')


class _Headers(dict):
    """A request's headers by lower-case name (the first of repeated ones, as ``email``'s
    ``Message.get``)."""

    def get(self, name: str, default=None):  # noqa: D102
        return dict.get(self, name.lower(), default)


#: a header block of plain fields only: a token, ``:``, printable ASCII, CRLF, line after line
#: (what every OTLP exporter sends). Such a block is read where it lies (:class:`_PlainHeaders`);
#: anything else (folded lines, a space before the colon, tabs, bare LFs, other bytes) line by
#: line (:func:`_headers`). Both give the same value for every name of a plain block.
_PLAIN_BLOCK = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[ -~]*\r\n)*")


class _PlainHeaders:
    """A plain header block's fields, looked up when asked for (a request asks for a few)."""

    __slots__ = ("raw", "low")

    def __init__(self, block: bytes) -> None:
        self.raw = b"\r\n" + block
        self.low = self.raw.lower()

    def get(self, name: str, default=None):  # noqa: D102 - as _Headers.get
        key = b"\r\n" + name.lower().encode("latin-1") + b":"
        at = self.low.find(key)
        if at < 0:
            return default
        at += len(key)
        return self.raw[at:self.raw.find(b"\r\n", at)].strip(b" ").decode("ascii")


def _plain_headers(block: bytes) -> _PlainHeaders | None:
    """The fields of a plain block (every line ending in CRLF, the blank line excluded), or
    None when it is not plain or has more than ``_MAX_HEADERS`` fields."""
    if _PLAIN_BLOCK.fullmatch(block) is None or block.count(b"\n") > _MAX_HEADERS:
        return None
    return _PlainHeaders(block)


#: request lines parsed (the same few come again and again): the line -> (command, path,
#: version, close), for lines that parse to a request
_LINES: dict[bytes, tuple[str, str, str, bool]] = {}


def _headers(lines: list[bytes]) -> _Headers:
    headers = _Headers()
    last = None
    for line in lines:
        text = line.decode("iso-8859-1").rstrip("\r\n")
        if text[:1] in (" ", "\t") and last is not None:  # an obsolete folded continuation
            headers[last] = f"{headers[last]} {text.strip()}"
            continue
        name, sep, value = text.partition(":")
        if not sep:
            continue  # not a header line: ignored, as the email parser keeps it out of the fields
        last = name.strip().lower()
        headers.setdefault(last, value.strip())
    return headers


@dataclass
class _Request:
    command: str
    path: str
    version: str
    close: bool
    headers: _Headers | _PlainHeaders | None = None
    kind: str = "json"  # how errors are encoded
    length: int = 0
    encoding: str = "identity"
    held: int = 0  # bytes reserved in the memory budget
    counted: bool = False  # begin_request() said yes: end_request() is owed
    body: bytearray | None = None  # the body, filled in place as it arrives (its one copy)
    got: int = 0  # bytes of it received


def _request_line(raw: bytes) -> _Request | tuple[int, str, str] | None:
    """A request line as ``BaseHTTPRequestHandler.parse_request`` reads it: the request, or
    (code, message, version the error is answered in), or None to close without a word."""
    line = str(raw, "iso-8859-1").rstrip("\r\n")
    words = line.split()
    if not words:
        return None
    version, close = "HTTP/0.9", True
    if len(words) >= 3:
        v = words[-1]
        try:
            if not v.startswith("HTTP/"):
                raise ValueError
            number = v.split("/", 1)[1].split(".")
            if len(number) != 2 or not all(c.isdigit() and len(c) <= 10 for c in number):
                raise ValueError
            major_minor = int(number[0]), int(number[1])
        except (ValueError, IndexError):
            return 400, f"Bad request version ({v!r})", version
        if major_minor >= (1, 1):
            close = False
        if major_minor >= (2, 0):
            return 505, f"Invalid HTTP version ({v})", version
        version = v
    if not 2 <= len(words) <= 3:
        return 400, f"Bad request syntax ({line!r})", version
    command, path = words[:2]
    if len(words) == 2:
        close = True
        if command != "GET":
            return 400, f"Bad HTTP/0.9 request type ({command!r})", version
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    return _Request(command, path, version, close)


def _set_headers(req: _Request, h: _Headers | _PlainHeaders) -> None:
    """Give ``req`` its headers; ``Connection`` overrides the version's keep-alive default."""
    req.headers = h
    conntype = h.get("Connection", "").lower()
    if conntype == "close":
        req.close = True
    elif conntype == "keep-alive":
        req.close = False


class _Conn(asyncio.Protocol):
    """One client connection: bytes in, one request at a time, responses in order."""

    def __init__(self, server: CollectorHTTPServer) -> None:
        self.s = server
        self.t: asyncio.Transport | None = None
        self.buf = bytearray()
        self.req: _Request | None = None  # the request whose head was read
        self.line_end = 0  # the request line's end in buf (0: not read yet)
        self.continued = False  # 100 Continue sent for this request
        self.busy = False  # a request is being handled: the next is not parsed until it is answered
        self.paused = False  # reading paused: too much arrived while busy
        self.parsing = False  # inside _advance: an answer given there does not re-enter it
        self.eof = False  # the client sent everything it will send
        self.closed = False
        self.last = time.monotonic()

    # -- transport events -------------------------------------------------------
    def connection_made(self, transport) -> None:
        s = self.s
        if len(s.conns) >= s.config.max_connections or s.draining:
            s.metrics.connections_refused.inc()
            self.closed = True
            transport.write(_REFUSED)
            transport.close()
            return
        self.t = transport
        s.conns.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.s.conns.discard(self)
        self._end_request()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last = time.monotonic()
        req = self.req
        if req is not None and req.body is not None and req.got < req.length:  # into the body
            take = min(len(data), req.length - req.got)
            with memoryview(data) as view:
                req.body[req.got:req.got + take] = view[:take]
            req.got += take
            if take == len(data):
                if req.got == req.length and not self.busy:
                    self._advance()
                return
            data = data[take:]  # the next request's first bytes (pipelined)
        self.buf += data
        if not self.busy:
            self._advance()
        elif len(self.buf) > _MAX_BUFFERED and not self.paused:  # pipelined past what we hold
            self.paused = True
            self.t.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        if not self.busy:
            self.close()
        return True  # keep the write side open until a request in flight is answered

    def timed_out(self, now: float) -> bool:
        return not self.busy and not self.closed and now - self.last > self.s.config.read_timeout_s

    def on_timeout(self) -> None:
        req = self.req
        if req is not None and req.counted:  # in the body: the client is told
            req.close = True
            self._error(408, f"body not received within {self.s.config.read_timeout_s:g}s", req.kind)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.s.conns.discard(self)
            self._end_request()
            if self.t is not None:
                self.t.close()

    # -- parsing ----------------------------------------------------------------
    def _advance(self) -> None:
        """Read requests from the buffer until one needs more bytes or is being handled."""
        self.parsing = True
        try:
            while not self.busy and not self.closed:
                if (self.req is None or self.req.headers is None) and (not self.buf or not self._head()):
                    break  # the head is not all in yet
                req = self.req
                if req is None:
                    break
                if req.command != "POST":
                    self._get(req)
                    continue
                if not req.counted:
                    self._post_head(req)
                    continue
                if req.body is None:  # what came with the head goes into the body's buffer
                    req.body = bytearray(req.length)
                    take = min(len(self.buf), req.length)
                    with memoryview(self.buf) as view:
                        req.body[:take] = view[:take]
                    del self.buf[:take]
                    req.got = take
                if req.got < req.length:
                    break
                body, req.body = req.body, None
                self._body(req, body)
        finally:
            self.parsing = False
        if self.eof and not self.busy:
            self.close()

    def _head(self) -> bool:
        """Parse the request line and headers when they are all in; False: wait or closed."""
        buf = self.buf
        if not self.line_end and self._plain_head():
            return True
        if not self.line_end:
            nl = buf.find(b"\n", 0, _MAX_LINE)
            if nl < 0:
                if len(buf) >= _MAX_LINE:
                    self._send_error(414, None, "")
                return False
            self.line_end = nl + 1
            line = bytes(buf[:nl + 1])
            got = _request_line(line)
            if got is None:
                self.close()
                return False
            if isinstance(got, tuple):
                code, message, version = got
                self._send_error(code, message, version)
                return False
            if len(_LINES) < 256 and len(line) <= 512:  # (for _plain_head: only lines that parsed)
                _LINES[line] = (got.command, got.path, got.version, got.close)
            self.req = got
            self.req.headers = None
        req = self.req
        pos, lines = self.line_end, []
        while True:
            nl = buf.find(b"\n", pos, pos + _MAX_LINE)
            if nl < 0:
                if len(buf) - pos >= _MAX_LINE:
                    self._send_error(431, "Line too long", req.version)
                return False
            line = bytes(buf[pos:nl + 1])
            pos = nl + 1
            if line in (b"\r\n", b"\n"):
                break
            if len(lines) == _MAX_HEADERS:
                self._send_error(431, "Too many headers", req.version)
                return False
            lines.append(line)
        del buf[:pos]
        self.line_end = 0
        _set_headers(req, _headers(lines))
        return True

    def _plain_head(self) -> bool:
        """The common head in a few calls: all of it in the buffer, shorter than one line may
        be, a request line seen before, plain header fields (:func:`_plain_headers`). False:
        read it line by line (:meth:`_head`), which handles every other case and every error."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n", 0, _MAX_LINE)
        if end < 0:
            return False
        nl = buf.find(b"\n", 0, end + 2)
        parsed = _LINES.get(bytes(buf[:nl + 1]))
        if parsed is None:
            return False
        h = _plain_headers(bytes(buf[nl + 1:end + 2]))
        if h is None:
            return False
        del buf[:end + 4]
        self.req = _Request(*parsed)
        _set_headers(self.req, h)
        return True

    # -- routes -----------------------------------------------------------------
    def _get(self, req: _Request) -> None:
        self.req = None
        if req.command != "GET":
            self._send_error(501, f"Unsupported method ({req.command!r})", req.version)
            return
        path = req.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(req, 200, generate_latest(self.s.metrics.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/health", "/"):
            p = self.s.pipeline
            body = {
                "status": "ok",
                "store_healthy": p.store_healthy,
                "store_error": p.last_error,
                "queue_spans": p.spool.pending_rows,
                "spool_bytes": p.spool.pending_bytes,
                # the arrival check and the flush decode compiled (numba): until then, Python and chDB
                "compiled": otlp_compiled.ready(),
                # one kept-alive connection an exporting process; the cap as the open-file limit allowed it
                "connections": len(self.s.conns),
                "max_connections": self.s.config.max_connections,
                "max_connections_asked": self.s.max_connections_asked,
            }
            self._send(req, 200, orjson.dumps(body), "application/json")
        elif path == "/v1/traces":
            self._error(405, "use POST for /v1/traces", extra={"Allow": "POST"}, req=req)
        else:
            self._error(404, f"no route {path}", req=req)

    def _post_head(self, req: _Request) -> None:
        """Everything about a POST that is known before its body: refuse early, or wait."""
        s, cfg = self.s, self.s.config
        h = req.headers
        if not s.begin_request():
            req.close = True
            self._error(503, "collector shutting down; retry on another or later", "json", {"Retry-After": "5"})
            return
        req.counted = True
        path = req.path.split("?", 1)[0]
        if path != "/v1/traces":
            req.close = True
            self._error(404, f"no route {path}; OTLP traces go to /v1/traces")
            return
        ctype = (h.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        kind = "protobuf" if ctype in PROTOBUF_TYPES else "json" if ctype in JSON_TYPES else None
        req.kind = kind or "json"
        if cfg.bearer_token:
            auth = h.get("Authorization") or ""
            scheme, _, given = auth.strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), cfg.bearer_token.encode()):
                req.close = True
                self._error(401, "missing or wrong bearer token", req.kind, {"WWW-Authenticate": "Bearer"})
                return
        if kind is None:
            req.close = True
            self._error(415, f"unsupported Content-Type {ctype or '(none)'!r}: use application/x-protobuf or application/json")
            return
        req.encoding = (h.get("Content-Encoding") or "identity").strip().lower()
        if req.encoding not in ("identity", "gzip", "deflate"):
            req.close = True
            self._error(415, f"unsupported Content-Encoding {req.encoding!r}: use gzip, deflate or none", kind)
            return
        length = h.get("Content-Length")
        if length is None:
            req.close = True
            self._error(411, "Content-Length required", kind)
            return
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            req.close = True
            self._error(400, f"invalid Content-Length {length!r}", kind)
            return
        if n > cfg.max_body_bytes:
            req.close = True  # the body is not read
            self._error(413, f"body of {n} bytes exceeds the limit of {cfg.max_body_bytes} bytes", kind)
            return
        if not s.budget.try_reserve(n):
            req.close = True  # the body is not read
            self._busy(kind)
            return
        req.held, req.length = n, n
        if (h.get("Expect", "").lower() == "100-continue" and req.version >= "HTTP/1.1" and not self.continued
                and len(self.buf) < n):
            self.continued = True
            self.t.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _body(self, req: _Request, body: bytearray) -> None:
        s, cfg = self.s, self.s.config
        self.busy = True
        kind = req.kind
        if req.encoding != "identity":
            try:
                body, extra = self._inflate(body, req.encoding, req)
                req.held += extra
            except _TooLarge:
                self._error(413, f"decompressed body exceeds the limit of {cfg.max_body_bytes} bytes", kind)
                return
            except _OverBudget:
                self._busy(kind)
                return
            except zlib.error as e:
                self._error(400, f"invalid {req.encoding} body: {e}", kind)
                return
        # decoding costs a multiple of the decoded size: reserved before it starts
        cost = len(body) * DECODE_FACTOR[kind]
        if not s.budget.try_reserve(cost):
            self._busy(kind)
            return
        req.held += cost
        if s.inflight >= cfg.max_inflight:
            self._error(429, "too many requests in flight; retry later", kind, {"Retry-After": "1"})
            return
        if kind == "protobuf" and len(body) <= OFFLOAD_BYTES:
            s.defer(self, req, body)
            return
        s.inflight += 1
        fut = s.loop.run_in_executor(s.workers, _check, body, kind, cfg.limits)

        def done(f: asyncio.Future) -> None:
            s.inflight -= 1
            if not self.closed:
                self._decoded(req, *f.result())
            else:
                self._end_request()

        fut.add_done_callback(done)

    def _decoded(self, req: _Request, outcome: str, a, b, c) -> None:
        """After the check (or decode): spool what was accepted, answer once it is durable."""
        m, kind = self.s.metrics, req.kind
        if outcome == "bad":
            self._error(400, a, kind)
            return
        if outcome == "crash":
            log.error("unexpected decode failure: %s", a)
            self._error(400, f"cannot decode request: {a}", kind)
            return
        body_or_table, report, events_links = a, b, c
        m.spans_received.inc(report.accepted + report.rejected)
        for reason, cnt in report.reasons.items():
            m.spans_rejected.labels(reason).inc(cnt)
        mark = None
        if report.accepted:
            try:
                if kind == "protobuf":
                    mark = self.s.pipeline.submit_otlp(body_or_table, report.accepted, events_links, durable=False)
                else:
                    mark = self.s.pipeline.submit(body_or_table, durable=False)
            except Backpressure as e:
                self._error(e.status, str(e), kind, {"Retry-After": str(e.retry_after)})
                return
            except Exception as e:  # noqa: BLE001 - e.g. the spool's disk is full
                log.exception("cannot spool a batch")
                self._error(503, f"cannot persist the batch: {e}", kind, {"Retry-After": "5"})
                return
        ctype = "application/x-protobuf" if kind == "protobuf" else "application/json"
        self.s.commit(self, mark, report.accepted, encode_response(report, kind), ctype)

    def _busy(self, kind: str) -> None:
        self.s.metrics.requests_over_budget.inc()
        self._error(429, f"collector memory budget ({self.s.config.max_memory_bytes >> 20} MiB) in use "
                         "by other requests; retry later", kind, {"Retry-After": "1"})

    def _inflate(self, body: bytes, encoding: str, req: _Request) -> tuple[bytes, int]:
        """Decompress every member (RFC 1952 allows several; trailing garbage is an error),
        reserving the output's memory as it grows. Returns (body, bytes reserved)."""
        cfg, budget = self.s.config, self.s.budget
        chunk = 1 << 20
        out: list[bytes] = []
        size = reserved = 0
        data = body
        try:
            while True:
                # gzip, or deflate (zlib-wrapped, as HTTP defines it); 47 = auto-detect both
                d = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else 47)
                while True:
                    piece = d.decompress(data, chunk)
                    data = d.unconsumed_tail
                    size += len(piece)
                    if size > cfg.max_body_bytes:
                        raise _TooLarge
                    if piece:
                        if not budget.try_reserve(len(piece)):
                            raise _OverBudget(reserved)
                        reserved += len(piece)
                        out.append(piece)
                    if d.eof or (not data and not piece):
                        break
                if not d.eof:
                    raise zlib.error("incomplete compressed stream")
                data = d.unused_data
                if not data or encoding != "gzip":
                    if data:
                        raise zlib.error(f"{len(data)} bytes of trailing data after the compressed stream")
                    break
        except BaseException:
            budget.release(reserved)
            raise
        return b"".join(out), reserved

    # -- responses --------------------------------------------------------------
    def _end_request(self) -> None:
        req = self.req
        if req is None:
            return
        if req.held:
            self.s.budget.release(req.held)
            req.held = 0
        if req.counted:
            req.counted = False
            self.s.end_request()

    def _send(self, req: _Request, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        """The status line, headers and body in one write; then the next request, if any."""
        s = self.s
        if s.draining:
            req.close = True  # shutting down: no further request on this one
        key = (code, ctype, len(body), req.close)
        date = _http_date()
        if s.heads_date != date:  # the Date header moved on: every cached head with it
            s.heads.clear()
            s.heads_date = date
        head = None if extra else s.heads.get(key)
        if head is None:
            lines = [f"HTTP/1.1 {code} {RESPONSES.get(code, ('',))[0]}", f"Server: {SERVER_HEADER}",
                     f"Date: {date}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
            lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
            if req.close:
                lines.append("Connection: close")
            head = "\r\n".join(lines).encode("latin-1") + b"\r\n\r\n"
            if not extra and len(s.heads) < 64:
                s.heads[key] = head
        counter = s.requests_by_code.get(code)
        if counter is None:
            counter = s.requests_by_code[code] = s.metrics.requests.labels(str(code))
        counter.inc()
        if self.closed:
            self._end_request()
            return
        self.t.write(head + body)
        if log.isEnabledFor(logging.DEBUG):
            log.debug('"%s %s %s" %d', req.command, req.path, req.version, code)
        self._end_request()
        self.req = None
        self.continued = False
        self.last = time.monotonic()
        if req.close:
            self.close()
            return
        self.busy = False
        if self.paused:
            self.paused = False
            self.t.resume_reading()
        if not self.parsing:  # answered from a callback: read what waited meanwhile
            self._advance()

    def _error(self, code: int, message: str, kind: str = "json", extra: dict | None = None,
               req: _Request | None = None) -> None:
        """An error body as a ``google.rpc.Status`` in the request's encoding (``req``: the
        request answered, when it is no longer the one being read)."""
        if kind == "protobuf":
            body, ctype = status_pb2.Status(code=code, message=message).SerializeToString(), "application/x-protobuf"
        else:
            body, ctype = orjson.dumps({"code": code, "message": message}), "application/json"
        self._send(req or self.req, code, body, ctype, extra)

    def _send_error(self, code: int, message: str | None, version: str) -> None:
        """``BaseHTTPRequestHandler.send_error``: an HTML page, then the connection closes
        (no status line or headers for a request read as HTTP/0.9)."""
        short, explain = RESPONSES.get(code, ("???", "???"))
        message = short if message is None else message
        body = (DEFAULT_ERROR_MESSAGE % {"code": code, "message": html.escape(message, quote=False),
                                         "explain": html.escape(explain, quote=False)}).encode("UTF-8", "replace")
        head = b""
        if version != "HTTP/0.9":
            head = (f"HTTP/1.1 {code} {message}\r\nServer: {SERVER_HEADER}\r\nDate: {_http_date()}\r\n"
                    f"Connection: close\r\nContent-Type: {DEFAULT_ERROR_CONTENT_TYPE}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1", "replace")
        if self.t is not None and not self.closed:
            self.t.write(head + body)
        self.close()


def _check(body: bytes, kind: str, limits: Limits):
    """The arrival check of a protobuf body (it is spooled as received) or the decode of a
    JSON one: ("ok", body or table, report, events_links), ("bad", message, ...), or
    ("crash", ...) for what must never take the service down."""
    try:
        if kind == "protobuf":
            body, report, events_links = accept_protobuf(body, limits)
            return "ok", body, report, events_links
        table, report = decode(body, kind, limits)
        return "ok", table, report, True
    except DecodeError as e:
        return "bad", str(e), None, None
    except Exception as e:  # noqa: BLE001 - never let one request kill the service
        log.exception("unexpected decode failure")
        return "crash", f"{type(e).__name__}: {e}", None, None


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio's loop also works
        return asyncio.new_event_loop()


class CollectorHTTPServer:
    """Every connection on one event loop (``serve_forever`` runs it), at most
    ``max_connections`` of them, each cut off after ``read_timeout_s`` of silence. ``drain()``
    stops it the way a shutdown must: no new connection, no new request acknowledged, the
    requests in flight finished."""

    def __init__(self, config: ServerConfig, pipeline: Pipeline) -> None:
        self.max_connections_asked = config.max_connections
        cap, warning = fit_open_files(config.max_connections)
        if warning:
            log.warning("%s", warning)
            config = replace(config, max_connections=cap)
        self.config = config
        self.pipeline = pipeline
        self.metrics = pipeline.metrics
        self.budget = MemoryBudget(config.max_memory_bytes)
        self.inflight = 0  # bodies on the worker threads
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ttftscope-decode")
        self.draining = False
        self.conns: set[_Conn] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._state = threading.Condition()
        self._busy = 0
        self._stopped = threading.Event()
        self._batch: list[tuple[_Conn, _Request, bytes]] = []  # checked at the next commit
        self._pending: list[tuple[_Conn, int, bytes, str]] = []  # answered once the spool is synced
        self._mark = None
        self._commit_timer: asyncio.TimerHandle | None = None
        self._commit_now = False
        self._sock = socket.create_server((config.host, config.port), backlog=1024)  # a fleet reconnecting at once after a restart
        self.server_address = self._sock.getsockname()
        self._aserver = None
        # a response head depends on (code, type, length, close) and the second it is sent
        # in: a fleet's 200s are built once a second, not per request
        self.heads: dict[tuple, bytes] = {}
        self.heads_date = ""
        self.requests_by_code: dict[int, object] = {}  # the requests counter's children

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def open_connections(self) -> int:
        return len(self.conns)

    def serve_forever(self) -> None:
        name_native_thread("ttftscope-http")
        self.loop = loop = _new_loop()
        asyncio.set_event_loop(loop)
        try:
            try:
                self._aserver = loop.run_until_complete(loop.create_server(lambda: _Conn(self), sock=self._sock))
            except RuntimeError:  # "Event loop stopped before Future completed": a drain's stop
                if self.draining:
                    self._sock.close()
                    return
                raise
            if self.draining:  # a drain came while the listener was being set up (a SIGTERM right
                # after start): it found nothing to close (a later one closes it: _stop_listening)
                self._aserver.close()
                try:
                    loop.run_until_complete(asyncio.wait_for(self._aserver.wait_closed(), 1.0))
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
                return
            loop.call_later(self._sweep_every(), self._sweep)
            loop.run_forever()
            for c in list(self.conns):
                c.close()
            loop.run_until_complete(asyncio.sleep(0.05))  # let the closes go out
        finally:
            loop.close()
            self.workers.shutdown(wait=False)
            self._stopped.set()

    def _sweep_every(self) -> float:
        return min(max(self.config.read_timeout_s / 4, 0.05), 1.0)

    def _sweep(self) -> None:
        """Cut off the connections silent for ``read_timeout_s`` (one timer for all of them)."""
        now = time.monotonic()
        for c in [c for c in self.conns if c.timed_out(now)]:
            c.on_timeout()
        self.loop.call_later(self._sweep_every(), self._sweep)

    # -- group commit -------------------------------------------------------------
    def defer(self, conn: _Conn, req: _Request, body: bytes) -> None:
        """Check a small protobuf body with the others of this commit (see :meth:`_commit`)."""
        self._batch.append((conn, req, body))
        self._due()

    def commit(self, conn: _Conn, mark, rows: int, body: bytes, ctype: str) -> None:
        """Answer ``conn`` once the spool holds its batch of ``rows`` spans (``mark``; None:
        nothing to hold, answered now)."""
        if mark is None:
            conn._send(conn.req, 200, body, ctype)
            return
        self._pending.append((conn, rows, body, ctype))
        self._mark = mark if self._mark is None else max(self._mark, mark)
        self._due()

    def _due(self) -> None:
        """When the next commit runs: at once when every open connection is waiting for one
        (no other request can come before it: bulk senders), else ``commit_window_s`` after
        the first request waiting (a fleet's small requests, spaced out, share one sync)."""
        waiting = len(self._batch) + len(self._pending)
        if waiting >= len(self.conns):
            if self._commit_timer is not None:
                self._commit_timer.cancel()
                self._commit_timer = None
            if not self._commit_now:
                self._commit_now = True
                self.loop.call_soon(self._commit)
        elif self._commit_timer is None and not self._commit_now:
            self._commit_timer = self.loop.call_later(self.config.commit_window_s, self._commit)

    def _commit(self) -> None:
        """Check the bodies deferred, write them to the spool, one sync for every request
        waiting, then their answers."""
        if self._commit_timer is not None:
            self._commit_timer.cancel()
        self._commit_timer, self._commit_now = None, False
        batch, self._batch = self._batch, []
        limits = self.config.limits
        for conn, req, body in batch:
            if conn.closed:
                conn._end_request()
            else:
                conn._decoded(req, *_check(body, "protobuf", limits))
        pending, mark = self._pending, self._mark
        self._pending, self._mark = [], None
        if not pending:
            return
        try:
            self.pipeline.sync(mark, sum(p[1] for p in pending))
            error = None
        except Exception as e:  # noqa: BLE001 - the disk failed: nothing here is acknowledged
            log.exception("cannot sync the spool")
            error = f"cannot persist the batch: {e}"
        self.metrics.group_commit_requests.observe(len(pending))
        for conn, _, body, ctype in pending:
            if conn.req is None:
                continue
            if error is None:
                conn._send(conn.req, 200, body, ctype)
            else:
                conn._error(503, error, conn.req.kind, {"Retry-After": "5"})

    # -- requests -------------------------------------------------------------------
    def begin_request(self) -> bool:
        with self._state:
            if self.draining:
                return False
            self._busy += 1
            return True

    def end_request(self) -> None:
        with self._state:
            self._busy -= 1
            if self.draining:  # only a drain waits for it
                self._state.notify_all()

    def _stop_listening(self) -> None:
        if self._aserver is not None:  # (None: still being set up; serve_forever closes it)
            self._aserver.close()

    def drain(self, timeout: float = 30.0) -> bool:
        """Stop accepting, refuse new requests, wait for those in flight, close idle
        keep-alive connections. True when nothing was still in flight at the end."""
        with self._state:
            self.draining = True
        loop = self.loop
        running = loop is not None and not self._stopped.is_set()
        if running:
            loop.call_soon_threadsafe(self._stop_listening)  # no new connection
        else:
            self._sock.close()
        deadline = time.monotonic() + timeout
        with self._state:
            while self._busy and time.monotonic() < deadline:
                self._state.wait(max(deadline - time.monotonic(), 0.01))
            done = self._busy == 0
        if running:
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:  # closed meanwhile
                pass
            self._stopped.wait(5.0)
        return done
