"""Export from a process of its own: the plugin's records leave vLLM's processes as they are.

Building span attributes, writing OTLP protobuf and posting it cost a serving process about
as much CPU as all the plugin's hooks together (bench/overhead: ~150 us a request in the
engine core's export thread, ~80 in the API server's), and that thread takes the GIL from
vLLM's engine loop and event loop while it works. ``HandoffProcessor`` keeps the plugin's
export thread and its guarantees (a bounded queue, never a blocked serving thread) but,
where it used to encode and post, it pickles the plain records it took (their lazy
``(build, args)`` attributes unbuilt) and writes them to a pipe: the **export sidecar**, a
small process of its own (``python -m ttftscope.collector.handoff``, at nice 10), builds, encodes and posts them with
the same code (``DeferredSpans.encode``, ``OtlpHttpPoster``), retries as before and keeps
its own bounded queue.

Safety: the sidecar is started on the first export (an engine core's or worker's at once:
``start_now``) and is not in vLLM's process tree (:func:`detach`); one that dies is started again (at most
``MAX_STARTS`` times, then the records are encoded and posted in-process as before, with
one warning); a pipe that stays full for the export timeout (a stopped sidecar) counts the
batch failed and starts a new sidecar. A record that cannot be pickled is encoded here, as
before. At exit the serving process hands over what is left, closes the pipe and waits for
the sidecar to post it (up to 4 s, and not at all when the collector takes no connection then: a
sidecar still posting finishes on its own, trying a collector that is down for ``LINGER_S``); the
sidecar ignores SIGINT and SIGTERM and drains and leaves when its pipe closes. At a shutdown
vLLM force-kills its engine cores' trees at once: they hand their spans over before that
(``vllm_plugin.handover``). ``TTFTSCOPE_EXPORT_PROCESS=0`` keeps the export in the serving process.

Wire: a 4-byte little-endian length, then one pickle of ``(sources, batches, raw)``:
``sources`` the resource, scope and kind of each source in the frame (in every frame: the
sidecar keeps no state a lost frame could leave wrong), ``batches`` each source's records,
``raw`` an already serialized OTLP request (SDK spans, which keep their own span ids: the
cold-start root, vLLM's start-up spans) or b"".
"""

from __future__ import annotations

import copyreg
import io
import json
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque

from .otel_setup import (
    READ_OUT,
    STEP_LOG,
    BoundedBatchSpanProcessor,
    DeferredSpans,
    GilYield,
    name_native_thread,
    read_out,
    sdk_body,
)

log = logging.getLogger("vllm.ttftscope")

#: sidecars one serving process starts at most (the first and restarts after it died)
MAX_STARTS = 5
#: how long a new sidecar may take to start (its imports, on a loaded host) before the export
#: stays in the serving process
READY_TIMEOUT_S = 30.0
#: how long a serving process waits at exit for its sidecar to post what it holds (seconds):
#: under vLLM's own 5-s grace for a child before it kills the child's whole tree (the sidecar,
#: not in that tree, is not killed with it: a sidecar still posting then finishes on its own)
EXIT_WAIT_S = 4.0
#: how long a sidecar whose serving process has left keeps trying a collector that cannot take
#: what it holds (down, restarting, asking to wait), before it gives those spans up (seconds;
#: TTFTSCOPE_EXPORT_LINGER_S): it is outside vLLM's processes, so its wait holds nothing up
LINGER_S = 30.0  # (PluginConfig.export_linger_s's default)
#: the sidecar's niceness: its work is background and waits well, vLLM's threads do not
#: (best effort; a host where vLLM spins on every core still gives it ~10 % of a core's share)
NICE = 10
#: the pipe's buffer (bytes; Linux F_SETPIPE_SZ, best effort): a few exports' worth
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031
_HEADER = struct.Struct("<I")


