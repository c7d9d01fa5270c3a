"""The OTLP/HTTP receiver: ``POST /v1/traces``, ``GET /healthz``, ``GET /metrics``.

Statuses follow the OTLP/HTTP specification: 200 (with partial success when spans were
rejected), 400 malformed, 401 bad token, 413 too large, 415 wrong content type or
encoding, 431 past 100 headers or a 64 KiB header line, 429/503 with ``Retry-After`` when the
queue is full or the store is down.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
from google.rpc import status_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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
    #: open connections at most; more are answered 503 and closed at once
    max_connections: int = 256


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


class _Headers(dict):
    """A request's headers by lower-case name (the first of repeated ones, as ``email``'s
    ``Message.get``); what the handler reads of them, without the ``email`` parser
    ``http.server`` builds them with (~100 µs a request, most of its per-request cost)."""

    def get(self, name: str, default=None):  # noqa: D102
        return dict.get(self, name.lower(), default)


def _read_headers(rfile) -> _Headers | str:
    """The header block up to its empty line, or why it is refused (431)."""
    headers = _Headers()
    last = None
    for _ in range(_MAX_HEADERS + 1):
        line = rfile.readline(_MAX_LINE + 1)
        if len(line) > _MAX_LINE:
            return "Line too long"
        if line in (b"\r\n", b"\n", b""):
            return headers
        text = line.decode("iso-8859-1").rstrip("\r\n")
        if text[:1] in (" ", "\t") and last is not None:  # an obsolete folded continuation
            headers[last] = f"{headers[last]} {text.strip()}"
            continue
        name, sep, value = text.partition(":")
        if not sep:
            continue  # not a header line: ignored, as the email parser keeps it out of the fields
        last = name.strip().lower()
        headers.setdefault(last, value.strip())
    return "Too many headers"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CollectorHTTPServer

    def parse_request(self) -> bool:
        """``BaseHTTPRequestHandler.parse_request`` with the lean header reader: the same
        request-line checks, ``Connection`` and ``Expect: 100-continue`` handling."""
        self.command = None
        self.request_version = version = self.default_request_version
        self.close_connection = True
        requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        self.requestline = requestline
        words = requestline.split()
        if not words:
            return False
        if len(words) >= 3:
            version = words[-1]
            try:
                if not version.startswith("HTTP/"):
                    raise ValueError
                number = version.split("/", 1)[1].split(".")
                if len(number) != 2 or not all(c.isdigit() and len(c) <= 10 for c in number):
                    raise ValueError
                major_minor = int(number[0]), int(number[1])
            except (ValueError, IndexError):
                self.send_error(400, f"Bad request version ({version!r})")
                return False
            if major_minor >= (1, 1):
                self.close_connection = False
            if major_minor >= (2, 0):
                self.send_error(505, f"Invalid HTTP version ({version})")
                return False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            self.send_error(400, f"Bad request syntax ({requestline!r})")
            return False
        command, path = words[:2]
        if len(words) == 2:
            self.close_connection = True
            if command != "GET":
                self.send_error(400, f"Bad HTTP/0.9 request type ({command!r})")
                return False
        self.command, self.path = command, path
        if self.path.startswith("//"):
            self.path = "/" + self.path.lstrip("/")
        headers = _read_headers(self.rfile)
        if isinstance(headers, str):
            self.send_error(431, headers)
            return False
        self.headers = headers
        conntype = headers.get("Connection", "").lower()
        if conntype == "close":
            self.close_connection = True
        elif conntype == "keep-alive":
            self.close_connection = False
        if headers.get("Expect", "").lower() == "100-continue" and self.request_version >= "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def setup(self) -> None:
        self.timeout = self.server.config.read_timeout_s  # socket timeout for every read
        name_native_thread("ttftscope-conn")  # what connections cost, apart (top -H, /proc/*/task)
        super().setup()

    def log_message(self, fmt: str, *args) -> None:  # quiet: metrics tell the story
        log.debug("%s " + fmt, self.address_string(), *args)

    # ------------------------------------------------------------- responses
    def _send(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        if self.server.draining:
            self.close_connection = True  # shutting down: no further request on this one
        # the status line, headers and body in one write (send_response/send_header/end_headers
        # cost a formatted date, a log record and two writes a request)
        lines = [f"HTTP/1.1 {code} {self.responses.get(code, ('',))[0]}", f"Server: {self.version_string()}",
                 f"Date: {_http_date()}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
        if self.close_connection:
            lines.append("Connection: close")
        self.wfile.write("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n" + body)
        if log.isEnabledFor(logging.DEBUG):
            self.log_request(code)
        self.server.metrics.requests.labels(str(code)).inc()

    def _error(self, code: int, message: str, kind: str = "json", extra: dict | None = None) -> None:
        """An error body as a ``google.rpc.Status`` in the request's encoding."""
        if kind == "protobuf":
            body = status_pb2.Status(code=code, message=message).SerializeToString()
            ctype = "application/x-protobuf"
        else:
            body = orjson.dumps({"code": code, "message": message})
            ctype = "application/json"
        self._send(code, body, ctype, extra)

    # ---------------------------------------------------------------- routes
    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self.server.pipeline._update_gauges()
            self._send(200, generate_latest(self.server.metrics.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/health", "/"):
            p = self.server.pipeline
            body = {
                "status": "ok",
                "store_healthy": p.store_healthy,
                "store_error": p.last_error,
                "queue_spans": p.spool.pending_rows,
                "spool_bytes": p.spool.pending_bytes,
            }
            self._send(200, orjson.dumps(body), "application/json")
        elif path == "/v1/traces":
            self._error(405, "use POST for /v1/traces", extra={"Allow": "POST"})
        else:
            self._error(404, f"no route {path}")

    def do_POST(self) -> None:  # noqa: N802
        if not self.server.begin_request():
            self.close_connection = True
            self._error(503, "collector shutting down; retry on another or later", "json", {"Retry-After": "5"})
            return
        try:
            self._post()
        finally:
            self.server.end_request()

    def _post(self) -> None:
        cfg = self.server.config
        path = self.path.split("?", 1)[0]
        if path != "/v1/traces":
            self.close_connection = True
            self._error(404, f"no route {path}; OTLP traces go to /v1/traces")
            return
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        kind = "protobuf" if ctype in PROTOBUF_TYPES else "json" if ctype in JSON_TYPES else None
        if cfg.bearer_token:
            auth = self.headers.get("Authorization") or ""
            scheme, _, given = auth.strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), cfg.bearer_token.encode()):
                self.close_connection = True
                self._error(401, "missing or wrong bearer token", kind or "json", {"WWW-Authenticate": "Bearer"})
                return
        if kind is None:
            self.close_connection = True
            self._error(
                415,
                f"unsupported Content-Type {ctype or '(none)'!r}: use application/x-protobuf or application/json",
            )
            return
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding not in ("identity", "gzip", "deflate"):
            self.close_connection = True
            self._error(415, f"unsupported Content-Encoding {encoding!r}: use gzip, deflate or none", kind)
            return
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            self._error(411, "Content-Length required", kind)
            return
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            self._error(400, f"invalid Content-Length {length!r}", kind)
            return
        if n > cfg.max_body_bytes:
            self.close_connection = True  # the body is not read
            self._error(413, f"body of {n} bytes exceeds the limit of {cfg.max_body_bytes} bytes", kind)
            return
        budget = self.server.budget
        held = n
        if not budget.try_reserve(held):
            self.close_connection = True  # the body is not read
            self._busy(kind)
            return
        try:
            try:
                body = self.rfile.read(n)
            except TimeoutError:
                self.close_connection = True
                self._error(408, f"body not received within {cfg.read_timeout_s:g}s", kind)
                return
            if len(body) != n:
                self.close_connection = True
                self._error(400, f"body truncated: got {len(body)} of {n} bytes", kind)
                return
            if encoding != "identity":
                try:
                    body, extra = self._inflate(body, encoding, held)
                    held += extra
                except _TooLarge:
                    self._error(413, f"decompressed body exceeds the limit of {cfg.max_body_bytes} bytes", kind)
                    return
                except _OverBudget:
                    self._busy(kind)
                    return
                except zlib.error as e:
                    self._error(400, f"invalid {encoding} body: {e}", kind)
                    return
            # decoding costs a multiple of the decoded size: reserved before it starts
            cost = len(body) * DECODE_FACTOR[kind]
            if not budget.try_reserve(cost):
                self._busy(kind)
                return
            held += cost
            if not self.server.inflight.acquire(blocking=False):
                self._error(429, "too many requests in flight; retry later", kind, {"Retry-After": "1"})
                return
            try:
                self._export(body, kind)
            finally:
                self.server.inflight.release()
        finally:
            budget.release(held)

    def _busy(self, kind: str) -> None:
        self.server.metrics.requests_over_budget.inc()
        self._error(429, f"collector memory budget ({self.server.config.max_memory_bytes >> 20} MiB) in use "
                         "by other requests; retry later", kind, {"Retry-After": "1"})

    def _inflate(self, body: bytes, encoding: str, held: int) -> tuple[bytes, int]:
        """Decompress every member (RFC 1952 allows several; trailing garbage is an error),
        reserving the output's memory as it grows. Returns (body, bytes reserved)."""
        cfg = self.server.config
        budget = self.server.budget
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

    def _export(self, body: bytes, kind: str) -> None:
        m = self.server.metrics
        limits = self.server.config.limits
        table = None
        events_links = True
        try:
            if kind == "protobuf":  # stored as received (checked, clipped); decoded in bulk later
                body, report, events_links = accept_protobuf(body, limits)
            else:
                table, report = decode(body, kind, limits)
        except DecodeError as e:
            self._error(400, str(e), kind)
            return
        except Exception as e:  # noqa: BLE001 - never let one request kill the service
            log.exception("unexpected decode failure")
            self._error(400, f"cannot decode request: {type(e).__name__}: {e}", kind)
            return
        m.spans_received.inc(report.accepted + report.rejected)
        for reason, cnt in report.reasons.items():
            m.spans_rejected.labels(reason).inc(cnt)
        if report.accepted:
            try:
                if table is None:
                    self.server.pipeline.submit_otlp(body, report.accepted, events_links)
                else:
                    self.server.pipeline.submit(table)
            except Backpressure as e:
                self._error(e.status, str(e), kind, {"Retry-After": str(e.retry_after)})
                return
            except Exception as e:  # noqa: BLE001 - e.g. the spool's disk is full
                log.exception("cannot spool a batch")
                self._error(503, f"cannot persist the batch: {e}", kind, {"Retry-After": "5"})
                return
        ctype = "application/x-protobuf" if kind == "protobuf" else "application/json"
        self._send(200, encode_response(report, kind), ctype)


class CollectorHTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` of them, each cut off after
    ``read_timeout_s`` of silence. ``drain()`` stops it the way a shutdown must: no new
    connection, no new request acknowledged, the requests in flight finished."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, config: ServerConfig, pipeline: Pipeline) -> None:
        self.config = config
        self.pipeline = pipeline
        self.metrics = pipeline.metrics
        self.inflight = threading.BoundedSemaphore(config.max_inflight)
        self.budget = MemoryBudget(config.max_memory_bytes)
        self.draining = False
        self._state = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._busy = 0
        super().__init__((config.host, config.port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    # -- connections ----------------------------------------------------------------
    def process_request(self, request, client_address) -> None:
        with self._state:
            full = len(self._conns) >= self.config.max_connections or self.draining
            if not full:
                self._conns.add(request)
        if full:
            self.metrics.connections_refused.inc()
            try:
                request.settimeout(1.0)
                body = b'{"code":503,"message":"too many open connections; retry later"}'
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        import sys

        err = sys.exc_info()[1]
        if isinstance(err, OSError):  # a client that went away or timed out: nothing to report
            log.debug("connection from %s ended: %r", client_address, err)
            return
        log.exception("unexpected error serving %s", client_address)

    def shutdown_request(self, request) -> None:
        with self._state:
            self._conns.discard(request)
        super().shutdown_request(request)

    @property
    def open_connections(self) -> int:
        with self._state:
            return len(self._conns)

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
            self._state.notify_all()

    def drain(self, timeout: float = 30.0) -> bool:
        """Stop accepting, refuse new requests, wait for those in flight, close idle
        keep-alive connections. True when nothing was still in flight at the end."""
        with self._state:
            self.draining = True
        self.shutdown()  # the accept loop
        self.server_close()
        deadline = time.monotonic() + timeout
        with self._state:
            while self._busy and time.monotonic() < deadline:
                self._state.wait(max(deadline - time.monotonic(), 0.01))
            done = self._busy == 0
            conns = list(self._conns)
        for c in conns:  # idle keep-alive connections: their next read sees EOF
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return done
