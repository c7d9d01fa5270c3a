"""OpenTelemetry plumbing for the plugin: a bounded, never-blocking span processor.

``BoundedBatchSpanProcessor`` is the SDK's batch processor idea with the guarantees the
plugin needs inside vLLM: ``on_end`` is O(1) and never blocks (a full queue drops the span
and counts it), memory is bounded by ``max_queue``, export happens on one daemon thread
with a short timeout, so a slow or dead collector costs vLLM nothing but dropped spans. A
batch the collector refuses with a retryable status (429, 502, 503, 504: it stored nothing) goes
back to the front of its queue and is sent again after the collector's ``Retry-After``; a batch
that got no answer is counted as failed, not sent again (the collector may have stored it).

``DeferredSpans`` takes even span creation off the serving threads: a hook appends one
tuple and the export thread encodes the tuples straight into OTLP protobuf, skipping the
SDK's span objects and its encoder (figures: README, bench/overhead).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import weakref
from collections import deque

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("vllm.ttftscope")


def name_native_thread(name: str) -> None:
    """Give the calling thread a kernel-visible name (``top -H``, ``/proc/*/task/*/comm``), so an
    operator sees what a serving process's threads cost. Linux only; best effort."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:  # noqa: BLE001
        pass


#: the export thread gives the GIL away after encoding for this long (seconds): vLLM's engine
#: loop or API server's event loop, waiting for the GIL behind it, would otherwise wait for
#: CPython's switch interval (5 ms) each time (bench/export_stall.py). By time, not by a count
#: of spans: a span of vLLM's ``llm_request`` costs ~3x one of ours to encode, and a serving
#: process encodes several times slower than a quiet one, so 32 of them ran past 5 ms in the API
#: server at a 2-s interval. 0: never.
YIELD_S = 0.0005

#: how long the export thread sleeps when it gives the GIL away (seconds). ``time.sleep(0)``
#: releases the GIL and takes it straight back unless a waiting thread wins the race to it;
#: a sleep this long lets the waiting thread in (bench/export_stall, four interleaved rounds
#: each: a step-shaped thread got the GIL back p50 0.40-0.41 ms late with ``sleep(0)``,
#: 0.11-0.16 with this sleep, 0.11 with no export thread; over 2 ms 23 times against 4). It
#: costs the export thread wall time (0.1 ms per 0.5 ms of encoding), not CPU.
YIELD_SLEEP_S = 0.0001


#: SDK spans per call of the SDK's own encoder (only for spans ``sdk_request`` cannot write)
SDK_SLICE = 8


class GilYield:
    """Called once per span while encoding: gives the GIL away (sleeps ``YIELD_SLEEP_S``) once
    ``YIELD_S`` has passed since it last did."""

    __slots__ = ("last", "every_s", "yields")

    def __init__(self, every_s: float | None = None) -> None:
        self.every_s = YIELD_S if every_s is None else every_s
        self.last = time.perf_counter()
        self.yields = 0

    def __call__(self) -> None:
        if self.every_s and time.perf_counter() - self.last >= self.every_s:
            time.sleep(YIELD_SLEEP_S)
            self.yields += 1
            self.last = time.perf_counter()


def attributes(attrs) -> dict:
    """A deferred span's attributes: the dict, or what its lazy ``(build, args)`` builds."""
    return attrs[0](*attrs[1]) if attrs.__class__ is tuple else attrs


#: the name of a record that is not a span but an engine core's logged steps as they are
#: (``DeferredSpans.steps``): sorted out into spans where the records are read
#: (:func:`read_out`), in the export sidecar as it receives them
STEP_LOG = "ttftscope.step_log"

#: what sorts ``STEP_LOG`` records out (``sort(src, records) -> records``, the spans' records
#: in their place), registered by the adapter that makes them (``vllm_plugin.steps_handoff``)
READ_OUT: dict = {}