def _reduce_context(ctx):
    """An OpenTelemetry Context as a record's parent: its span's (trace id, span id, state),
    which ``DeferredSpans.encode`` takes as they are (the sidecar needs no Context)."""
    from opentelemetry import trace

    sc = trace.get_current_span(ctx).get_span_context()
    if not sc.is_valid:
        return type(None), ()
    state = sc.trace_state.to_header() if sc.trace_state else ""
    return tuple, ((sc.trace_id.to_bytes(16, "big"), sc.span_id.to_bytes(8, "big"), state),)


def _dispatch_table() -> dict:
    from opentelemetry.context import Context

    table = copyreg.dispatch_table.copy()  # a private table: pickling elsewhere in vLLM is untouched
    table[Context] = _reduce_context
    return table


#: class -> ``reduce(obj)``: a serving process's object handed over as the plain values the
#: sidecar needs (``__reduce__``'s form), registered by the adapters whose records hold them
#: (``vllm_plugin.steps_handoff``: vLLM's Request, PrefillStats and scheduler, in the logged steps);
#: read while the frame is written, on the export thread, never on vLLM's threads
PLAIN: dict = {}


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):  # only for objects not of pickle's own atomic types
        if PLAIN:
            for cls, reduce in PLAIN.items():
                if isinstance(obj, cls):
                    return reduce(obj)
        return NotImplemented


def plain_as(cls: type, reduce) -> None:
    """Hand ``cls``'s instances (its subclasses' too) over as ``reduce(obj)`` says."""
    PLAIN[cls] = reduce


def dump_frame(msg) -> memoryview:
    """One frame: the length, then the pickle of ``msg``."""
    buf = io.BytesIO()
    buf.write(b"\0\0\0\0")
    p = _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = _TABLE
    p.dump(msg)
    view = buf.getbuffer()
    _HEADER.pack_into(view, 0, len(view) - 4)
    return view


_TABLE = _dispatch_table()


