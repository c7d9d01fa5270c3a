"""From acknowledged batches to the store: spool -> flusher -> store, with back-pressure.

The pipeline is the only place that decides whether a request may be acknowledged: it
refuses (429 when the store is merely behind, 503 when the store is down) once the spool
holds ``max_spool_bytes``, so memory and disk stay bounded and a client retries later
instead of losing data.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

import pyarrow as pa
from ttftscope.schemas.store import Store

from . import otlp_compiled
from .metrics import CollectorMetrics
from .otel_setup import name_native_thread
from .otlp_sql import decode_bodies, warm_up
from .spool import ARROW, OTLP, OTLP_EVENTS_LINKS, Segment, Spool

log = logging.getLogger("ttftscope.collector")


class Backpressure(Exception):
    """The batch was not accepted; tell the client to retry after ``retry_after`` seconds."""

    def __init__(self, status: int, retry_after: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def to_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(payloads: list[bytes]) -> pa.Table:
    tables = [pa.ipc.open_stream(p).read_all() for p in payloads]
    return pa.concat_tables(tables) if tables else None


class Pipeline:
    def __init__(
        self,
        store_factory: Callable[[], Store],
        spool: Spool,
        metrics: CollectorMetrics | None = None,
        *,
        max_spool_bytes: int = 1 << 30,
        max_batch_rows: int = 200_000,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 15.0,
        maintain_every_s: float = 10.0,
        retention_days: float | None = None,
    ) -> None:
        self.store_factory = store_factory
        self.spool = spool
        self.metrics = metrics or CollectorMetrics()
        self.max_spool_bytes = max_spool_bytes
        self.max_batch_rows = max_batch_rows
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.maintain_every_s = maintain_every_s
        self.retention_days = retention_days
        self.store: Store | None = None
        self.store_healthy = True
        self.last_error = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._observed: set[int] = set()  # segments whose spans the phase metrics counted
        # read from the spool when scraped, not set on every request (~10 us of a small one's)
        self.metrics.queue_spans.set_function(lambda: self.spool.pending_rows)
        self.metrics.spool_bytes.set_function(lambda: self.spool.pending_bytes)

    # ----------------------------------------------------------------- intake
    def submit(self, table: pa.Table, durable: bool = True) -> tuple[int, int]:
        """Make ``table`` durable in the spool, or raise :class:`Backpressure`. With
        ``durable=False`` it is only written: :meth:`sync` the mark returned before
        acknowledging it."""
        return self._append(to_ipc(table), table.num_rows, ARROW, durable)

    def submit_otlp(self, body: bytes, rows: int, events_links: bool = True, durable: bool = True) -> tuple[int, int]:
        """Make a checked OTLP protobuf body (``otlp.accept_protobuf``) of ``rows`` spans
        durable in the spool, or raise :class:`Backpressure` (``durable=False``: as
        :meth:`submit`). It is decoded at flush time, with every other body of its segment:
        the compiled pass (``otlp_compiled``), and one chDB query for the bodies it leaves."""
        return self._append(body, rows, OTLP_EVENTS_LINKS if events_links else OTLP, durable)

    def sync(self, mark: tuple[int, int], rows: int) -> None:
        """Every batch submitted with a mark up to ``mark`` is durable once this returns;
        ``rows``: the spans of those batches, counted as acknowledged then."""
        self.spool.sync(mark)
        self.metrics.spans_accepted.inc(rows)

    def _append(self, payload: bytes, rows: int, kind: bytes, durable: bool) -> tuple[int, int]:
        if self.spool.pending_bytes >= self.max_spool_bytes:
            self.metrics.spans_dropped.inc(rows)
            if not self.store_healthy:
                raise Backpressure(503, 5, f"store unavailable ({self.last_error}); spool full, retry later")
            raise Backpressure(429, 1, "collector queue full; retry later")
        opened, mark = self.spool.write(payload, rows, kind)
        if opened:
            self._wake.set()  # a new segment: the flusher's next deadline is its age limit
        if durable:
            self.spool.sync(mark)
            self.metrics.spans_accepted.inc(rows)
        return mark

    # ---------------------------------------------------------------- flusher
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ttftscope-flusher", daemon=True)
        self._thread.start()

    def _get_store(self) -> Store:
        if self.store is None:
            self.store = self.store_factory()
        return self.store

    def _decode(self, seg: Segment) -> pa.Table | None:
        records = self.spool.records(seg)
        tables = []
        arrow = [p for k, p in records if k == ARROW]
        if arrow:
            tables.append(from_ipc(arrow))
        for kind, events_links in ((OTLP, False), (OTLP_EVENTS_LINKS, True)):
            bodies = [p for k, p in records if k == kind]
            if bodies:  # the compiled pass, and the chDB query for the bodies it leaves
                table, left = otlp_compiled.decode(bodies)
                if table.num_rows:
                    tables.append(table)
                if left:
                    tables.append(decode_bodies([bytes(bodies[i]) for i in left], scratch_dir=self.spool.dir,
                                                events_links=events_links))
        return pa.concat_tables(tables) if tables else None

    def _observe(self, seg: Segment, table: pa.Table | None) -> None:
        """The phase metrics of a segment's spans, once per segment (a write that fails is
        retried; its spans are not counted twice)."""
        if seg.seq in self._observed or table is None or not table.num_rows:
            return
        self._observed.add(seg.seq)
        try:
            self.metrics.phases.observe(table)
        except Exception:  # noqa: BLE001 - metrics must never stop spans reaching the store
            log.exception("phase metrics failed for a batch")

    def _observe_unwritten(self) -> None:
        """While the store is down: the phase metrics still count what arrives (alerts on
        TTFT must not go blind with the store), segment by segment as they fall due."""
        try:
            self.spool.seal(only_if_due=True)
            for seg in self.spool.sealed():
                if seg.seq not in self._observed:
                    self._observe(seg, self._decode(seg))
        except Exception:  # noqa: BLE001 - best effort; the segments stay spooled either way
            log.exception("phase metrics for spooled spans failed")

    def _write(self, seg: Segment) -> None:
        table = self._decode(seg)
        self._observe(seg, table)
        t0 = time.perf_counter()
        if table is not None and table.num_rows:
            self._get_store().insert_spans(table, self.spool.token(seg))
        self.metrics.batch_write_seconds.observe(time.perf_counter() - t0)
        self.metrics.batch_spans.observe(seg.rows)
        self.metrics.spans_written.inc(seg.rows)
        self.spool.remove(seg)
        self._observed.discard(seg.seq)

    def flush_once(self) -> int:
        """Seal what is due and write every sealed segment. Returns spans written."""
        self.spool.seal(only_if_due=True)
        written = 0
        for seg in self.spool.sealed():
            self._write(seg)
            written += seg.rows
        return written

    def _run(self) -> None:
        delay = self.retry_initial_s
        last_maintain = time.monotonic()
        # threads chDB starts from here inherit this mask: SIGTERM/SIGINT go to the main thread
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        name_native_thread("ttftscope-flush")
        try:
            warm_up()
        except Exception as e:  # noqa: BLE001 - the first flush reports it
            log.warning("cannot start the chDB engine yet: %s", e)
        while not self._stop.is_set():
            try:
                if self.store is None:  # (re)connect even when idle, so health is known early
                    self._get_store().ping()
                self.flush_once()
                if not self.store_healthy:
                    log.warning("store is back; spooled spans delivered")
                self.store_healthy, self.last_error = True, ""
                self.metrics.store_up.set(1)
                delay = self.retry_initial_s
                if time.monotonic() - last_maintain >= self.maintain_every_s:
                    last_maintain = time.monotonic()
                    self._maintain()
                # sleep until the open segment is due or maintenance is, not on a fixed tick:
                # an idle collector stays asleep (it shares cores with vLLM in small setups)
                due = self.spool.due_in_s()
                wait = self.maintain_every_s - (time.monotonic() - last_maintain)
                if due is not None:
                    wait = min(wait, due + 0.005)
                self._wake.wait(max(wait, 0.005))
                self._wake.clear()
            except Exception as e:  # noqa: BLE001 - any store failure: keep spooling, retry
                self.store_healthy, self.last_error = False, f"{type(e).__name__}: {e}"[:300]
                self.metrics.store_up.set(0)
                self.metrics.store_errors.inc()
                log.warning("store write failed (%s); spans stay spooled, retry in %.1fs", self.last_error, delay)
                self.store = None  # reconnect next time
                self._observe_unwritten()
                self._stop.wait(delay)
                delay = min(delay * 2, self.retry_max_s)

    def _maintain(self) -> None:
        store = self._get_store()
        if self.retention_days:
            dropped = store.apply_retention(self.retention_days)
            if dropped:
                log.info("retention dropped %d spans older than %s days", dropped, self.retention_days)
        store.maintain()
        q = store.stats().get("quarantined") if hasattr(store, "stats") else None
        if q is not None:
            self.metrics.parts_quarantined.set(q)

    def stop(self, flush: bool = True, timeout: float = 30.0) -> bool:
        """Stop the flusher; with ``flush``, write everything acknowledged first.

        Returns True when the spool is empty. What could not be written stays on disk and
        is delivered by the next collector started on the same spool.
        """
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.spool.seal()
        ok = True
        if flush:
            deadline = time.monotonic() + timeout
            while self.spool.sealed() and time.monotonic() < deadline:
                try:
                    self.flush_once()
                except Exception as e:  # noqa: BLE001
                    log.warning("could not flush at shutdown (%s); spans stay in %s", e, self.spool.dir)
                    ok = False
                    break
        ok = ok and not self.spool.sealed()
        if self.store is not None:
            self.store.close()
        return ok
