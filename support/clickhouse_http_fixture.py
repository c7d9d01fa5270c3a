"""TEST FIXTURE ONLY: ClickHouse's HTTP interface served by the chDB engine.

No ClickHouse server can be installed on this machine (Debian's is from 2018, without the
Map type), so the tests exercise ttftscope's ClickHouse-server path (clickhouse-connect over
HTTP, real MergeTree tables, the real materialized view, insert deduplication tokens)
against this small server. The SQL engine is real ClickHouse (chDB, with a data directory);
only the HTTP framing is re-implemented here, following ClickHouse's HTTP interface: the
query in the ``query`` parameter and/or the body, ``param_*`` bound parameters, settings as
URL parameters, ``database``, INSERT data after ``FORMAT x``, lz4/zstd/gzip bodies,
errors as status 500 with ``X-ClickHouse-Exception-Code``.

Run: ``python support/clickhouse_http_fixture.py --path DIR --port N``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import tempfile
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlparse

from chdb import session

TRANSPORT = {
    "query", "database", "session_id", "session_timeout", "session_check", "query_id", "quota_key",
    "compress", "decompress", "wait_end_of_query", "client_protocol_version", "role", "user",
    "password", "default_format", "send_progress_in_http_headers", "http_headers_progress_interval_ms",
    "enable_http_compression", "buffer_size",
}
INSERT_RE = re.compile(rb"^\s*(INSERT\s+INTO\s+.*?)\s+FORMAT\s+(\w+)[ \t]*\r?\n?", re.I | re.S)
FORMAT_RE = re.compile(r"\bFORMAT\s+(\w+)\s*;?\s*$", re.I)
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _decompress(data: bytes, enc: str) -> bytes:
    enc = enc.lower()
    if enc in ("", "identity"):
        return data
    if enc == "gzip":
        return gzip.decompress(data)
    if enc == "deflate":
        return zlib.decompress(data)
    if enc == "lz4":
        import lz4.frame

        return lz4.frame.decompress(data)
    if enc == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    raise ValueError(f"unsupported Content-Encoding {enc}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:
        pass

    def _body(self) -> bytes:
        if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                out += self.rfile.read(size)
                self.rfile.readline()
            return bytes(out)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reply(self, code: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        if urlparse(self.path).path in ("/ping", "/"):
            self._reply(200, b"Ok.\n")
            return
        self._handle()

    def do_POST(self) -> None:  # noqa: N802
        self._handle()

    def _handle(self) -> None:
        u = urlparse(self.path)
        qs = dict(parse_qsl(u.query, keep_blank_values=True))
        try:
            body = _decompress(self._body(), self.headers.get("Content-Encoding") or "")
            code, out, fmt = self.server.run(qs, body)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            m = re.search(r"Code: (\d+)", msg)
            self._reply(500, msg.encode(), {"X-ClickHouse-Exception-Code": m.group(1) if m else "1000",
                                            "Content-Type": "text/plain; charset=UTF-8"})
            return
        self._reply(code, out, {"X-ClickHouse-Format": fmt, "X-ClickHouse-Summary": "{}",
                                "X-ClickHouse-Server-Display-Name": "chdb-fixture"})


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, path: str) -> None:
        super().__init__(addr, Handler)
        self.sess = session.Session(path)
        self.lock = threading.Lock()

    def run(self, qs: dict, body: bytes) -> tuple[int, bytes, str]:
        query = qs.get("query", "").encode()
        params = {k[len("param_"):]: v for k, v in qs.items() if k.startswith("param_")}
        settings = {k: v for k, v in qs.items() if k not in TRANSPORT and not k.startswith("param_")}
        for k in settings:
            if not NAME_RE.match(k):
                raise ValueError(f"Code: 115. DB::Exception: Unknown setting {k}")
        full = query + (b"\n" + body if query and body else body) if body else query
        m = INSERT_RE.match(full[:65536])
        with self.lock:
            db = qs.get("database")
            self.sess.query(f"USE {db}" if db else "USE default")
            set_clause = ", ".join(f"{k} = '{v}'" for k, v in settings.items())
            if m:  # INSERT ... FORMAT x <data>
                data = full[m.end():]
                with tempfile.NamedTemporaryFile(delete=False, suffix=".data") as f:
                    f.write(data)
                try:
                    sql = (f"{m.group(1).decode()} FROM INFILE '{f.name}'"
                           + (f" SETTINGS {set_clause}" if set_clause else "") + f" FORMAT {m.group(2).decode()}")
                    self.sess.query(sql, "TabSeparated")
                finally:
                    os.unlink(f.name)
                return 200, b"", "TabSeparated"
            sql = full.decode()
            fm = FORMAT_RE.search(sql)
            fmt = fm.group(1) if fm else qs.get("default_format", "TabSeparated")
            for k, v in settings.items():
                self.sess.query(f"SET {k} = '{v}'")
            res = self.sess.query(sql, fmt, params=params or None)
            return 200, res.bytes() or b"", fmt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args()
    srv = Server(("127.0.0.1", a.port), a.path)
    print(f"listening {a.port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
