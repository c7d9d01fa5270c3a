"""A bench-only vLLM plugin (bench/overhead puts this directory on vLLM's PYTHONPATH in every
mode, the plugin off as on): the CPU each vLLM process spends *waiting* for a message in
vLLM's shared-memory queues (``MessageQueue.acquire_read`` until the message is there).

vLLM's readers busy-wait there (``SpinCondition``: ``sched_yield`` in a loop for a second
after each read): the engine core while its worker runs a step, the worker while the engine
core schedules the next. That CPU grows with how long the other side takes in wall time —
this VM's phase, anything else on its two cores — not with what the process does, and it is
most of their CPU here (bench/overhead at 10 req/s, three runs of three rounds of each mode on
2026-12-05: 84.5-89.7 of the worker's 104.3-105.0 ms a request, 8.3-12.2 of the engine core's
13.3-17.4; py-spy on a plugin-off engine core: 99 of its main thread's 154 samples waiting for
the worker). The bench reports vLLM's processes with and without it. Its own cost, two clock
reads and a lock a message (not measured apart), is paid alike in every mode.

It also counts each process's **garbage collections** (``gc.callbacks``: their number by
generation and their thread CPU): every object a hook allocates brings the next collection
nearer, and a collection is paid by whichever allocation triggers it — vLLM's or the plugin's —
so neither the plugin's accounting nor a sampler that attributes a collection to the line that
triggered it tells the plugin's share; the collections per request, plugin on against off, do.

``TTFTSCOPE_BENCH_WAITS=DIR``: each process writes ``DIR/<pid>.json`` (``{"wait_cpu_s": ...,
"gc_collections": [gen 0, gen 1, gen 2], "gc_cpu_s": [the same generations' seconds]}``) every half second. Unset: nothing is
patched."""

from __future__ import annotations

import json
import os
import threading
import time


class _Timed:
    """``acquire_read``'s context manager, its ``__enter__`` (the wait) timed in thread CPU; a
    wait in progress is seen by the writer too (its thread's CPU clock), so a file written
    while the process idles holds every wait to then."""

    __slots__ = ("cm",)

    def __init__(self, cm) -> None:
        self.cm = cm

    def __enter__(self):
        me = threading.get_ident()
        t = time.thread_time()
        _OPEN[me] = t
        try:
            return self.cm.__enter__()
        finally:
            dt = time.thread_time() - t
            with _LOCK:
                del _OPEN[me]
                _WAIT[0] += dt

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)


_LOCK = threading.Lock()
_WAIT = [0.0]  # the waits that ended
_GC_N = [0, 0, 0]  # garbage collections by generation: how many
_GC_S = [0.0, 0.0, 0.0]  # ... and their thread CPU (seconds)
_GC_T0 = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    """gc.callbacks: a collection's thread CPU (it runs holding the GIL: one at a time)."""
    if phase == "start":
        _GC_T0[0] = time.thread_time()
        return
    g = info.get("generation", 0)
    _GC_N[g] += 1
    _GC_S[g] += time.thread_time() - _GC_T0[0]
_OPEN: dict[int, float] = {}  # thread -> its CPU clock when its wait in progress began


def _total() -> float:
    with _LOCK:
        s = _WAIT[0]
        for ident, t0 in list(_OPEN.items()):  # (a copy: __enter__ adds to it without the lock)
            try:
                s += time.clock_gettime(time.pthread_getcpuclockid(ident)) - t0
            except OSError:  # the thread is gone
                pass
        return s


def _write(out: str) -> None:
    path = os.path.join(out, f"{os.getpid()}.json")
    while True:
        try:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"pid": os.getpid(), "wait_cpu_s": _total(), "gc_collections": _GC_N, "gc_cpu_s": _GC_S}, f)
            os.replace(tmp, path)
        except OSError:
            pass
        time.sleep(0.5)


def register() -> None:
    out = os.environ.get("TTFTSCOPE_BENCH_WAITS")
    if not out:
        return
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    orig = MessageQueue.acquire_read
    if getattr(orig, "_benchwaits", False):  # (registered once a process)
        return

    def acquire_read(self, *a, **kw):
        return _Timed(orig(self, *a, **kw))

    acquire_read._benchwaits = True
    MessageQueue.acquire_read = acquire_read
    os.makedirs(out, exist_ok=True)

    def start() -> None:
        global _LOCK
        _LOCK = threading.Lock()  # a forked child's own: the parent's writer may have held it at the fork
        _WAIT[0] = 0.0
        _GC_N[:], _GC_S[:] = [0, 0, 0], [0.0, 0.0, 0.0]
        _OPEN.clear()
        threading.Thread(target=_write, args=(out,), name="benchwaits", daemon=True).start()

    import gc

    gc.callbacks.append(_on_gc)
    os.register_at_fork(after_in_child=start)  # a forked worker: its own counts, its own file
    start()
