"""bench/ingest: spans/s from OTLP protobuf request to rows in the embedded store.

Three measurements in one run, on the same requests:
  floor      protobuf alone: ExportTraceServiceRequest.ParseFromString (the decode floor)
  pipeline   one core, in-process: decode -> Arrow -> spool (fsync) -> flush to Parquet parts
  http       the real `ttftscope collect` process fed over HTTP by concurrent senders, timed
             until the rows are queryable; its RSS is sampled throughout (memory stays flat?)

Usage: python bench/ingest.py [--requests 200] [--spans-per-request 500] [--http-seconds 30]
A 10-minute memory run: --http-seconds 600.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
from common import otlp_request, rss_mb  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402
from ttftscope.collector.otlp import decode  # noqa: E402
from ttftscope.collector.pipeline import Pipeline  # noqa: E402
from ttftscope.collector.spool import Spool  # noqa: E402
from ttftscope.schemas.store import open_store  # noqa: E402


def floor(bodies: list[bytes]) -> float:
    t0 = time.perf_counter()
    n = 0
    for b in bodies:
        r = trace_service_pb2.ExportTraceServiceRequest()
        r.ParseFromString(b)
        n += sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans)
    return n / (time.perf_counter() - t0)


def pipeline(bodies: list[bytes], tmp: Path) -> tuple[float, dict]:
    store_dir = str(tmp / "store-pipeline")
    spool = Spool(tmp / "spool-pipeline", segment_bytes=32 << 20)
    p = Pipeline(lambda: open_store(store_dir), spool)
    t0 = time.perf_counter()
    n = 0
    stages = {"decode": 0.0, "spool": 0.0, "store": 0.0}
    for b in bodies:
        t = time.perf_counter()
        table, _ = decode(b, "protobuf")
        stages["decode"] += time.perf_counter() - t
        t = time.perf_counter()
        p.submit(table)
        stages["spool"] += time.perf_counter() - t
        n += table.num_rows
    t = time.perf_counter()
    spool.seal()
    p.flush_once()
    stages["store"] += time.perf_counter() - t
    dt = time.perf_counter() - t0
    st = open_store(store_dir)
    assert st.query("SELECT count() FROM otel_traces").item() == n
    spool.close()
    return n / dt, {k: round(v / dt * 100, 1) for k, v in stages.items()}


def http(bodies: list[bytes], tmp: Path, seconds: float, senders: int = 2) -> tuple[float, list[float]]:
    port = 43000 + os.getpid() % 1000
    store_dir = str(tmp / "store-http")
    proc = subprocess.Popen([sys.executable, "-m", "ttftscope", "collect", "--store", store_dir, "--spool",
                             str(tmp / "spool-http"), "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            requests.get(url + "/healthz", timeout=1)
            break
        except requests.RequestException:
            time.sleep(0.1)
    sent = [0] * senders
    stop = threading.Event()

    def send(k: int) -> None:
        s = requests.Session()
        i = k
        while not stop.is_set():
            b = bodies[i % len(bodies)]
            r = s.post(url + "/v1/traces", data=b, headers={"Content-Type": "application/x-protobuf"}, timeout=30)
            if r.status_code == 200:
                sent[k] += spans_per[i % len(bodies)]
            i += senders

    spans_per = []
    for b in bodies:
        r = trace_service_pb2.ExportTraceServiceRequest()
        r.ParseFromString(b)
        spans_per.append(sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans))
    rss = []
    threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in range(senders)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while time.perf_counter() - t0 < seconds:
        time.sleep(min(5.0, seconds / 10))
        rss.append(round(rss_mb(proc.pid), 1))
    stop.set()
    for t in threads:
        t.join()
    proc.terminate()  # SIGTERM flushes everything acknowledged
    proc.wait(120)
    dt = time.perf_counter() - t0
    n = open_store(store_dir).query("SELECT count() FROM otel_traces").item()
    assert n == sum(sent), (n, sum(sent))
    return n / dt, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--spans-per-request", type=int, default=500)
    ap.add_argument("--http-seconds", type=float, default=30)
    a = ap.parse_args()
    bodies = [otlp_request(a.spans_per_request, seed=i) for i in range(a.requests)]
    total = a.requests * a.spans_per_request
    print(f"{a.requests} OTLP requests x {a.spans_per_request} spans = {total} spans, "
          f"{sum(map(len, bodies)) / 1e6:.1f} MB protobuf")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        f = floor(bodies)
        print(f"floor    protobuf ParseFromString only        {f:>12,.0f} spans/s (1 core)")
        p, stages = pipeline(bodies, tmp)
        print(f"pipeline decode+spool(fsync)+Parquet, 1 core   {p:>12,.0f} spans/s  = {p / f:.3f} x floor"
              f"   time share %: {stages}")
        h, rss = http(bodies, tmp, a.http_seconds)
        print(f"http     `ttftscope collect`, 2 senders        {h:>12,.0f} spans/s  = {h / f:.3f} x floor"
              f"   (collector + senders share {os.cpu_count()} cores)")
        print(f"collector RSS (MB) sampled over {a.http_seconds:.0f}s: {rss}")
        target = 50_000
        print(f"target >= {target:,} spans/s end to end on one core: "
              f"{'met' if p >= target else 'NOT met'} ({p / target:.2f} x target)")


if __name__ == "__main__":
    main()
