"""The OTLP/HTTP receiver: ``POST /v1/traces``, ``GET /healthz``, ``GET /metrics``.

Statuses follow the OTLP/HTTP specification: 200 (with partial success when spans were
rejected), 400 malformed, 401 bad token, 413 too large, 415 wrong content type or
encoding, 429/503 with ``Retry-After`` when the queue is full or the store is down.
"""

from __future__ import annotations

import hmac
import logging
import threading
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
from google.rpc import status_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .otlp import DecodeError, Limits, decode, encode_response
from .pipeline import Backpressure, Pipeline

log = logging.getLogger("ttftscope.collector")

PROTOBUF_TYPES = ("application/x-protobuf", "application/protobuf")
JSON_TYPES = ("application/json",)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 4318
    max_body_bytes: int = 16 * 1024 * 1024  # after decompression too
    max_inflight: int = 32
    bearer_token: str | None = None
    limits: Limits = Limits()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: CollectorHTTPServer

    def log_message(self, fmt: str, *args) -> None:  # quiet: metrics tell the story
        log.debug("%s " + fmt, self.address_string(), *args)

    # ------------------------------------------------------------- responses
    def _send(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
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
            if not hmac.compare_digest(auth.encode(), f"Bearer {cfg.bearer_token}".encode()):
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
        body = self.rfile.read(n)
        if len(body) != n:
            self.close_connection = True
            self._error(400, f"body truncated: got {len(body)} of {n} bytes", kind)
            return
        if encoding != "identity":
            try:  # gzip, or deflate (zlib-wrapped, as HTTP defines it); 47 = auto-detect both
                d = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else 47)
                out = d.decompress(body, cfg.max_body_bytes + 1)
                if len(out) > cfg.max_body_bytes or d.unconsumed_tail:
                    self._error(413, f"decompressed body exceeds the limit of {cfg.max_body_bytes} bytes", kind)
                    return
                if not d.eof:
                    raise zlib.error("incomplete compressed stream")
                body = out
            except zlib.error as e:
                self._error(400, f"invalid {encoding} body: {e}", kind)
                return
        if not self.server.inflight.acquire(blocking=False):
            self._error(429, "too many requests in flight; retry later", kind, {"Retry-After": "1"})
            return
        try:
            self._export(body, kind)
        finally:
            self.server.inflight.release()

    def _export(self, body: bytes, kind: str) -> None:
        m = self.server.metrics
        try:
            table, report = decode(body, kind, self.server.config.limits)
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
        if table.num_rows:
            try:
                self.server.pipeline.submit(table)
            except Backpressure as e:
                self._error(e.status, str(e), kind, {"Retry-After": str(e.retry_after)})
                return
            except Exception as e:  # noqa: BLE001 - e.g. the spool's disk is full
                log.exception("cannot spool a batch")
                self._error(503, f"cannot persist the batch: {e}", kind, {"Retry-After": "5"})
                return
            try:
                m.phases.observe(table)
            except Exception:  # noqa: BLE001 - metrics must never fail an accepted request
                log.exception("phase metrics failed for a batch")
        ctype = "application/x-protobuf" if kind == "protobuf" else "application/json"
        self._send(200, encode_response(report, kind), ctype)


class CollectorHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, config: ServerConfig, pipeline: Pipeline) -> None:
        self.config = config
        self.pipeline = pipeline
        self.metrics = pipeline.metrics
        self.inflight = threading.BoundedSemaphore(config.max_inflight)
        super().__init__((config.host, config.port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"
