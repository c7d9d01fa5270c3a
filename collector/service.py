"""``ttftscope collect``: store + spool + pipeline + HTTP server, stopped cleanly on SIGTERM."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
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


def serve(collector: Collector, ready_message: bool = True) -> int:
    """Run until SIGTERM/SIGINT, then flush. Exit code 0 when everything was written."""
    stop = threading.Event()

    def _on_signal(signum, _frame) -> None:
        log.info("signal %s: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    collector.start()
    if ready_message:
        pending = collector.spool.pending_rows
        msg = f"ttftscope collector listening on {collector.url}/v1/traces -> store {redact_url(collector.store_url)}"
        if pending:
            msg += f" ({pending} spooled spans from a previous run will be delivered)"
        print(msg, flush=True)
    # wake up now and then: a signal delivered to one of chDB's threads only flags it for
    # the main thread, which must be running to act on it (a bare wait() could sleep forever)
    while not stop.wait(0.5):
        pass
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
