"""bench/collector_first_seconds: a collector's first seconds, on a fresh install's cold cache.

``ttftscope collect`` compiles its passes (numba) on a thread of its own at start-up: ~8 s of
CPU on a cold cache (a fresh install, a new container), well under one from numba's cache
after that. Nothing else may wait for them: until they are ready requests are checked in
Python and flushes decode with chDB. This starts a collector fed at full speed by one
sender (100-span requests back to back), samples its counters every 0.1 s for --seconds,
and reports

  stall     the longest stretch in which the store did not grow (spans written) while
            spans kept being acknowledged — what a reader of the store, or `ttftscope
            run`'s settle, would see
  compiled  seconds until ``/healthz`` says the compiled passes are in use

with numba's cache cold (an empty ``NUMBA_CACHE_DIR``) against warm (one filled by a first
start, the baseline), interleaved over --rounds.

Usage: python bench/collector_first_seconds.py [--rounds 3] [--seconds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ttftscope.schemas import metrics as M  # noqa: E402

from support.otlp import Sender  # noqa: E402
from support.procs import CollectorProc  # noqa: E402


def one(cache: Path, seconds: float) -> tuple[float, float | None, int]:
    """(the longest stall in seconds, seconds until compiled or None, spans acknowledged)."""
    with tempfile.TemporaryDirectory() as d:
        col = CollectorProc(f"{d}/store", Path(d) / "spool", env={"NUMBA_CACHE_DIR": str(cache)}).start()
        try:
            sender = Sender(col.url, per_batch=100)
            sender.start()
            t0 = time.monotonic()
            compiled = None
            since, longest = (0.0, 0.0), 0.0
            while (now := time.monotonic() - t0) < seconds:
                written = col.metric(f"{M.Collector.SPANS_WRITTEN}_total")
                if written > since[1]:
                    since = (now, written)
                longest = max(longest, now - since[0])
                if compiled is None and col.compiled():
                    compiled = now
                time.sleep(0.1)
            sender.stop.set()
            sender.join(15)
            return longest, compiled, len(sender.acked)
        finally:
            col.terminate()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as warm:
        print("filling a warm cache (one start) ...", flush=True)
        one(Path(warm), 25.0)
        rows: dict[str, list[tuple]] = {"cold": [], "warm": []}
        for r in range(a.rounds):
            for kind in ("cold", "warm"):
                with tempfile.TemporaryDirectory() as cold:
                    res = one(Path(cold if kind == "cold" else warm), a.seconds)
                rows[kind].append(res)
                stall, compiled, acked = res
                print(f"round {r + 1} {kind}: longest stall {stall:.2f} s, compiled after "
                      f"{'-' if compiled is None else f'{compiled:.1f} s'}, {acked} spans acknowledged", flush=True)
    print("\nnumba cache | longest stall of the store (s), median [all] | compiled after (s), median")
    for kind, rs in rows.items():
        stalls = [s for s, _, _ in rs]
        comp = [c for _, c, _ in rs if c is not None]
        med = f"{statistics.median(comp):.1f}" if comp else "-"
        print(f"{kind:11} | {statistics.median(stalls):.2f} {[round(s, 2) for s in stalls]} | {med}")
    cold, warm_ = (statistics.median(s for s, _, _ in rows[k]) for k in ("cold", "warm"))
    print(f"cold / warm longest stall: {cold / warm_:.2f} x" if warm_ else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
