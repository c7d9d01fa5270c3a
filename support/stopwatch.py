"""The client's stopwatch, in a process of its own that the CPU scheduler serves first.

On a machine where vLLM keeps every core busy (its engine loop and the CPU worker's threads
never sleep while requests run), a client timing requests at normal priority waits for a
CPU between sending a request and reading its answer: its stopwatch then measures its own
wait on a run queue, not the server (README: how long, under which load). A witness must not
depend on that.

This process asks for real-time scheduling (``SCHED_FIFO``; it blocks on sockets and uses
~1 ms of CPU a request, so it cannot hog a core), else a raised priority (``nice -15``),
else runs as it is and says so. Every answer carries how long the process waited for a CPU
during that request (``/proc/self/schedstat``), so a test can check its witness.

Protocol (one JSON object per line): the parent writes ``{"port", "model", "prompt",
"stream", "chat", "max_tokens", "ignore_eos", "cache_salt"}``; this process answers ``{"s": seconds to the
first token in hand, "rid", "cpu_wait_ms"}`` or ``{"error": ...}``; ``{"burst": [queries]}``
sends them all at once (a query's ``after_s``: that many seconds after the others) and answers
``{"burst": [answers]}``. The first line it writes says how it is
scheduled: ``{"scheduling": "fifo" | "nice" | "normal"}``. ``--load PORT MODEL MAX_TOKENS`` runs a
background client at the same priority instead; it writes ``loaded`` once its first completion
has been served, so a parent can start timing when the load is really there.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time


def _prioritize() -> str:
    """Real-time (nothing at normal priority delays it), else a raised nice: the stopwatch and
    the background load clients alike. (Measured here: load clients at nice -10 left seats
    free, as starved clients do; real-time below the stopwatch, they took the CPU from vLLM's
    engine loop while requests waited, which the report rightly called scheduling bubbles.)"""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
        return "fifo"
    except (OSError, AttributeError):
        pass
    try:
        os.nice(-15)
        return "nice"
    except OSError:
        return "normal"


def _cpu_wait_ms() -> float:
    try:
        with open("/proc/self/schedstat") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


def first_token(port: int, model: str, prompt: str, stream: bool, chat: bool = False,
                max_tokens: int = 4, ignore_eos: bool = False, cache_salt: str | None = None) -> tuple[float, str]:
    """(seconds from sending the request to the first token in hand, response id): streaming,
    until the first SSE chunk carrying text (or a finish), then the rest is read to the end
    (the request keeps its seat until it is done); non-streaming, the whole response."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if ignore_eos:
        body["ignore_eos"] = True
    if cache_salt:  # vLLM's prefix cache keeps requests with different salts apart
        body["cache_salt"] = cache_salt
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    if not stream:
        doc = json.loads(resp.read())
        t = time.perf_counter() - t0
        conn.close()
        return t, doc["id"]
    while True:
        line = resp.readline()
        if not line:
            raise RuntimeError("stream ended before a token")
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        doc = json.loads(line[6:])
        ch = doc["choices"][0] if doc.get("choices") else {}
        if ch.get("text") or (ch.get("delta") or {}).get("content") or ch.get("finish_reason"):
            t = time.perf_counter() - t0
            resp.read()
            conn.close()
            return t, doc["id"]


def _timed(q: dict) -> dict:
    try:
        if q.get("after_s"):  # (a burst's request sent this long after the others; its clock starts then)
            time.sleep(q["after_s"])
        w0 = _cpu_wait_ms()
        s, rid = first_token(q["port"], q["model"], q["prompt"], q["stream"], q.get("chat", False),
                             q.get("max_tokens", 4), q.get("ignore_eos", False), q.get("cache_salt"))
        return {"s": s, "rid": rid, "cpu_wait_ms": _cpu_wait_ms() - w0}
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the drive
        return {"error": repr(e)}


def load(port: int, model: str, max_tokens: int) -> None:
    """``--load``: a background client at the same priority, streaming completions of exactly
    ``max_tokens`` tokens back to back (30-word prompts) until it is terminated: load that a
    starved client would make lighter than asked."""
    import random

    from ttftscope.tinymodel import prompt_of

    _prioritize()
    rng = random.Random(os.getpid())
    first_token(port, model, prompt_of(30, rng.randrange(1000)), True, max_tokens=max_tokens, ignore_eos=True)
    print("loaded", flush=True)  # one whole completion served: the parent may start timing
    while True:
        first_token(port, model, prompt_of(30, rng.randrange(1000)), True, max_tokens=max_tokens, ignore_eos=True)


def main() -> None:
    if sys.argv[1:2] == ["--load"]:
        load(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return
    print(json.dumps({"scheduling": _prioritize()}), flush=True)
    for line in sys.stdin:
        q = json.loads(line)
        if "burst" not in q:
            print(json.dumps(_timed(q)), flush=True)
            continue
        # all at once, one thread each (threads inherit this process's scheduling); the CPU
        # wait is the process's over the whole burst
        from concurrent.futures import ThreadPoolExecutor

        w0 = _cpu_wait_ms()
        with ThreadPoolExecutor(len(q["burst"])) as pool:
            answers = list(pool.map(_timed, q["burst"]))
        wait = _cpu_wait_ms() - w0
        errors = [a["error"] for a in answers if "error" in a]
        print(json.dumps({"error": errors[0]} if errors else
                         {"burst": [{**a, "cpu_wait_ms": wait} for a in answers]}), flush=True)


if __name__ == "__main__":
    main()