class Detached:
    """A sidecar process that is not this process's child, watched through a pidfd: ``poll``,
    ``wait`` and ``kill`` as ``subprocess.Popen``'s (its exit status is its parent's, init's, to
    read: ``poll`` answers 0 once it has gone)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._fd], [], [], 0)[0]:
            self.returncode = 0
            os.close(self._fd)
        return self.returncode

    def __del__(self) -> None:
        if self.returncode is None:
            try:
                os.close(self._fd)
            except OSError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not select.select([self._fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(f"export sidecar {self.pid}", timeout)
        return self.poll()

    def kill(self) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Sidecar:
    """The export process of one serving process, fed over a pipe (started on first use, or
    at once: ``HandoffProcessor(start_now=True)``)."""

    def __init__(self, role: str, timeout_s: float, settings: dict) -> None:
        self.role = role
        self.timeout_s = timeout_s
        self.settings = settings  # the sidecar's endpoint, timeout, queue, batch and interval
        self.proc: Detached | None = None
        self.fd = -1
        self.starts = 0
        self.broken = False  # no sidecar any more: export in-process
        self.retry_after: str | None = None  # read by the processor when a batch could not be handed over
        self.why: str | None = None  # why there is no sidecar (``broken``)
        self.lock = threading.Lock()  # one frame at a time (a force_flush from another thread)
        os.register_at_fork(after_in_child=self.forget)

    def ensure(self) -> bool:
        """A live sidecar with its pipe open (started now if needed); False: export in-process."""
        if self.broken:
            return False
        if self.fd >= 0 and self.proc is not None and self.proc.poll() is None:
            return True
        if self.proc is not None and self.proc.poll() is not None:  # what it held and had not posted is lost
            log.warning("ttftscope: the export sidecar (pid %d) exited; starting another", self.proc.pid)
        self._discard()
        if self.starts >= MAX_STARTS:
            self.broken, self.why = True, f"the export sidecar stopped {self.starts} times"
            log.warning("ttftscope: %s; exporting from this process", self.why)
            return False
        self.starts += 1
        r, w = os.pipe()
        try:
            try:
                import fcntl

                fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
            except (OSError, ImportError):
                pass
            # -P: not the working directory's modules first (a user's own "ttftscope" package).
            # The process started here forks the sidecar and leaves at once (``detach``)
            launcher = subprocess.Popen([sys.executable, "-P", "-m", "ttftscope.collector.handoff", self.role,
                                         json.dumps({**self.settings, "of": os.getpid()})],
                                        stdin=r, stdout=subprocess.PIPE, close_fds=True)
            # it says who it is, then that it is ready (imports done, its processor up) before it
            # is given anything: a sidecar that cannot start loses no records and leaves the
            # export here, loudly
            self.proc = None  # (one before it, if alive, was killed or drains on its own)
            with launcher.stdout as ready:
                deadline = time.monotonic() + READY_TIMEOUT_S
                said = b""
                while not said.endswith(b"R") and len(said) < 32:
                    if not select.select([ready], [], [], max(deadline - time.monotonic(), 0))[0]:
                        break
                    got = os.read(ready.fileno(), 32)
                    if not got:
                        break
                    said += got
                    if self.proc is None and b"\n" in said:
                        self.proc = Detached(int(said.split(b"\n", 1)[0]))
                launcher.wait(READY_TIMEOUT_S)
                if not said.endswith(b"R"):
                    if self.proc is not None:
                        self.proc.kill()
                    raise RuntimeError(f"it did not start (the launcher's exit status {launcher.returncode})")
        except Exception as e:  # noqa: BLE001 - no sidecar: the export thread does it, as before
            os.close(w)
            self.proc = None
            self.broken, self.why = True, f"no export sidecar ({e})"
            log.warning("ttftscope: %s; exporting from this process", self.why)
            return False
        finally:
            os.close(r)
        os.set_blocking(w, False)
        self.fd = w
        return True

    def send(self, frame: memoryview) -> str:
        """Write one frame: "ok"; "unsent" (nothing of it reached the pipe: it may be sent
        again); "lost" (part of it did, or the pipe stayed full for the export timeout: the
        sidecar is let go, its stream cut mid-frame)."""
        with self.lock:
            return self._send(frame)

    def _send(self, frame: memoryview) -> str:
        sent, n = 0, len(frame)
        deadline = time.monotonic() + self.timeout_s
        while sent < n:
            try:
                sent += os.write(self.fd, frame[sent:])
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                select.select([], [self.fd], [], min(left, 0.5))
            except OSError:  # the sidecar is gone (EPIPE)
                break
        if sent == n:
            return "ok"
        self._discard(kill=True)
        return "unsent" if sent == 0 else "lost"

    def _discard(self, kill: bool = False) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        if kill and self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None and self.proc.poll() is not None:
            self.proc = None

    def forget(self) -> None:
        """In a forked child: the parent's sidecar is not ours (its pipe closed here, not killed;
        its send lock new: a fork mid-send would leave the child's copy held)."""
        self.lock = threading.Lock()
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd, self.proc = -1, None

    def close(self, wait_s: float) -> None:
        """Close the pipe and give the sidecar ``wait_s`` to post what it holds and leave."""
        proc = self.proc
        self._discard()
        if proc is not None and wait_s > 0:
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                log.warning("ttftscope: the export sidecar (pid %d) is still posting; leaving it to finish", proc.pid)
        self.proc = None


def sidecars_of(pids) -> list:
    """The export sidecars (``psutil.Process``) of the serving processes ``pids``: they are not
    those processes' children (:func:`detach`), so they are found by the pid each names in its
    command line (``"of"`` in its settings)."""
    import psutil

    pids, out = set(pids), []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        try:
            i = cmd.index("ttftscope.collector.handoff")
            if json.loads(cmd[i + 2]).get("of") in pids:
                out.append(p)
        except (ValueError, IndexError, TypeError, AttributeError):
            continue
    return out


