"""bench/ingest: spans per CPU-second, from OTLP protobuf request to rows in the embedded store.

CPU time, not wall time: it is stable on a shared machine and it is what a collector costs.
Measured in one run, on the same requests:
  floor      protobuf alone: ExportTraceServiceRequest.ParseFromString (upb), the parse floor
  baseline   the old path, in-process: Python decode per span -> Arrow -> spool -> Parquet
  pipeline   today's path, in-process: check on arrival -> spool the body (fsync) -> the compiled
             pass decodes the segment (chDB the bodies it leaves) -> Parquet part (stages shown)
  http bulk  the real `ttftscope collect` over HTTP, 2 senders posting big requests; the
             collector's CPU from /proc (all threads) per stored span, counted from after a
             first flush of ~6k spans (its one-time work: see prime()) until it has written
             everything (not its exit), split by thread; its RSS sampled
  http fleet the same collector fed like a fleet of vLLM processes: many senders, each
             posting 20-50 spans every 0.5 s in one write as the plugin does, 40 to 600 of them
             (target: <= 2x the bulk CPU per span), next to the
             floor of that load (bench/http_floor.py: a server that only reads and answers; and
             bench/http_floor.c, the same in C, where a C compiler is found) and of a receiver
             in C that keeps the collector's promise (bench/durable_floor.c: the check, the
             spool, the group commit) as a thread beside the collector's own flusher code
             (bench/native_flusher.py); then the same span rate as the plugin sends it by
             default (80-200 spans every 2 s)

Usage: python bench/ingest.py [--requests 100] [--spans-per-request 500] [--http-seconds 20]
       [--fleet-senders 40,120,300,600]. A 10-minute memory run: --http-seconds 600
       [--fleet-senders 600] (the RSS is printed for every run). Where a fleet's
       request goes (the whole collector, its HTTP handling alone, the floor, the floor in C,
       the receiver's work in C in the flusher's process and in one of its own):
       --fleet-anatomy ROUNDS.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # support/
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402
from ttftscope.collector import otlp_compiled  # noqa: E402
from ttftscope.collector.otlp import accept_protobuf, decode  # noqa: E402
from ttftscope.collector.otlp_sql import warm_up  # noqa: E402
from ttftscope.collector.pipeline import Pipeline  # noqa: E402
from ttftscope.collector.spool import Spool  # noqa: E402
from ttftscope.schemas.store import open_store  # noqa: E402

from support.otlp import plugin_like_request as otlp_request  # noqa: E402
from support.procs import cpu_s, free_port, rss_mb, threads_cpu_s, wait_http  # noqa: E402

PB = {"Content-Type": "application/x-protobuf"}
TARGET = 150_000


def n_spans(body: bytes) -> int:
    r = trace_service_pb2.ExportTraceServiceRequest()
    r.ParseFromString(body)
    return sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans)


def floor(bodies: list[bytes]) -> float:
    c0, n = time.process_time(), 0
    for b in bodies:
        r = trace_service_pb2.ExportTraceServiceRequest()
        r.ParseFromString(b)
        n += sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans)
    return n / (time.process_time() - c0)


def pipeline(bodies: list[bytes], tmp: Path, name: str, old: bool) -> tuple[float, dict]:
    """Spans per CPU-second of this process (chDB's threads included) through a Pipeline."""
    store_dir = str(tmp / f"store-{name}")
    spool = Spool(tmp / f"spool-{name}", segment_bytes=32 << 20)
    p = Pipeline(lambda: open_store(store_dir), spool)
    stages = {"arrival check" if not old else "python decode": 0.0, "spool": 0.0, "flush": 0.0}
    k_in = next(iter(stages))
    c_all, n = time.process_time(), 0
    for b in bodies:
        c = time.process_time()
        if old:
            table, rep = decode(b, "protobuf")
        else:
            body, rep, events_links = accept_protobuf(b)
        stages[k_in] += time.process_time() - c
        c = time.process_time()
        p.submit(table) if old else p.submit_otlp(body, rep.accepted, events_links)
        stages["spool"] += time.process_time() - c
        n += rep.accepted
    c = time.process_time()
    spool.seal()
    p.flush_once()
    stages["flush"] += time.process_time() - c
    cpu = time.process_time() - c_all
    assert open_store(store_dir).query("SELECT count() FROM otel_traces").item() == n
    spool.close()
    return n / cpu, {k: round(v / cpu * 100, 1) for k, v in stages.items()}


#: what each collector stores before its CPU is counted (:func:`prime`): requests x spans, one
#: flush about the size of a fleet run's (~5k spans every 2 s)
PRIME = (12, 500)


def prime(url: str, stored) -> int:
    """Post a flush's worth of spans and wait until ``stored()`` says they are in the store,
    before the CPU is counted. A process's first flush of that size does one-time work (one
    cProfile of it: the Parquet writer's first call ~0.14 s, Arrow's take kernels ~0.12 s):
    0.2-0.3 s of CPU measured for ~5k spans against ~20 ms for each flush after it -- ~5.7 us
    a span of a 15-s fleet run (computed), nothing of a long-running collector's. Returns the
    spans sent."""
    n, size = PRIME
    with requests.Session() as s:
        for i in range(n):
            r = s.post(url + "/v1/traces", data=otlp_request(size, seed=987_654_321 + i), headers=PB, timeout=60)
            r.raise_for_status()
    deadline = time.monotonic() + 60
    while not stored():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: the priming requests were not stored within 60 s")
        time.sleep(0.05)
    return n * size


#: --aged-store: every collector starts on a store whose manifest holds a full insert-token window,
#: as one has after running for hours (a token a flush: 10k in under six hours at 2 s)
AGED = [False]

#: --collect-args: more options for every `ttftscope collect` the bench starts
COLLECT_ARGS: list[str] = []


def age(store_dir: str) -> None:
    """Give a new store the manifest of one that has run for hours (:data:`AGED`): its tokens one by
    one, as a ttftscope before the window's runs (``schemas/store/tokens.py``) kept them; today's
    store reads them as one run, and commits that from its first flush on."""
    st = open_store(store_dir)
    with st._locked() as m:
        sid = "a9ed" * 8  # a spool's tokens as they are: its uuid hex, then the segment's number
        m["tokens"] = [[f"{sid}-{i + 1}", time.time() - 20_000 + i * 2] for i in range(st.token_window)]
        st._write_manifest(m)
    st.close()


class Collector:
    def __init__(self, tmp: Path, name: str, http_only: bool = False) -> None:
        self.port = free_port()
        self.store = str(tmp / f"store-{name}")
        if AGED[0]:
            age(self.store)
        # http_only: bench/http_only.py, the same collector with its check and spool taken out
        cmd = [str(Path(__file__).with_name("http_only.py"))] if http_only else ["-m", "ttftscope"]
        self.proc = subprocess.Popen([sys.executable, *cmd, "collect", "--store", self.store, "--spool",
                                      str(tmp / f"spool-{name}"), "--listen", f"127.0.0.1:{self.port}",
                                      *COLLECT_ARGS],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/healthz", self.proc)
        time.sleep(2.0)  # let start-up (the chDB engine) finish before counting CPU
        self.primed = 0 if http_only else prime(self.url, self.idle)
        self.cpu0 = cpu_s(self.proc.pid)
        self.threads0 = threads_cpu_s(self.proc.pid)
        self.threads: dict[str, float] = {}

    def stop(self) -> tuple[float, int]:
        """(collector CPU seconds since start-up, rows stored). The CPU is read once the
        collector has written everything acknowledged (its queue empty), before SIGTERM: what
        the spans cost, not the process's exit (~0.8 s of the chDB engine's teardown, which
        alone took a quarter of a 20-s fleet run's figure)."""
        pid = self.proc.pid
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not self.idle():
            time.sleep(0.05)
        cpu = cpu_s(pid) - self.cpu0
        self.threads = {k: v - self.threads0.get(k, 0.0) for k, v in threads_cpu_s(pid).items()}
        self.proc.terminate()  # SIGTERM: every acknowledged span is stored (counted below)
        self.proc.wait(120)
        return cpu, open_store(self.store).query("SELECT count() FROM otel_traces").item() - self.primed

    def idle(self) -> bool:
        """Everything acknowledged is in the store."""
        return requests.get(self.url + "/healthz", timeout=10).json()["queue_spans"] == 0


@functools.cache
def compiled(tmp: Path, name: str = "http_floor", flags: tuple[str, ...] = (), out: str | None = None) -> Path | None:
    """bench/NAME.c built with the system's C compiler and ``flags`` (once per ``tmp``), as
    ``out`` (NAME by default); None without a compiler or when it does not build (said once)."""
    exe = tmp / (out or name)
    if not exe.exists():
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            return None
        r = subprocess.run([cc, "-O2", "-o", str(exe), str(Path(__file__).with_name(f"{name}.c")), *flags],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"(bench/{name}.c did not build, its row is left out: {r.stderr.strip()[:300]})")
            return None
    return exe


def compiled_floor(tmp: Path) -> Path | None:
    """bench/http_floor.c built (see :func:`compiled`)."""
    return compiled(tmp)


def compiled_durable(tmp: Path, library: bool = False) -> Path | None:
    """bench/durable_floor.c built (it links zlib for the spool's crc32): a program, or a shared
    library that bench/native_flusher.py runs as a thread of its process."""
    if library:
        return compiled(tmp, "durable_floor", ("-lz", "-shared", "-fPIC", "-DNO_MAIN"), "libdurable_floor.so")
    return compiled(tmp, "durable_floor", ("-lz",))


class FloorServer:
    """bench/http_floor.py (or, ``compiled``, bench/http_floor.c) in a process of its own,
    started and read like :class:`Collector`."""

    def __init__(self, tmp: Path, name: str, compiled: bool = False) -> None:
        self.port = free_port()
        cmd = ([str(compiled_floor(tmp))] if compiled
               else [sys.executable, str(Path(__file__).with_name("http_floor.py"))])
        self.proc = subprocess.Popen([*cmd, str(self.port)])
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/healthz", self.proc)
        time.sleep(0.5)
        self.cpu0 = cpu_s(self.proc.pid)

    def stop(self) -> tuple[float, None]:
        cpu = cpu_s(self.proc.pid) - self.cpu0
        self.proc.kill()
        self.proc.wait(30)
        return cpu, None


class NativeCollector:
    """bench/durable_floor.c (the receiver's work in C: check, spool, group commit) beside
    bench/native_flusher.py (the collector's flusher code storing what it seals): what a
    collector with its receiver outside Python would cost. ``same_process``: the C receiver a
    thread of the flusher's process (as it would be inside the collector), else a process of its
    own. Started and read like :class:`Collector`; its split: the receiver's CPU (its thread's,
    or its process's), the flusher thread's, the rest's."""

    def __init__(self, tmp: Path, name: str, same_process: bool = True) -> None:
        self.port = free_port()
        self.store = str(tmp / f"store-{name}")
        self.spool = tmp / f"spool-{name}"
        self.spool.mkdir()
        flusher = [sys.executable, str(Path(__file__).with_name("native_flusher.py")), str(self.spool), self.store]
        if same_process:
            self.receiver = None
            flusher += ["--receiver", str(compiled_durable(tmp, library=True)), str(self.port)]
        else:
            self.receiver = subprocess.Popen([str(compiled_durable(tmp)), str(self.port), str(self.spool)])
        # Arrow's allocator (mimalloc) without transparent huge pages: beside the C receiver it gave
        # its freed memory back between flushes and took it again as 2-MB pages, each zeroed whole
        # by the kernel (perf on the flusher thread: clear_page_erms 38-40 % of its CPU, under the
        # Parquet writer's page buffers); with them off, 5.9 / 6.6 -> 4.0 / 4.3 us a span (two
        # interleaved pairs). The collector's own flusher, beside its Python receiver, showed no
        # such gain (3.9 / 4.3 against 4.8 / 4.0), so the collector keeps mimalloc's defaults.
        self.flusher = subprocess.Popen(flusher, env={**os.environ, "MIMALLOC_ALLOW_THP": "0"})
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/healthz", self.receiver or self.flusher)
        deadline = time.monotonic() + 120
        while not (self.spool / "flusher.ready").exists():  # (its spool looks for left-overs first)
            if time.monotonic() > deadline or self.flusher.poll() is not None:
                raise RuntimeError("bench/native_flusher.py did not start")
            time.sleep(0.05)
        self.primed = prime(self.url, self.idle)
        self.cpu0 = self._cpu()
        self.split: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def _cpu(self) -> tuple[float, float, float]:
        """CPU seconds of (the receiver: its thread or its process, the flusher thread, the rest)"""
        threads = threads_cpu_s(self.flusher.pid)
        flush = threads.get("ttftscope-flush", 0.0)
        if self.receiver is not None:
            return cpu_s(self.receiver.pid), flush, cpu_s(self.flusher.pid) - flush
        rc = threads.get("c-receiver", 0.0)
        return rc, flush, cpu_s(self.flusher.pid) - rc - flush

    def stop(self) -> tuple[float, int]:
        """As :meth:`Collector.stop`: read once every segment is sealed and stored."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not self.idle():
            time.sleep(0.05)
        self.split = tuple(b - a for a, b in zip(self.cpu0, self._cpu(), strict=True))
        if self.receiver is not None:
            self.receiver.kill()
            self.receiver.wait(30)
        self.flusher.terminate()
        self.flusher.wait(120)
        return sum(self.split), open_store(self.store).query("SELECT count() FROM otel_traces").item() - self.primed

    def idle(self) -> bool:
        """Every segment sealed and stored (the receiver seals 2 s after its last request)."""
        return not any(self.spool.glob("*.open")) and not any(self.spool.glob("*.sealed"))


def where(col: Collector, spans: int, requests_n: int | None = None) -> str:
    """The collector's CPU by thread: the receiver's event loop and the flusher, per span (and
    per request), the rest together."""
    t = col.threads
    parts = {"receiver": t.get("ttftscope-http", 0.0), "flusher": t.get("ttftscope-flush", 0.0)}
    parts["other threads"] = sum(t.values()) - sum(parts.values())
    out = ", ".join(f"{k} {v / spans * 1e6:.1f} us/span" for k, v in parts.items())
    if requests_n:
        out += f"; receiver {parts['receiver'] / requests_n * 1e6:.0f} us/request"
    return out


def http_bulk(bodies: list[bytes], tmp: Path, seconds: float, senders: int = 2) -> tuple[float, float, list[float], str]:
    col = Collector(tmp, "bulk")
    spans_per = [n_spans(b) for b in bodies]
    sent = [0] * senders
    stop = threading.Event()

    def send(k: int) -> None:
        s = requests.Session()
        i = k
        while not stop.is_set():
            r = s.post(col.url + "/v1/traces", data=bodies[i % len(bodies)], headers=PB, timeout=60)
            if r.status_code == 200:
                sent[k] += spans_per[i % len(bodies)]
            i += senders

    rss: list[float] = []
    threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in range(senders)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    while time.perf_counter() - t0 < seconds:
        time.sleep(min(5.0, seconds / 10))
        rss.append(round(rss_mb(col.proc.pid), 1))
    stop.set()
    for t in threads:
        t.join()
    cpu, n = col.stop()
    assert n == sum(sent), (n, sum(sent))
    return n / cpu, n / (time.perf_counter() - t0), rss, where(col, n)


async def _fleet_send(url: str, plans: list[list[tuple[int, bytes]]], every_s: float,
                      seconds: float, sample=None) -> tuple[list[int], list[int]]:
    """Each sender a coroutine on one event loop with a keep-alive connection of its own, posting
    its next request every ``every_s`` (out of phase, as real processes are): (spans acknowledged,
    requests acknowledged) a sender. The request is one write of bytes built beforehand, as
    http.client sends a body given as bytes, so that hundreds of senders on the two shared cores
    keep their rate (``requests`` in a thread each fell behind at 300: 460 requests/s of 600).
    ``sample``: called every 5 s while they send (the collector's RSS)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sent, reqs = [0] * len(plans), [0] * len(plans)
    end = time.monotonic() + seconds

    async def send(k: int) -> None:
        rng = random.Random(k)
        await asyncio.sleep(rng.uniform(0, every_s))
        reader, writer = await asyncio.open_connection(host, int(port))
        i = 0
        while time.monotonic() < end:
            n, body = plans[k][i % len(plans[k])]
            i += 1
            writer.write(b"POST /v1/traces HTTP/1.1\r\nHost: %s\r\nContent-Type: application/x-protobuf\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            if head[9:12] == b"200":
                sent[k] += n
                reqs[k] += 1
            await asyncio.sleep(max(0.0, min(every_s, end - time.monotonic())))
        writer.close()

    async def every_5s() -> None:
        while time.monotonic() < end - 2.5:
            await asyncio.sleep(min(5.0, end - time.monotonic()))
            sample()

    await asyncio.gather(*(send(k) for k in range(len(plans))), *([every_5s()] if sample else []))
    return sent, reqs


def http_fleet(tmp: Path, seconds: float, senders: int, every_s: float = 0.5,
               sizes: tuple[int, int] = (20, 50), name: str = "fleet",
               floor: str | None = None, http_only: bool = False,
               native: str | None = None, rss: list[float] | None = None) -> tuple[float, float, float, str]:
    """(spans per collector CPU-second, spans/s offered, requests/s, CPU by thread) with many
    small senders, each posting ``sizes`` spans every ``every_s``. ``floor``: the same senders
    against a floor server instead (its CPU per request in the last place), ``"python"``
    bench/http_floor.py or ``"c"`` bench/http_floor.c; ``http_only``:
    against bench/http_only.py (the collector's HTTP handling alone, nothing stored); ``native``:
    against :class:`NativeCollector` (the receiver's work in C beside the collector's flusher),
    ``"thread"`` in the flusher's process or ``"process"`` of its own. ``rss``: the collector's RSS
    (MB) appended every 5 s."""
    # each sender's requests built before the clock starts, as the bulk case's are, so that the
    # senders spend their time on the two shared cores posting, not building protobuf (within this
    # bench, interleaved: 24.6 / 24.6k spans per CPU-second built during the run against 24.6 /
    # 26.7k built before - no clear difference; a larger one seen first was the store's merges
    # falling outside a run whose load started later)
    plans = []
    for k in range(senders):
        rng = random.Random(k)
        # (at most 64 a sender, then again from the first: a 10-minute run of 600 senders would
        # otherwise hold 700k requests, ~6 GB; the collector stores repeated spans as any others)
        counts = [rng.randint(*sizes) for _ in range(min(int(seconds / every_s) + 4, 64))]
        plans.append([(n, otlp_request(n, seed=k * 1_000_000 + i)) for i, n in enumerate(counts)])

    if native:
        col = NativeCollector(tmp, name, same_process=native == "thread")
    elif floor:
        col = FloorServer(tmp, name, compiled=floor == "c")
    else:
        col = Collector(tmp, name, http_only=http_only)
    t0 = time.perf_counter()
    sample = (lambda: rss.append(round(rss_mb(col.proc.pid), 1))) if rss is not None else None
    sent, reqs = asyncio.run(_fleet_send(col.url, plans, every_s, seconds, sample))
    dt = time.perf_counter() - t0
    cpu, n = col.stop()
    if floor:
        n = sum(sent)
        return n / cpu, n / dt, sum(reqs) / dt, f"{cpu / sum(reqs) * 1e6:.0f} us/request"
    if not http_only:  # (http_only stores nothing: per span sent)
        assert n == sum(sent), (n, sum(sent))
    n = sum(sent)
    if native:
        (rc, fc, other), nreq = col.split, sum(reqs)
        return (n / cpu, n / dt, nreq / dt, f"receiver in C {rc / n * 1e6:.1f} us/span, flusher {fc / n * 1e6:.1f} "
                f"us/span, the rest {other / n * 1e6:.1f} us/span; receiver {rc / nreq * 1e6:.0f} us/request")
    return n / cpu, n / dt, sum(reqs) / dt, where(col, n, sum(reqs))


def anatomy(rounds: int, seconds: float, senders: int) -> None:
    """CPU per fleet request: the whole collector, its HTTP handling alone, the floor servers, the
    receiver's work in C (beside the flusher code, in its process and in one of its own)."""
    print(f"fleet anatomy: {senders} senders x 20-50 spans every 0.5 s, {seconds:.0f} s each, "
          f"CPU per request of the receiving process (interleaved, {rounds} rounds)")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(rounds):
            fw, _, rps, split = http_fleet(tmp, seconds, senders, name=f"whole{r}")
            print(f"  whole collector        {split}   ({rps:.0f} requests/s; {fw:,.0f} spans per CPU-second)",
                  flush=True)
            _, _, rps, split = http_fleet(tmp, seconds, senders, name=f"http{r}", http_only=True)
            print(f"  HTTP handling alone    {split.split('; ')[-1]} (bench/http_only.py: no check, nothing kept)",
                  flush=True)
            _, _, rps, per_req = http_fleet(tmp, seconds, senders, name=f"floor{r}", floor="python")
            print(f"  floor server           {per_req} (bench/http_floor.py)", flush=True)
            if compiled_floor(tmp) is not None:
                _, _, rps, per_req = http_fleet(tmp, seconds, senders, name=f"cfloor{r}", floor="c")
                print(f"  floor server, in C     {per_req} (bench/http_floor.c)", flush=True)
            if compiled_durable(tmp) is not None and compiled_durable(tmp, library=True) is not None:
                for where_, label in (("thread", "in-process"), ("process", "own process")):
                    fn, _, rps, split = http_fleet(tmp, seconds, senders, name=f"native-{where_}{r}", native=where_)
                    print(f"  receiver's work in C, {label:<11} {split} (bench/durable_floor.c: check, spool, group "
                          f"commit; the collector's flusher code beside it: {fn:,.0f} spans per CPU-second in all)",
                          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--spans-per-request", type=int, default=500)
    ap.add_argument("--http-seconds", type=float, default=20)
    ap.add_argument("--fleet-senders", default="40,120,300,600", metavar="N[,N...]",
                    help="the fleet's sizes, each a run (default 40,120,300,600: 2.6k to 37k spans/s measured; a vLLM "
                         "server exports from an API server, an engine core and a worker a GPU); the floor rows "
                         "at the first")
    ap.add_argument("--aged-store", action="store_true",
                    help="every collector on a store whose manifest holds a full insert-token window, as after hours")
    ap.add_argument("--fleet-anatomy", type=int, default=0, metavar="ROUNDS",
                    help="only the fleet, taken apart: the whole collector, its HTTP handling alone "
                         "(bench/http_only.py), the floor server (in Python and in C) and the receiver's "
                         "work in C (bench/durable_floor.c), interleaved, ROUNDS times")
    ap.add_argument("--collect-args", default="", metavar="'ARGS'",
                    help="more options for every `ttftscope collect` started, e.g. '--commit-window 0.2'")
    a = ap.parse_args()
    AGED[0] = a.aged_store
    COLLECT_ARGS[:] = a.collect_args.split()
    fleet = [int(n) for n in a.fleet_senders.split(",")]
    first = fleet[0]
    if a.fleet_anatomy:
        return anatomy(a.fleet_anatomy, a.http_seconds, first)
    bodies = [otlp_request(a.spans_per_request, seed=i) for i in range(a.requests)]
    total = a.requests * a.spans_per_request
    print(f"{a.requests} OTLP requests x {a.spans_per_request} spans = {total} spans, "
          f"{sum(map(len, bodies)) / 1e6:.1f} MB protobuf; figures are spans per CPU-second")
    warm_up()
    print("arrival check and flush decode: "
          + ("compiled (numba)" if otlp_compiled.warm_up() else "Python per span and chDB (no numba)"))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        f = floor(bodies)
        print(f"floor      protobuf ParseFromString only            {f:>10,.0f}")
        b, bst = pipeline(bodies, tmp, "baseline", old=True)
        print(f"baseline   python decode + spool + Parquet           {b:>10,.0f}   time share %: {bst}")
        p, st = pipeline(bodies, tmp, "pipeline", old=False)
        print(f"pipeline   check + spool + decode + Parquet          {p:>10,.0f}   = {p / b:.2f} x baseline"
              f"   time share %: {st}")
        h, wall, rss, split = http_bulk(bodies, tmp, a.http_seconds)
        print(f"http bulk  `ttftscope collect`, 2 senders            {h:>10,.0f}   = {h / b:.2f} x baseline"
              f"   ({wall:,.0f} spans/s wall, senders on the same {os.cpu_count()} cores)")
        print(f"           collector RSS (MB) sampled over {a.http_seconds:.0f}s: {rss}")
        print(f"           CPU by thread: {split}")
        ratios = []
        for n in fleet:
            rss = []
            fl, offered, rps, fsplit = http_fleet(tmp, a.http_seconds, n, name=f"fleet{n}", rss=rss)
            ratios.append((n, h / fl, offered))
            print(f"http fleet {n:>4} senders x 20-50 spans every 0.5 s  {fl:>10,.0f}   "
                  f"= {h / fl:.2f} x the bulk CPU per span   ({offered:,.0f} spans/s, {rps:.0f} requests/s)")
            print(f"           CPU by thread: {fsplit}; collector RSS (MB) every 5 s: {rss}")
        print(f"           (the rows below: {first} senders)")
        ff, _, _, per_req = http_fleet(tmp, a.http_seconds, first, name="floor", floor="python")
        print(f"           floor: a server that only reads each request and answers 200 (bench/http_floor.py), "
              f"same senders: {ff:,.0f} spans per CPU-second = {h / ff:.2f} x the bulk CPU per span ({per_req})")
        if compiled_floor(tmp) is not None:
            fc, _, _, per_req = http_fleet(tmp, a.http_seconds, first, name="cfloor", floor="c")
            print(f"           the same floor in C (bench/http_floor.c: epoll, one thread): {fc:,.0f} spans per "
                  f"CPU-second = {h / fc:.2f} x the bulk CPU per span ({per_req})")
        if compiled_durable(tmp, library=True) is not None:
            fn, _, _, nsplit = http_fleet(tmp, a.http_seconds, first, name="native", native="thread")
            print(f"           the receiver's work in C (bench/durable_floor.c: check, spool, group commit), a thread "
                  f"beside the collector's flusher code (bench/native_flusher.py): {fn:,.0f} spans per CPU-second = "
                  f"{h / fn:.2f} x the bulk CPU per span ({nsplit})")
        # the same span rate shaped as the plugin now sends it (OTEL_BSP_SCHEDULE_DELAY's default, 2 s): not the target's shape
        f2, offered2, rps2, fsplit2 = http_fleet(tmp, a.http_seconds, first, every_s=2.0, sizes=(80, 200),
                                                 name="fleet-2s")
        print(f"http fleet {first:>4} senders x 80-200 spans every 2 s    {f2:>10,.0f}   "
              f"= {h / f2:.2f} x the bulk CPU per span   ({offered2:,.0f} spans/s, {rps2:.0f} requests/s; "
              f"the plugin's default export interval)")
        print(f"           CPU by thread: {fsplit2}")
        print(f"target >= {TARGET:,} spans per CPU-second end to end over HTTP: "
              f"{'met' if h >= TARGET else 'NOT met'} ({h / TARGET:.2f} x target); "
              "fleet <= 2x bulk CPU per span: "
              + "; ".join(f"{n} senders ({o:,.0f} spans/s) {'met' if r <= 2 else 'NOT met'} ({r:.2f} x)"
                          for n, r, o in ratios))


if __name__ == "__main__":
    main()
