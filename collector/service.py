"""``ttftscope collect``: store + spool + pipeline + HTTP server, stopped cleanly on SIGTERM."""

from __future__ import annotations

import hashlib
import logging
import os
import select
import signal
import socket
import threading
from pathlib import Path

from ttftscope.schemas.store import open_store, redact_url

from . import otlp_compiled, phase_metrics
from .metrics import CollectorMetrics
from .pipeline import Pipeline
from .server import CollectorHTTPServer, ServerConfig
from .spool import Spool

log = logging.getLogger("ttftscope.collector")


def default_spool_dir(store_url: str, host: str, port: int) -> Path:
    """A spool per (store, listen address), so a restart finds what the last run left."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    key = hashlib.sha256(f"{store_url}|{host}:{port}".encode()).hexdigest()[:16]
    return Path(base) / "ttftscope" / "spool" / key


def _warm_up() -> None:
    """Compile (or load from numba's cache) the collector's compiled passes, off the serving threads."""
    otlp_compiled.warm_up()
    phase_metrics.warm_up()


class Collector:
    """A running collector; ``start()`` returns once it listens."""

    def __init__(
        self,
        store_url: str,
        config: ServerConfig | None = None,
        *,
        spool_dir: str | os.PathLike | None = None,
        fsync: bool = True,
        max_spool_bytes: int = 1 << 30,
        segment_age_s: float = 2.0,
        retention_days: float | None = None,
    ) -> None:
        self.config = config or ServerConfig()
        self.store_url = store_url
        spool_dir = spool_dir or default_spool_dir(store_url, self.config.host, self.config.port)
        self.spool = Spool(spool_dir, fsync=fsync, segment_age_s=segment_age_s)
        self.metrics = CollectorMetrics()
        self.pipeline = Pipeline(
            lambda: open_store(store_url),
            self.spool,
            self.metrics,
            max_spool_bytes=max_spool_bytes,
            retention_days=retention_days,
        )
        self.server = CollectorHTTPServer(self.config, self.pipeline)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> Collector:
        # the arrival check's compiled scan and the flush's compiled decode: until they are ready
        # requests are checked in Python and bodies decoded by chDB
        threading.Thread(target=_warm_up, name="ttftscope-jit", daemon=True).start()
        self.pipeline.start()
        self._thread = threading.Thread(target=self.server.serve_forever, name="ttftscope-http", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop accepting, finish the requests in flight (nothing is acknowledged after
        this), then write everything acknowledged. True when nothing is left spooled."""
        if not self.server.drain(timeout):
            log.warning("requests still in flight after %.0fs; stopping anyway (they were not acknowledged)", timeout)
        ok = self.pipeline.stop(flush=True, timeout=timeout)
        self.spool.close()
        return ok


class StopSignals:
    """SIGTERM and SIGINT, waited for in the main thread without a lock.

    The handler only appends to a list: Python runs it in the main thread between two of its
    instructions, wherever they are, so a handler that takes a lock (``Event.set()``) hangs for
    good when the main thread held that lock (in ``Event.wait()``: seen, a collector that never
    stopped). The C-level handler writes a byte to the wake-up socket, which ends ``wait()``'s
    select() at once, also when the signal was delivered to another thread (chDB's), which only
    flags it for the main thread."""

    def __init__(self, *signums: int) -> None:
        self.signums = signums or (signal.SIGTERM, signal.SIGINT)
        self.received: list[int] = []

    def install(self) -> StopSignals:
        """From the main thread, before the work that the signals stop is started."""
        self._r, self._w = socket.socketpair()
        for s in (self._r, self._w):
            s.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        for n in self.signums:
            signal.signal(n, lambda signum, _frame: self.received.append(signum))
        return self

    def wait(self) -> int:
        """Block until one of the signals has arrived; returns it (the handlers stay: a second
        one does nothing more)."""
        try:
            while not self.received:
                select.select([self._r], [], [], 0.5)  # (the timeout: a lost wake-up byte costs half a second)
                try:
                    while self._r.recv(512):
                        pass
                except BlockingIOError:
                    pass
        finally:
            signal.set_wakeup_fd(self._old_fd)
            self._r.close()
            self._w.close()
        return self.received[0]


def serve(collector: Collector, ready_message: bool = True) -> int:
    """Run until SIGTERM/SIGINT, then flush. Exit code 0 when everything was written."""
    stop = StopSignals().install()
    collector.start()
    if ready_message:
        pending = collector.spool.pending_rows
        msg = f"ttftscope collector listening on {collector.url}/v1/traces -> store {redact_url(collector.store_url)}"
        if pending:
            msg += f" ({pending} spooled spans from a previous run will be delivered)"
        print(msg, flush=True)
    log.info("signal %s: stopping", stop.wait())
    ok = collector.stop()
    acked = int(collector.metrics.spans_accepted._value.get())
    left = collector.spool.pending_rows
    if ok and left == 0:
        print(f"collector stopped; every acknowledged span is in the store ({acked} this run)", flush=True)
        return 0
    print(
        f"collector stopped; {left} acknowledged spans are spooled but not stored, in "
        f"{collector.spool.dir}; they will be delivered on the next start ({acked} acknowledged this run)",
        flush=True,
    )
    return 3