def probe(endpoint: str, timeout_s: float = READY_TIMEOUT_S) -> str | None:
    """Start an export sidecar as the plugin would and let it go (``ttftscope doctor``): None
    when it started and said it was ready, else why not."""
    s = Sidecar("doctor", timeout_s, {"endpoint": endpoint, "timeout_s": 1.0})
    ok = s.ensure()
    s.close(timeout_s)
    return None if ok else s.why


def _read_out_here(taken: list[tuple[DeferredSpans, list]]) -> None:
    """Records about to be encoded in this process (no sidecar to take them) sorted out here, in
    place: a batch put back on a refusal is then never sorted out twice."""
    for src, records in taken:
        records[:] = read_out(src, records)


class HandoffProcessor(BoundedBatchSpanProcessor):
    """The plugin's bounded processor, exporting through an export sidecar (module docstring)."""

    def __init__(self, exporter, *, role: str, endpoint: str, timeout_s: float, start_now: bool = False,
                 linger_s: float = LINGER_S, **kw) -> None:
        """``start_now``: the sidecar is started at once, not by the first export (an engine
        core or worker asked to hand its spans over at a shutdown then only writes them to
        it: ``vllm_plugin.handover``). ``linger_s``: the sidecar's ``LINGER_S``."""
        settings = {"endpoint": endpoint, "timeout_s": timeout_s, "linger_s": linger_s,
                    **{k: kw[k] for k in ("max_queue", "max_batch", "interval_s") if k in kw}}
        self.link = Sidecar(role, timeout_s, settings)
        self._pickle_failed = False
        self.start_now = start_now
        super().__init__(exporter, **kw)

    def _run(self) -> None:
        if self.start_now:
            with self._drain_lock:  # (a flush meanwhile waits for it, not starts another)
                try:
                    self.link.ensure()
                except Exception:  # noqa: BLE001 - the first export tries again
                    pass
        super()._run()

    def _client(self):
        return super()._client() if self.link.broken else self.link

    def _post(self, sdk_spans: list, taken: list[tuple[DeferredSpans, list]]) -> bool:
        if not self.link.ensure():
            _read_out_here(taken)
            return super()._post(sdk_spans, taken)  # in-process, through the poster (``_client``)
        tick = GilYield()
        c0 = time.thread_time()
        raw = sdk_body(sdk_spans, tick)
        c1 = time.thread_time()
        # every frame names its sources (resource, scope, kind), not only the first that carried
        # them: a frame the sidecar could not read (or a new sidecar) then costs that frame's
        # spans, never every later span of a source it was not told of (a few small dicts a frame)
        news, batches = [], []
        for src, records in taken:
            i = self.sources.index(src)
            if src._resource_attrs is None:
                src._resource_attrs = dict(src.resource.attributes) if src.resource is not None else {}
            news.append((i, src._resource_attrs, src.scope, src.kind.value if src.kind is not None else None))
            batches.append((i, records))
        try:
            frame = dump_frame((news, batches, raw))
        except Exception:  # noqa: BLE001 - a record that does not pickle: encoded here, as without a sidecar
            if not self._pickle_failed:
                self._pickle_failed = True
                log.exception("ttftscope: records could not be handed to the export sidecar; encoding them here")
            from .span_wire import request_entry

            _read_out_here(taken)
            raw += b"".join(request_entry(src.encode(records, tick)) for src, records in taken)
            news = []
            frame = dump_frame(([], [], raw))
        c2 = time.thread_time()
        got = self.link.send(frame)
        self._account(c0, c1, c2)
        if got == "ok":
            self._status = 200
            return True
        # nothing handed over: first in line again for a new sidecar at once; else counted failed
        self._status, self.link.retry_after = (503, "0") if got == "unsent" else (0, None)
        return False

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        super().shutdown()
        wait = min(self.link.timeout_s, EXIT_WAIT_S)
        if self.link.proc is not None and self.poster is not None and not self.poster.reachable():
            # waiting for the sidecar would only hold vLLM's shutdown up (it waited the whole
            # EXIT_WAIT_S, every process with a sidecar): the sidecar, outside vLLM's processes,
            # goes on trying for linger_s whether this process waits or not
            log.info("ttftscope: the collector (%s) is not reachable; leaving without waiting for the export "
                     "sidecar (pid %d), which goes on trying it for %g s", self.link.settings["endpoint"],
                     self.link.proc.pid, self.link.settings.get("linger_s", LINGER_S))
            wait = 0.0
        self.link.close(wait)


