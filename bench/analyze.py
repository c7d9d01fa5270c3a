"""bench/analyze: `ttftscope analyze` on 10k .. 1M requests (~10 spans each) in the embedded store.

For each size: a fresh store filled by the synthetic generator (queue-surge scenario), then
the full `ttftscope analyze --json` in a child process: wall time and peak RSS. Baseline
measured in the same run: a straightforward pandas implementation of the same decomposition
(spans to a DataFrame, then per request: clip to the TTFT window and sweep by phase
priority), run on the sizes where it finishes in reasonable time; the ratio is reported at
equal size. Targets: 1M requests under 60 s with peak memory under 6 GiB; >= 10x pandas.

Usage: python bench/analyze.py [--sizes 10000,100000,1000000] [--pandas-max 100000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
from ttftscope.analyzer import synth
from ttftscope.analyzer.window import Window
from ttftscope.schemas.phases import GAP_SWEEP, SWEPT
from ttftscope.schemas.sql import in_list
from ttftscope.schemas.store import open_store
from ttftscope.schemas.vocabulary import Attr, SpanName

#: our per-request phase spans and their sweep priority, from the phase registry
PRIO = {name: p.sweep for p in SWEPT if p.name != "load" for name in p.spans}


def pandas_decompose(store, window: Window):
    """The straightforward way: pull spans into pandas, loop over requests."""
    w = window.params()
    req = store.query(
        "SELECT TraceId, toUnixTimestamp64Nano(Timestamp) AS t0, "
        f"toInt64(round(toFloat64OrZero(SpanAttributes['{Attr.VLLM_TTFT}']) * 1e9)) AS ttft "
        f"FROM otel_traces WHERE SpanName = '{SpanName.REQUEST}' AND Timestamp >= fromUnixTimestamp64Nano({{since:Int64}}) "
        "AND Timestamp < fromUnixTimestamp64Nano({until:Int64})", w).to_pandas()
    spans = store.query(
        "SELECT TraceId, SpanName, toUnixTimestamp64Nano(Timestamp) AS s, toInt64(Duration) AS d "
        f"FROM otel_traces WHERE SpanName IN ({in_list(PRIO)}) "
        "AND Timestamp >= fromUnixTimestamp64Nano(toInt64({since:Int64} - 60000000000)) "
        "AND Timestamp < fromUnixTimestamp64Nano(toInt64({until:Int64} + 600000000000))", w).to_pandas()
    spans["prio"] = spans["SpanName"].map(PRIO)
    spans = spans.merge(req, on="TraceId")
    out = []
    for tid, g in spans.groupby("TraceId"):
        t0, ttft = g["t0"].iloc[0], g["ttft"].iloc[0]
        iv = [(p, min(max(s - t0, 0), ttft), min(max(s + d - t0, 0), ttft)) for p, s, d in zip(g["prio"], g["s"], g["d"], strict=True)]
        b = sorted({0, ttft, *[x[1] for x in iv], *[x[2] for x in iv]})
        acc = dict.fromkeys([*PRIO.values(), GAP_SWEEP], 0)
        for a, c in zip(b, b[1:], strict=False):
            p = min([x[0] for x in iv if x[1] <= a and x[2] >= c], default=GAP_SWEEP)
            acc[p] += c - a
        out.append((tid, ttft, acc))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--pandas-max", type=int, default=100_000)
    ap.add_argument("--scenario", default="queue-surge")
    a = ap.parse_args()
    print(f"{'requests':>10} {'spans':>12} {'fill s':>8} {'analyze s':>10} {'peak RSS MB':>12} {'pandas s':>10} {'ratio':>7}")
    for n in [int(x) for x in a.sizes.split(",")]:
        d = tempfile.mkdtemp(prefix="ttftscope-bench-")
        st = open_store(d)
        t = time.perf_counter()
        synth.write(st, a.scenario, n, seed=1, chunk=100_000)
        st.maintain()
        fill = time.perf_counter() - t
        spans = st.query("SELECT count() FROM otel_traces").item()
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "ttftscope", "analyze", "--store", d, "--last", "30d", "--json"],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        rep = json.loads(r.stdout)
        assert rep["requests"] == n, (rep.get("requests"), n, r.stderr[-500:])
        pd_s = ratio = float("nan")
        if n <= a.pandas_max:
            t = time.perf_counter()
            res = pandas_decompose(st, Window.last(30 * 86400))
            pd_s = time.perf_counter() - t
            assert len(res) == n
            ratio = pd_s / wall
        note = "" if peak > before / 1024 else " (peak from an earlier size)"
        print(f"{n:>10,} {spans:>12,} {fill:>8.1f} {wall:>10.1f} {peak:>12,.0f} {pd_s:>10.1f} {ratio:>7.1f}{note}", flush=True)
    print("targets: 1M requests under 60 s, peak under 6 GiB; ratio >= 10x the pandas baseline")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
