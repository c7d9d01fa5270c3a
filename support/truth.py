"""The truth harness on real vLLM: a server with a planted cause (or none), driven by a client
that times every request itself, and the report read back.

The client: streaming, until the first SSE chunk carrying a token has arrived; non-streaming,
until the whole response has. Faults are planted by the test-only vLLM plugin in tests/planted
(never shipped). Used by tests/truth/ and bench/truth.py.
"""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import threading
import time
from pathlib import Path

import polars as pl
from ttftscope.analyzer.decompose import decompose
from ttftscope.analyzer.window import Window
from ttftscope.schemas.store import open_store

from ttftscope.tinymodel import prompt_of

from .procs import PY, ROOT, CollectorProc, VllmServer

PLANTED = ROOT / "tests" / "planted"  # the test-only vLLM plugin that plants a fault of a given size
STALL_MS = 25.0
TOKENIZE_US_PER_TOKEN = 1000.0  # a slow tokenizer: ~80 ms at the driven prompts' median
ALLREDUCE_MS = 6.0  # planted on every tensor-parallel all-reduce (tests/planted)
SHARED = prompt_of(300, 999)


def client_ttft(port: int, model: str, prompt: str, stream: bool, chat: bool = False) -> tuple[float, str]:
    """(seconds from sending the request to the first token in hand, response id)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": 4, "stream": stream}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    if not stream:
        doc = json.loads(resp.read())
        t = time.perf_counter() - t0
        conn.close()
        return t, doc["id"]
    while True:
        line = resp.readline()
        assert line, "stream ended before a token"
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        doc = json.loads(line[6:])
        ch = doc["choices"][0] if doc.get("choices") else {}
        if ch.get("text") or (ch.get("delta") or {}).get("content") or ch.get("finish_reason"):
            t = time.perf_counter() - t0
            resp.read()
            conn.close()
            return t, doc["id"]


def drive(srv: VllmServer, shared: bool = False) -> list[dict]:
    srv.completion("warm up", 2)
    srv.stream("warm up the stream", 2)
    for stream in (True, False):  # the client's own first calls too (kept out of the comparison)
        client_ttft(srv.port, srv.model, "warm up the client", stream)
    out = []
    for i in range(24):
        stream, chat = i % 3 != 2, i % 4 == 3
        # shared: every other prompt starts with the same 300 tokens (a system prompt)
        prompt = (SHARED + " " if shared and i % 2 == 0 else "") + prompt_of(40 + 20 * (i % 5), 100 + i)
        t, rid = client_ttft(srv.port, srv.model, prompt, stream, chat)
        out.append({"rid": rid, "client_ms": t * 1e3, "stream": stream, "shared": shared and i % 2 == 0})
        time.sleep(0.05)
    return out


def drive_long(srv: VllmServer, words: int = 900, n: int = 16) -> list[dict]:
    """Long prompts (``words`` words, about as many tokens), one at a time, streaming: the load
    of the prefill-budget scenario (compare a small and a large ``--max-num-batched-tokens``)."""
    srv.completion("warm up", 2)
    for stream in (True, False):
        client_ttft(srv.port, srv.model, "warm up the client", stream)
    client_ttft(srv.port, srv.model, prompt_of(words, 5), True)  # a long one too: its first compile
    out = []
    for i in range(n):
        t, rid = client_ttft(srv.port, srv.model, prompt_of(words, 700 + i), True)
        out.append({"rid": rid, "client_ms": t * 1e3, "stream": True})
        time.sleep(0.05)
    return out


def drive_busy(srv: VllmServer, bg_tokens: int = 40, n: int = 16, clients: int = 2) -> list[dict]:
    """Measured requests at random moments while ``clients`` other clients keep the engine
    decoding (each streams ``bg_tokens``-token completions back to back)."""
    srv.completion("warm up", 2)
    for stream in (True, False):
        client_ttft(srv.port, srv.model, "warm up the client", stream)
    stop, errors = threading.Event(), []

    def background() -> None:  # streaming clients (a non-streaming one's TTFT is its whole response)
        try:  # exactly bg_tokens each: a random-weights model may pick its end-of-sequence token early
            while not stop.is_set():
                srv.stream(prompt_of(30, random.randrange(1000)), max_tokens=bg_tokens, ignore_eos=True)
        except Exception as e:  # noqa: BLE001 - reported below: a dead client would make the load lighter
            errors.append(repr(e))

    bg = [threading.Thread(target=background, daemon=True) for _ in range(clients)]
    for t in bg:
        t.start()
    time.sleep(1.0)
    rng = random.Random(7)
    out = []
    try:
        for i in range(n):
            time.sleep(rng.uniform(0.0, 0.08))
            t, rid = client_ttft(srv.port, srv.model, prompt_of(30, 300 + i), True)
            out.append({"rid": rid, "client_ms": t * 1e3, "stream": True})
    finally:
        stop.set()
        for t in bg:
            t.join(60)
    assert not errors, f"a background client failed: {errors}"
    return out


def drive_switched(srv: VllmServer, flag: Path, n: int = 16) -> list[dict]:
    """The same requests (60-token prompts, streaming, one at a time) twice: ``part`` "clean",
    then "slowed" once ``flag`` exists (a planted fault switched on mid-run: one server, its
    own baseline); each row has its part's ``since`` and ``until`` (epoch seconds)."""
    srv.completion("warm up", 2)
    for stream in (True, False):
        client_ttft(srv.port, srv.model, "warm up the client", stream)
    out = []
    for part in ("clean", "slowed"):
        if part == "slowed":
            flag.touch()
            time.sleep(0.5)
        since, rows = time.time(), []
        for i in range(n):
            t, rid = client_ttft(srv.port, srv.model, prompt_of(60, 500 + i), True)
            rows.append({"rid": rid, "client_ms": t * 1e3, "stream": True, "part": part, "since": since})
            time.sleep(0.05)
        until = time.time()
        out += [{**r, "until": until} for r in rows]
    return out


def served(tmp: Path, name: str, env: dict | None = None, drive=drive, extra: list[str] | None = None, **server):
    # the collector shares the two cores with vLLM and the client: at its production flush
    # interval and a lower priority its flush queries do not land inside the requests timed here
    col = CollectorProc(str(tmp / "store"), tmp / "spool", flush_interval=2.0, nice=10).start()
    try:
        srv = VllmServer(tmp, col.url + "/v1/traces", run=name, env=env, extra=extra, **server).start()
        try:
            seen = drive(srv)
            col.wait_quiet()
        finally:
            srv.stop()
    finally:
        assert col.terminate() == 0
    df = decompose(open_store(col.store, create=False), Window.last(3600, run=name))
    mine = pl.DataFrame(seen)
    # the decomposition's request id is the engine's (a -0 suffix on completions)
    df = df.with_columns(pl.col("request_id").str.replace(r"-\d+$", "").alias("rid"))
    joined = mine.join(df, on="rid", how="left")
    assert joined["ttft"].null_count() == 0, "every client request is in the report"
    return joined, col.store


def analyze(store: str, run: str, since: float | None = None, until: float | None = None) -> dict:
    """The report on ``run`` (over the last hour, or ``since``..``until``, epoch seconds) as JSON."""
    window = ["--last", "1h"] if since is None else ["--since", str(since), "--until", str(until or time.time())]
    r = subprocess.run([PY, "-m", "ttftscope", "analyze", "--store", store, *window, "--json", "--quiet",
                        "--run", run, "--slo", "p50=5000,p95=10000,p99=20000"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
