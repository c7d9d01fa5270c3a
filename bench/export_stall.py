"""bench/export_stall: how long vLLM's engine loop waits for the GIL while the plugin's export
thread encodes spans in the same process.

A serving thread shaped like an engine loop (a little Python work, then a 2 ms wait with the
GIL released, as while the workers run a step) runs next to an export thread that encodes
plugin-shaped spans back to back (the worst case: a full queue). Reported: how late the
serving thread gets back to work after each wait (p50 / p99 / max, ms), for
  alone        no export thread (the floor, same run)
  no yield     the export thread never gives the GIL away (CPython's 5 ms switch interval)
  yield Nms    the export thread gives it away after N ms of encoding (the plugin's YIELD_S),
               sleeping 0 (``time.sleep(0)``: it may take the GIL straight back) or, as the
               plugin does, YIELD_SLEEP_S (the waiting thread gets it every time)

Usage: python bench/export_stall.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from ttftscope.collector import otel_setup
from ttftscope.schemas.phases import Phase
from ttftscope.schemas.vocabulary import Attr, SpanName


def _records(n: int) -> list[tuple]:
    now = time.time()
    tp = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    return [(SpanName.PREFILL, now, now + 0.01, {Attr.REQUEST_ID: f"cmpl-{i}", Attr.PHASE: Phase.PREFILL.value,
                                                 Attr.STEP: i, Attr.CHUNK: 0, Attr.TOKENS_COMPUTED: 128,
                                                 Attr.TOKENS_CACHED: 0, Attr.BATCH_SIZE: 4, Attr.ENGINE: "engine-1"}, tp)
            for i in range(n)]


def run(seconds: float, export: bool, every_s: float, sleep_s: float = otel_setup.YIELD_SLEEP_S) -> list[float]:
    otel_setup.YIELD_S, otel_setup.YIELD_SLEEP_S = every_s, sleep_s
    d = otel_setup.DeferredSpans(tracer=None, resource=None)
    recs = _records(512)
    stop = threading.Event()

    def exporter() -> None:
        while not stop.is_set():
            d.encode(recs)

    t = threading.Thread(target=exporter, daemon=True)
    if export:
        t.start()
    late = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = 0
        for i in range(500):  # ~20-50 us of Python: schedule() and friends
            x += i
        t0 = time.perf_counter()
        time.sleep(0.002)  # the step runs on the workers; the GIL is free
        late.append((time.perf_counter() - t0 - 0.002) * 1e3)
    stop.set()
    if export:
        t.join()
    return late


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    a = ap.parse_args()
    print(f"{'export thread':<26}{'wake-ups':>10}{'late p50 ms':>13}{'p99 ms':>9}{'max ms':>9}{'> 4 ms':>8}")
    every, nap = otel_setup.YIELD_S, otel_setup.YIELD_SLEEP_S
    for name, export, every_s, sleep_s in (("alone", False, 0, 0), ("no yield", True, 0, 0),
                                           (f"yield {every * 1e3:g}ms, sleep 0", True, every, 0),
                                           (f"yield {every * 1e3:g}ms, sleep {nap * 1e6:g}us", True, every, nap)):
        late = sorted(run(a.seconds, export, every_s, sleep_s))
        p99 = late[int(0.99 * (len(late) - 1))]
        print(f"{name:<26}{len(late):>10}{statistics.median(late):>13.3f}{p99:>9.3f}{late[-1]:>9.3f}"
              f"{sum(x > 4 for x in late):>8}", flush=True)


if __name__ == "__main__":
    main()