def read_out(src, records: list) -> list:
    """``records`` with the ``STEP_LOG`` ones sorted out into spans' records: once, where they
    are read (the export sidecar as a frame arrives; a serving process that has no sidecar
    before it encodes), never again on a retry. Without a sorter they are dropped, counted."""
    if not any(r[0] == STEP_LOG for r in records):
        return records
    sort = READ_OUT.get(STEP_LOG)
    if sort is not None:
        return sort(src, records)
    left = [r for r in records if r[0] != STEP_LOG]
    src.dropped += len(records) - len(left)
    return left


def expand(records) -> list[tuple]:
    """Deferred records as the spans they stand for, attributes built: a record named None is
    a group whose ``(build, args)`` makes several spans' records at once."""
    out = []
    for r in records:
        if r[0] is None:
            out += expand(r[3][0](*r[3][1]))
        else:
            out.append((r[0], r[1], r[2], attributes(r[3]), r[4]))
    return out


def _from_headers(parent) -> tuple:
    """(trace id, parent span id, trace state) from W3C trace headers; a client's malformed
    header must not cost the batch: (None, b"", "") then, a new trace."""
    tp = parent.get("traceparent", "")
    try:
        tid, pid = bytes.fromhex(tp[3:35]), bytes.fromhex(tp[36:52])
    except (ValueError, TypeError):
        return None, b"", ""
    if len(tid) != 16 or len(pid) != 8:
        return None, b"", ""
    return tid, pid, str(parent.get("tracestate", "") or "")


def sdk_body(sdk_spans: list, tick: GilYield) -> bytes:
    """SDK spans (vLLM's start-up spans, the cold-start root) as a serialized OTLP request.
    They are written directly (the SDK's message, a fraction of its encoder's cost), giving
    the GIL away as they go (GilYield); else through that encoder in slices, with the GIL
    given away between them. Serialized requests concatenate into one request."""
    if not sdk_spans:
        return b""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from .span_wire import sdk_request

    body = sdk_request(sdk_spans, tick=tick)
    if body is None:
        parts = []
        for i in range(0, len(sdk_spans), SDK_SLICE):
            tick()
            parts.append(encode_spans(sdk_spans[i:i + SDK_SLICE]).SerializeToString())
        body = b"".join(parts)
    return body


