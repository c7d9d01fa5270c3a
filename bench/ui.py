"""bench/ui: time for each page of the web UI to finish rendering in headless Chromium.

Fills an embedded store with N requests (default 1,000,000, ~8.4M spans; synthetic,
regression scenario), starts `ttftscope ui`, loads every page once to warm the caches, then
times each page load from navigation to "script finished" (no status widget, title shown),
median of --repeat loads. Baseline measured in the same run: the Alerts page, which runs no
store query (the framework's own floor), so ratios show what the data costs.
Target: under 2 s per page, warm.

Then --soak seconds (default 150) of loading Overview and Breakdown in turn, so the window
("last hour", snapped to the minute) moves and the 60 s freshness runs out at least twice:
before stale-while-revalidate the first view after each move re-ran the analysis in front
of the viewer (~7 s at 1M requests); the soak reports the median and the worst load and how
many loads were served the previous answer while a refresh ran.

Usage: python bench/ui.py [--requests 1000000] [--repeat 3] [--soak 150] [--store DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ttftscope.analyzer import synth  # noqa: E402
from ttftscope.schemas.store import open_store  # noqa: E402

from support.browser import chrome as _chrome  # noqa: E402
from support.browser import wait_rendered  # noqa: E402
from support.procs import free_port, wait_http  # noqa: E402

PAGES = ["overview", "breakdown", "requests", "gaps", "compare", "coldstart", "alerts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--soak", type=float, default=150.0)
    ap.add_argument("--store", default=None)
    a = ap.parse_args()
    d = a.store or tempfile.mkdtemp(prefix="ttftscope-ui-")
    st = open_store(d)
    if st.query("SELECT count() FROM otel_traces WHERE SpanName = 'llm_request'").item() < a.requests:
        t = time.time()
        synth.write(st, "regression", a.requests, seed=3, chunk=100_000)
        st.maintain()
        print(f"filled {a.requests:,} requests in {time.time() - t:.0f}s: {st.stats()}", flush=True)
    port = free_port()
    env = {**os.environ, "TTFTSCOPE_STORE": d}
    ui = subprocess.Popen([sys.executable, "-m", "ttftscope", "ui", "--store", d, "--port", str(port)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", ui)
        drv = _chrome()
        try:
            def load(path: str) -> float:
                t = time.perf_counter()
                drv.get(f"http://127.0.0.1:{port}/{path}")
                wait_rendered(drv, timeout=600)
                return time.perf_counter() - t

            for p in PAGES:  # warm the caches (first analysis of the window)
                print(f"  warm {p}: {load(p):.1f}s", flush=True)
            res = {p: statistics.median(load(p) for _ in range(a.repeat)) for p in PAGES}
            base = statistics.median(load("alerts") for _ in range(a.repeat))  # no store queries on this page
            soak, stale, t_end = [], 0, time.monotonic() + a.soak
            while time.monotonic() < t_end:
                soak.append(load(PAGES[len(soak) % 2]))
                stale += "while a fresh one runs" in drv.page_source
        finally:
            drv.quit()
    finally:
        os.killpg(ui.pid, 15)
        ui.wait(30)
    print(f"\n{'page':<12}{'warm render s':>15}{'x alerts page':>15}")
    for p, v in res.items():
        print(f"{p:<12}{v:>15.2f}{v / base:>15.2f}")
    if soak:
        print(f"soak {a.soak:.0f}s, {len(soak)} loads of overview/breakdown while the window moves: median "
              f"{statistics.median(soak):.2f}s, worst {max(soak):.2f}s; {stale} served the last answer during a refresh")
    worst = max([*res.values(), *soak])
    print(f"slowest page {worst:.2f}s; target under 2 s per page: {'met' if worst < 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