class _SidecarProcessor(BoundedBatchSpanProcessor):
    """The sidecar's processor: records from the pipe, posted as soon as they arrive."""

    #: no serving thread waits for this process's GIL (its other thread reads the pipe): the
    #: encoder never sleeps to give it away (8 % of its CPU and 23 % of its wall time per
    #: request's records, warm, interleaved: 55.9 against 60.7 us CPU, 55.9 against 72.8 wall)
    gil_yield_s = 0.0

    def __init__(self, *a, **kw) -> None:
        self.raw: deque[bytes] = deque(maxlen=64)
        super().__init__(*a, **kw)

    def held(self) -> int:
        return super().held() + len(self.raw)

    def _drain_held(self, everything: bool = False) -> None:
        while self.raw:
            body = self.raw.popleft()
            try:
                ok = self.poster.export(body)
            except Exception:  # noqa: BLE001
                ok = False
            if ok:
                continue
            if getattr(self.poster, "unsent", False):  # the collector not reachable: kept, sent again
                self.raw.appendleft(body)
                self._hold_until = time.monotonic() + self.interval_s
                return
            self.failed += 1
        super()._drain_held(everything)


class _NoExporter:
    """The sidecar posts serialized requests (its poster); nothing needs an SDK exporter."""

    def export(self, spans) -> None:  # pragma: no cover - never called with a poster
        raise RuntimeError("the export sidecar posts serialized requests only")

    def shutdown(self) -> None:
        pass


def _self_timing(out_dir: str, parent_role: str, proc: _SidecarProcessor, sources: dict) -> None:
    from pathlib import Path

    from .vllm_plugin.runtime import write_every_second

    def doc(mine: float) -> dict:
        cpu = time.process_time()
        return {"role": f"{parent_role}_sidecar", "parent_role": parent_role, "pid": os.getpid(), "wall": time.time(),
                "process_cpu_s": cpu, "export_cpu_s": cpu - mine, "timing_cpu_s": mine, "hooks_s": 0.0,
                "hooks_wall_s": 0.0, "hook_calls": 0, "exported": proc.exported, "failed": proc.failed,
                "dropped": proc.dropped + sum(s.dropped for s in sources.values()),
                "export_parts_s": dict(proc.cpu_parts), "export_posts": proc.posts, "per_hook": {},
                "heavy_imports": [m for m in ("vllm", "torch", "pyarrow", "numpy") if m in sys.modules]}

    write_every_second(Path(out_dir) / f"export-sidecar-{os.getpid()}.json", doc)


def detach() -> None:
    """Leave the serving process's tree, first thing: the process the serving process started
    forks the sidecar and exits at once, and the sidecar, now a child of init (or of a
    subreaper), says its pid. vLLM force-kills its engine core's whole process tree at a
    shutdown that aborts requests (``kill_process_tree``): a sidecar in it died with the last
    spans it had been handed (tests/test_vllm_plugin.py, a server stopped right after its last
    request). It stays in vLLM's session and process group: a session of its own is an
    autogroup of its own on Linux, where its nice 10 no longer yields to vLLM's threads but
    weighs as much as all of them together (read in ``/proc/PID/autogroup`` after a truth test,
    the delivery stall, failed once on a clean clone with the sidecar in a session of its own;
    not proven to be that failure's cause). The group's signals it ignores (SIGINT, SIGTERM,
    SIGHUP: set before this); it leaves when its pipe closes, as before."""
    if os.fork():
        os._exit(0)
    os.write(1, b"%d\n" % os.getpid())


