"""A local HTTP server that takes POSTs and answers 200 with an empty body, after a delay the
test sets: the far end of an exporter where a test needs a collector slower than the real one."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class PostSink:
    """``with PostSink(delay_s) as sink``: POSTs to ``sink.url`` land in ``sink.seen`` as
    ``(path, body)``, each once its answer is due (``delay_s`` later; set it any time).
    ``keep_alive``: HTTP/1.1, connections kept between requests. ``port``: where (0: any free one)."""

    def __init__(self, delay_s: float = 0.0, keep_alive: bool = False, port: int = 0) -> None:
        self.delay_s = delay_s
        self.seen: list[tuple[str, bytes]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                time.sleep(sink.delay_s)
                sink.seen.append((self.path, body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self._srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self._srv.server_address[1]}"
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()

    def __enter__(self) -> PostSink:
        return self

    def __exit__(self, *exc) -> None:
        self._srv.shutdown()
        self._srv.server_close()