class DeferredSpans:
    """Finished spans as plain tuples, bounded; turned into OTLP protobuf on the export thread.

    ``parent`` is the W3C trace headers of the request (``{"traceparent": ...}``), an
    OpenTelemetry ``Context``, or None for a new trace. ``attrs`` is a dict, or a tuple
    ``(build, args)`` whose ``build(*args)`` makes the dict on the export thread; ``group``
    defers the records of several spans the same way (:func:`expand`). A hook on vLLM's engine
    loop then pays for a tuple, not for dicts of keys and converted values. ``encode`` writes
    the protobuf directly (no SDK span, no SDK encoder); ``materialize`` makes SDK spans
    instead, for exporters that need them."""

    def __init__(self, tracer, resource=None, *, scope: tuple[str, str] = ("ttftscope.vllm", "0.1.0"),
                 max_queue: int = 8192, max_batch: int = 512, kind=None) -> None:
        self.tracer = tracer
        self.resource = resource
        self.scope = scope
        self.kind = kind  # the API's SpanKind of every span of this source (None: INTERNAL)
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.dropped = 0
        self.wake = None  # set by the processor: called when a batch is ready
        self._q: deque[tuple] = deque()
        self._resource_attrs = None
        self._build_failed = False

    def __len__(self) -> int:
        return len(self._q)

    def add(self, name: str, start_s: float, end_s: float, attrs: dict, parent=None) -> None:
        if len(self._q) >= self.max_queue:
            self.dropped += 1
            return
        self._q.append((name, start_s, end_s, attrs, parent))
        if len(self._q) == self.max_batch and self.wake is not None:
            self.wake()

    def extend(self, records: list[tuple]) -> None:
        """Records made elsewhere (another process's, handed over): as many as the queue has
        room for, the rest dropped and counted."""
        room = self.max_queue - len(self._q)
        if room < len(records):
            self.dropped += len(records) - max(room, 0)
            records = records[:max(room, 0)]
        self._q.extend(records)
        if len(self._q) >= self.max_batch and self.wake is not None:
            self.wake()

    def group(self, build, args: tuple, shed=None) -> None:
        """Several spans' records, made by ``build(*args)`` on the export thread. ``shed``:
        called with ``args`` before they are queued when the queue is at least half full (the
        collector down or slow), to let big things in them go (one call on the calling thread
        either way; before the append, so the export thread never sees them change)."""
        q = self._q
        if len(q) >= self.max_queue:
            self.dropped += 1
            return
        if shed is not None and len(q) * 2 >= self.max_queue:
            shed(args)
        q.append((None, 0.0, 0.0, (build, args), None))
        if len(q) == self.max_batch and self.wake is not None:
            self.wake()

    def steps(self, engine: str, items: list, now: float, final: bool = False) -> None:
        """An engine core's logged steps as the engine loop left them (one record), sorted out
        into spans where they are read (:func:`read_out`): the export sidecar does it, so the
        serving process only hands them over. ``now``: when they were taken (an open run of
        decode steps ends there once it has been idle long enough); ``final``: the last ones (at
        exit: the open run ends). Not while the queue is half full (the export backed up): then
        they are dropped, counted once."""
        q = self._q
        if len(q) * 2 >= self.max_queue:
            self.dropped += 1
            return
        q.append((STEP_LOG, now, now, (engine, items, now, final), None))

    def _expanded(self, records: list[tuple], tick=None) -> list[tuple]:
        """:func:`expand`, one record at a time: a record whose attributes cannot be built is
        dropped (counted, logged once), not the batch."""
        if all(r[0] is not None and r[3].__class__ is not tuple for r in records):
            return records
        out = []
        for r in records:
            if tick is not None:
                tick()
            try:
                out += expand((r,))
            except Exception:  # noqa: BLE001 - one bad record must not cost the batch
                self.dropped += 1
                if not self._build_failed:
                    self._build_failed = True
                    logging.getLogger("vllm.ttftscope").exception("ttftscope: building a deferred span failed")
        return out

    def take(self, n: int) -> list[tuple]:
        out = []
        while self._q and len(out) < n:
            out.append(self._q.popleft())
        return out

    def put_back(self, records: list[tuple]) -> None:
        """``records`` (from :meth:`take`) first in line again: the collector refused them."""
        self._q.extendleft(reversed(records))

    def encode(self, records: list[tuple], tick: GilYield | None = None) -> bytes:
        """One OTLP ``ResourceSpans`` holding ``records``, serialized (``span_wire``); ``tick``
        (called once per span) gives the GIL away now and then."""
        from opentelemetry import trace
        from opentelemetry.context import Context

        from . import span_wire as W

        if self._resource_attrs is None:
            self._resource_attrs = dict(self.resource.attributes) if self.resource is not None else {}
        spans = []
        getrandbits = random.getrandbits
        tick = tick or GilYield()
        ids: dict[int, tuple] = {}  # id(trace headers) -> (trace id, parent id, state): a request's spans share them
        w_span = W.span
        kind = W.span_kind(self.kind.value if self.kind is not None else 0)
        for name, start_s, end_s, attrs, parent in self._expanded(records, tick):
            tick()  # let a serving thread that waits for the GIL have it now, not in 5 ms
            if not parent:
                tid, pid, state = None, b"", ""
            elif parent.__class__ is dict:  # the request's W3C trace headers (a Context is a dict too)
                key = id(parent)
                got = ids.get(key)
                if got is None:
                    got = ids[key] = _from_headers(parent)
                tid, pid, state = got
            elif parent.__class__ is tuple:  # (trace id, parent id, state), resolved where it was recorded
                tid, pid, state = parent
            elif isinstance(parent, Context):
                tid, pid, state = None, b"", ""
                sc = trace.get_current_span(parent).get_span_context()
                if sc.is_valid:
                    tid, pid = sc.trace_id.to_bytes(16, "big"), sc.span_id.to_bytes(8, "big")
                    state = sc.trace_state.to_header() if sc.trace_state else ""
            else:
                tid, pid, state = _from_headers(parent)
            if tid is None:
                tid = getrandbits(128).to_bytes(16, "big")
            start = int(start_s * 1e9)
            end = int(end_s * 1e9)
            spans.append(w_span(tid, (getrandbits(64) or 1).to_bytes(8, "big"), pid, state, name,
                                start, end if end > start else start, attrs, kind))
        return W.resource_spans(self._resource_attrs, self.scope, spans)

    def materialize(self) -> int:
        from opentelemetry.context import Context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        prop = TraceContextTextMapPropagator()
        n = 0
        while self._q:
            for name, start_s, end_s, attrs, parent in self._expanded([self._q.popleft()]):
                ctx = parent if isinstance(parent, Context) or not parent else prop.extract(parent)
                # values computed when encoded (prefix hashes) become the strings they stand for
                attrs = {k: v if isinstance(v, (str, bool, int, float)) or v is None else str(v)
                         for k, v in attrs.items()}
                span = self.tracer.start_span(name, context=ctx, start_time=int(start_s * 1e9), attributes=attrs,
                                              **({"kind": self.kind} if self.kind is not None else {}))
                span.end(end_time=int(max(end_s, start_s) * 1e9))
                n += 1
        return n