def main(argv: list[str] | None = None) -> int:
    """The sidecar: frames from stdin until it closes, then everything posted, then exit."""
    argv = sys.argv[1:] if argv is None else argv
    parent_role, settings = argv[0], json.loads(argv[1])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # vLLM's Ctrl-C / group TERM / a closed
        signal.signal(sig, signal.SIG_IGN)  # terminal: it drains and leaves at EOF
    detach()
    try:
        os.nice(NICE)
    except OSError:
        pass
    logging.basicConfig(level=logging.WARNING, format=f"ttftscope export sidecar ({parent_role}): %(message)s")
    name_native_thread("ttftscope-sidecar")
    from opentelemetry.trace import SpanKind

    from .span_wire import OtlpHttpPoster

    # the modules whose functions build the records' attributes, imported now (start-up) rather
    # than by the first frame that names one of them
    from .vllm_plugin import engine, frontend, http, worker  # noqa: F401

    max_queue, max_batch = int(settings.get("max_queue", 8192)), int(settings.get("max_batch", 512))
    proc = _SidecarProcessor(_NoExporter(), max_queue=max_queue, max_batch=max_batch,
                             interval_s=float(settings.get("interval_s", 2.0)),
                             poster=OtlpHttpPoster(settings["endpoint"], timeout=float(settings["timeout_s"])))
    proc.linger_s = float(settings.get("linger_s", LINGER_S))  # its serving process gone, the collector down
    sources: dict[int, DeferredSpans] = {}
    if timing_dir := os.environ.get("TTFTSCOPE_SELF_TIMING"):
        threading.Thread(target=_self_timing, args=(timing_dir, parent_role, proc, sources),
                         name="ttftscope-self-timing", daemon=True).start()
    os.write(1, b"R")  # ready: the serving process hands records over from now on
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    stdin = os.fdopen(0, "rb", buffering=PIPE_BYTES)
    unknown = bad = 0
    while True:
        head = stdin.read(4)
        if len(head) < 4:
            break
        (n,) = _HEADER.unpack(head)
        data = stdin.read(n)
        if len(data) < n:
            break
        try:
            news, batches, raw = pickle.loads(data)
        except Exception:  # noqa: BLE001 - one bad frame costs its spans, not the sidecar
            bad += 1
            if bad == 1:
                log.exception("a frame could not be read; its spans are lost")
            continue
        for i, attrs, scope, kind in news:
            src = sources.get(i)
            if src is None:
                src = sources[i] = DeferredSpans(None, None, scope=scope, max_queue=max_queue, max_batch=max_batch,
                                                 kind=SpanKind(kind) if kind is not None else None)
                proc.add_source(src)
            src._resource_attrs, src.scope = attrs, scope
        for i, records in batches:
            src = sources.get(i)
            if src is None:
                unknown += len(records)
                continue
            try:
                records = read_out(src, records)  # an engine core's logged steps, sorted out here
            except Exception:  # noqa: BLE001 - they are lost, not the sidecar
                bad += 1
                if bad == 1:
                    log.exception("logged steps could not be sorted out; their spans are lost")
                records = [r for r in records if r[0] != STEP_LOG]
            src.extend(records)
        if raw:
            if len(proc.raw) == proc.raw.maxlen:  # (the oldest goes)
                proc.dropped += 1
            proc.raw.append(raw)
        proc._wake.set()
    sorter = READ_OUT.get(STEP_LOG)
    if sorter is not None:  # the serving process is gone: its open runs of decode steps end here
        try:
            sorter.finish()
        except Exception:  # noqa: BLE001
            log.exception("the last logged steps could not be sorted out")
    proc.shutdown()
    dropped = proc.dropped + sum(s.dropped for s in sources.values()) + unknown
    if dropped or proc.failed or proc.left_at_exit:
        log.warning("exported %d spans; %d dropped, %d failed, %d never taken by the collector in %g s",
                    proc.exported, dropped, proc.failed, proc.left_at_exit, proc.linger_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
