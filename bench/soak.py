"""bench/soak: nothing acknowledged is lost over a long run with restarts and store outages.

Senders post OTLP batches continuously (keep-alive, every span id unique) to a real
`ttftscope collect`; at random intervals the collector is stopped with SIGTERM or killed
with kill -9 and started again on the same spool, and (``--store clickhouse``) the store
server goes away for a while and comes back. At the end every span that got a 200 must be in
the store exactly once. Reports acknowledged vs stored, duplicates, restarts, outages and
the collector's peak RSS per life.

Usage: python bench/soak.py [--minutes 10] [--store embedded|clickhouse] [--senders 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.otlp import Sender  # noqa: E402
from support.procs import ClickHouseFixture, CollectorProc, free_port, ttftscope_sql  # noqa: E402


def _hwm_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--store", choices=["embedded", "clickhouse"], default="embedded")
    ap.add_argument("--senders", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ch = None
        if a.store == "clickhouse":
            ch = ClickHouseFixture(tmp / "ch", port=free_port()).start()
            store = ch.url("soak")
        else:
            store = str(tmp / "store")
        col = CollectorProc(store, tmp / "spool", port=free_port(), flush_interval=0.3).start()
        senders = [Sender(col.url, per_batch=50, start_at=k * 1_000_000) for k in range(a.senders)]
        for s in senders:
            s.start()
        end = time.monotonic() + a.minutes * 60
        restarts = {"sigterm": 0, "kill9": 0}
        outages, peaks, exit_codes = 0, [], []
        while time.monotonic() < end:
            time.sleep(rng.uniform(10, 40))
            if time.monotonic() >= end:
                break
            what = rng.choice(["sigterm", "kill9", "outage"] if ch else ["sigterm", "kill9"])
            peaks.append(_hwm_mb(col.proc.pid))
            if what == "outage":
                ch.stop()
                outages += 1
                time.sleep(rng.uniform(3, 12))
                ch = ClickHouseFixture(tmp / "ch", port=ch.port).start()
            elif what == "sigterm":
                col.proc.send_signal(signal.SIGTERM)
                exit_codes.append(col.proc.wait(120))
                col._logf.close()
                restarts["sigterm"] += 1
                col.start()
            else:
                col.kill9()
                restarts["kill9"] += 1
                col.start()
            print(f"{time.strftime('%H:%M:%S')} {what}; acknowledged so far "
                  f"{sum(len(s.acked) for s in senders):,}", flush=True)
        for s in senders:
            s.stop.set()
        for s in senders:
            s.join(30)
        peaks.append(_hwm_mb(col.proc.pid))
        rc = col.terminate(timeout=300)
        acked = set().union(*(s.acked for s in senders))
        rows = ttftscope_sql(store, "SELECT SpanId, count() AS n FROM otel_traces WHERE ServiceName = 'dur' "
                                    "GROUP BY SpanId")
        stored = {r["SpanId"] for r in rows}
        dups = sum(int(r["n"]) - 1 for r in rows)
        lost = len(acked - stored)
        if ch:
            ch.stop()
        print(f"\n{a.minutes:g} min, store {a.store}: {restarts['sigterm']} SIGTERM + {restarts['kill9']} kill -9 "
              f"restarts, {outages} store outages, {sum(s.refused for s in senders)} requests refused (429/503, "
              f"retried by the senders)")
        print(f"acknowledged {len(acked):,} spans, stored {len(stored):,}: lost {lost}, duplicated {dups}, "
              f"not acknowledged but stored {len(stored - acked)} (in flight when the collector died)")
        print(f"collector peak RSS per life: {', '.join(f'{p:.0f}' for p in peaks)} MB; final exit code {rc}; "
              f"SIGTERM exit codes {exit_codes}")
        return 0 if lost == 0 and dups == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