#: statuses after which the same spans may be sent again (OTLP/HTTP: the server stored nothing)
RETRYABLE = frozenset({429, 502, 503, 504})
#: the longest a collector's Retry-After holds the export thread back
MAX_RETRY_AFTER_S = 30.0


class BoundedBatchSpanProcessor(SpanProcessor):
    #: how often encoding gives the GIL away (``GilYield``; None: ``YIELD_S``, 0: never)
    gil_yield_s: float | None = None
    #: at shutdown, how long to keep trying while the collector cannot take what is left
    #: (seconds; :meth:`shutdown`)
    linger_s: float = 0.0
    #: spans still held when :meth:`shutdown` gave up
    left_at_exit: int = 0
    #: how long the export thread waits for a full batch or a flush while another thread that
    #: wakes anyway exports on the interval (:meth:`drive`; a backstop should that one stop)
    DRIVEN_WAIT_S = 30.0

    def __init__(self, exporter: SpanExporter, *, max_queue: int = 8192, max_batch: int = 512,
                 interval_s: float = 0.5, poster=None) -> None:
        self.exporter = exporter
        self.poster = poster  # posts serialized requests (``span_wire.OtlpHttpPoster``); else the exporter's
        self.sources: list[DeferredSpans] = []
        self.max_batch = max_batch
        self.interval_s = interval_s
        self._q: deque[ReadableSpan] = deque()
        self.max_queue = max_queue
        self.dropped = 0
        self.exported = 0
        self.failed = 0
        self.retried = 0  # spans the collector refused with a retryable status, sent again later
        self._status = 0  # the last export's HTTP status (0: no answer)
        self._hold_until = 0.0  # no export before this (monotonic): the collector's Retry-After
        self._drain_lock = threading.Lock()  # one drain at a time: a flush waits for the export in flight
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_warn = 0.0
        self.driven = False  # another thread exports on the interval (:meth:`drive`)
        self._rewait = False
        #: this thread's CPU seconds by part of an export (vLLM's SDK spans written, the plugin's
        #: records built and encoded, the post) and the posts made: TTFTSCOPE_SELF_TIMING reports them
        self.cpu_parts = {"sdk": 0.0, "encode": 0.0, "post": 0.0}
        self.posts = 0
        self.cpu_s = 0.0  # the export's CPU time, on whichever thread (TTFTSCOPE_SELF_TIMING reports it)
        self._t = threading.Thread(target=self._run, name="ttftscope-export", daemon=True)
        self._t.start()
        forked = weakref.WeakMethod(self._forked)  # (a processor let go is not kept for a fork)
        os.register_at_fork(after_in_child=lambda: (f := forked()) is not None and f())

    def _forked(self) -> None:
        """In a forked child: the export thread's drain lock is new (a fork while it posted would
        leave the child's copy held, and its flush or exit waiting for ever)."""
        self._drain_lock = threading.Lock()

    def on_start(self, span, parent_context=None) -> None:  # noqa: D401 - nothing to do
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        if len(self._q) >= self.max_queue:
            self.dropped += 1
            return
        self._q.append(span)
        if len(self._q) >= self.max_batch:
            self._wake.set()

    def add_source(self, src: DeferredSpans) -> None:
        """Deferred spans the export thread encodes (or materializes) with each export."""
        src.wake = self._wake.set
        self.sources.append(src)

    def _client(self):
        """What posts serialized requests: the plugin's ``OtlpHttpPoster`` when given, else
        the stock OTLP/HTTP exporter's own HTTP client, else None (an exporter of SDK spans)."""
        if self.poster is not None:
            return self.poster
        client = getattr(self.exporter, "_client", None)
        return client if hasattr(client, "export") else None

    def _post(self, sdk_spans: list, taken: list[tuple[DeferredSpans, list]]) -> bool:
        """One request: ``sdk_spans`` and each source's records ``taken`` from it."""
        client = self._client()
        if client is None:
            res = self.exporter.export(sdk_spans)
            return getattr(res, "name", "SUCCESS") == "SUCCESS"
        tick = GilYield(self.gil_yield_s)
        c0 = time.thread_time()
        body = sdk_body(sdk_spans, tick)
        c1 = time.thread_time()
        if taken:  # repeated fields concatenate: each source's ResourceSpans joins the request
            from .span_wire import request_entry

            body += b"".join(request_entry(src.encode(records, tick)) for src, records in taken)
        c2 = time.thread_time()
        r = client.export(body)
        self._account(c0, c1, c2)
        self._status = getattr(client, "last_status", None) or getattr(r, "status_code", 0) or 0
        return bool(r) if isinstance(r, bool) else bool(getattr(r, "success", r))

    def _account(self, c0: float, c1: float, c2: float) -> None:
        """One post's CPU by part (thread-CPU readings: start, SDK spans written, records
        encoded; now: posted) for TTFTSCOPE_SELF_TIMING."""
        parts = self.cpu_parts
        parts["sdk"] += c1 - c0
        parts["encode"] += c2 - c1
        parts["post"] += time.thread_time() - c2
        self.posts += 1

    def _refused(self) -> float | None:
        """Seconds to wait before sending again when the last export was refused with a status
        the OTLP/HTTP specification makes retryable (429, 502, 503, 504: nothing was stored,
        so sending the same spans again cannot store them twice), or never reached the collector
        (no connection: down or restarting; the next interval); None otherwise."""
        client = self._client()
        if getattr(client, "unsent", False):  # no connection to the collector (down, restarting): nothing stored
            return self.interval_s
        if self._status not in RETRYABLE:
            return None
        ra = getattr(client, "retry_after", None)
        try:
            return min(max(float(ra), 0.0), MAX_RETRY_AFTER_S) if ra is not None else self.interval_s
        except ValueError:  # an HTTP date: the usual interval
            return self.interval_s

    def _drain(self, everything: bool = False, wait_s: float = -1) -> bool:
        """Export as :meth:`_drain_held` does, once no other drain is in flight (the export
        thread's, or a flush from another thread): False when none ended within ``wait_s``."""
        if not self._drain_lock.acquire(timeout=wait_s):
            return False
        try:
            self._drain_held(everything)
        finally:
            self._drain_lock.release()
        return True

    def _drain_held(self, everything: bool = False) -> None:
        """Export what was queued when the drain began (``everything``: until nothing is left,
        as at shutdown or a flush), one request per batch: vLLM's own SDK spans and the
        plugin's deferred spans, in the same request. Spans that arrive while it posts wait for
        the next wake-up (the interval, or a full batch): in a serving process they arrive all
        the time, and a drain that chased them posted once per request or so (the API server:
        69 posts for 60 requests in 5.7 s at a 2-s interval), each post 0.4-0.6 ms of CPU there."""
        direct = self._client() is not None
        if not direct:  # another exporter: it needs SDK spans
            for src in self.sources:
                try:
                    src.materialize()
                except Exception:  # noqa: BLE001 - a bad span must not stop the export thread
                    log.exception("ttftscope: could not build a span")
        left = None if everything else len(self._q) + sum(len(x) for x in self.sources)
        while True:
            cap = self.max_batch if left is None else min(self.max_batch, left)
            if cap <= 0:
                return
            batch = []
            while self._q and len(batch) < cap:
                batch.append(self._q.popleft())
            taken, room = [], cap - len(batch)  # every source's records in the same request
            for src in self.sources if direct else ():
                if room > 0 and len(src):
                    records = src.take(room)
                    taken.append((src, records))
                    room -= len(records)
            if not batch and not taken:
                return
            self._status = 0
            try:
                ok = self._post(batch, taken)
            except Exception:  # noqa: BLE001 - exporter failures must never reach vLLM
                ok = False
            n = len(batch) + sum(len(r) for _, r in taken)
            if left is not None:
                left -= n
            if ok:
                self.exported += n
                continue
            wait = self._refused()
            if wait is not None:  # first in line again (bounded: new spans meet the full queue and drop)
                self._q.extendleft(reversed(batch))
                for src, records in taken:
                    src.put_back(records)
                self.retried += n
                self._hold_until = time.monotonic() + wait
            else:  # no answer (it may have stored them: at most lost, never doubled) or not retryable
                self.failed += n
            now = time.monotonic()
            if now - self._last_warn > 30:
                self._last_warn = now
                dropped = self.dropped + sum(x.dropped for x in self.sources)
                what = (f"could not export {n} spans" if wait is None else
                        f"{'the collector is not reachable' if not self._status else f'the collector answered {self._status}'}"
                        f"; {n} spans kept to send again in {wait:g} s")
                log.warning("ttftscope: %s; dropped so far: %d queue-full, %d failed", what, dropped, self.failed)
            return  # back off until the next interval (or the collector's Retry-After)

    def _run(self) -> None:
        name_native_thread("ttftscope-exp")
        while not self._stop.is_set():
            self._wake.wait(self.DRIVEN_WAIT_S if self.driven else self.interval_s)
            self._wake.clear()
            if self._rewait:  # driven from now on: wait again, with the driven wait
                self._rewait = False
                continue
            self.export_due()

    def drive(self, on: bool = True) -> None:
        """Another thread that wakes on a schedule of its own anyway (the engine core's step-flush
        thread) exports on the interval by calling :meth:`export_due`; this thread then wakes only
        for a full batch or a flush. A thread's wake-up costs this VM ~60-97 us of CPU (README),
        and the records it hands over are likely still in its caches. ``on=False``
        gives the interval back to this thread."""
        if on == self.driven:
            return
        self.driven = on
        self._rewait = on  # (its wait under way was for the interval)
        self._wake.set()

    def export_due(self) -> float:
        """One interval's export on the calling thread (the export thread, or the thread that
        drives it: :meth:`drive`), unless the collector asked to wait (Retry-After); the CPU
        seconds it took, counted as the export's (``cpu_s``)."""
        if time.monotonic() < self._hold_until:
            return 0.0
        t = time.thread_time()
        self._drain()
        spent = time.thread_time() - t
        self.cpu_s += spent
        return spent

    def held(self) -> int:
        """Spans waiting to be exported."""
        return len(self._q) + sum(len(s) for s in self.sources)

    def shutdown(self) -> None:
        """Export what is left; while some is left that the collector could not take (down,
        restarting, asking to wait), try again each interval for ``linger_s`` (0 in vLLM's own
        processes: one try, their exit is not held up; the export sidecar waits)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._t.join(timeout=5)
        deadline = time.monotonic() + self.linger_s
        while True:
            self._drain(everything=True)
            if not self.held():
                break
            pause = max(self._hold_until - time.monotonic(), 0.0) or self.interval_s
            if time.monotonic() + pause > deadline:
                break
            time.sleep(pause)
        self.left_at_exit = self.held()
        try:
            if self.poster is not None:
                self.poster.close()
            self.exporter.shutdown()
        except Exception:  # noqa: BLE001
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued now, after the export in flight (if any) is answered; True when
        nothing is left (SDK spans and deferred ones)."""
        if not self._drain(everything=True, wait_s=max(timeout_millis, 0) / 1000):
            return False
        return not self._q and not any(len(s) for s in self.sources)
