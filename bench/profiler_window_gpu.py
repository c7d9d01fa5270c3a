"""bench/profiler_window_gpu: what one sampled torch.profiler window (TTFTSCOPE_PROFILE_EVERY)
adds to a step on a CUDA GPU: wall time of a step (a CUDA graph replay, synchronised) with the
worker adapter's profiled path vs the same step plain, for the first windows and steady state.
Needs a CUDA GPU; prints milliseconds.
Usage (on a GPU machine): python bench/profiler_window_gpu.py [--warm]   (--warm: the start-up
warm-up the worker adapter runs first, as in serving)
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch
from ttftscope.collector.vllm_plugin import runtime, worker


class _Drop:
    def add(self, *a, **k) -> None:
        pass


def main() -> None:
    runtime.RT.deferred = _Drop()
    w = torch.randn(4096, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(8):
            w @ w
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(8):
            w @ w
    torch.cuda.synchronize()

    def step():
        g.replay()
        torch.cuda.synchronize()

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    ws = worker.WorkerState(step=1, rank=0, tp=1, engine="bench", eager=False, profile_every=1)
    if "--warm" in sys.argv:  # what the worker adapter does at start-up when windows are on
        t = time.perf_counter()
        worker.warm_profiler(ws)
        print(f"warm-up (at start-up): {(time.perf_counter() - t) * 1e3:.1f} ms")
    plain = [timed(step) for _ in range(50)]
    windows = []
    for _ in range(10):
        windows.append(timed(lambda: worker._profiled(ws, step)))
        for t in threading.enumerate():
            if t.name == "ttftscope-profile":
                t.join(60)
    print(f"plain step: median {statistics.median(plain):.3f} ms")
    print("profiled windows, in order (ms): " + ", ".join(f"{x:.1f}" for x in windows))
    print(f"steady-state window (median of windows 3-10): {statistics.median(windows[2:]):.2f} ms "
          f"= +{statistics.median(windows[2:]) - statistics.median(plain):.2f} ms per sampled step")


if __name__ == "__main__":
    main()
