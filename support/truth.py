"""The truth harness on real vLLM: a server with a planted cause (or none), driven by a client
that times every request itself, and the report read back.

The client: streaming, until the first SSE chunk carrying a token has arrived; non-streaming,
until the whole response has; timed in a process of its own that the CPU scheduler serves
first (support/stopwatch.py: on two cores that vLLM keeps busy, a client at normal priority
times its own wait for a CPU), which reports that wait with every request. Faults are planted
by the test-only vLLM plugin in tests/planted (never shipped). Used by tests/truth/ and
bench/truth.py.
"""

from __future__ import annotations

import functools
import json
import random
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
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
#: awaited in the API server between rendering a prompt and handing it to the engine (a host gap:
#: outside every phase; ~0.3 ms there at p50 without it). At 30 ms the client lost 34.2 ms, the
#: gap grew 30.4 and the delayed requests' prefill ran 2.6 ms longer (an engine idle longer is
#: slower to start): a cost of the gap that removing it removes too, but that no span of the gap
#: holds; twice the gap halves that share of the client's loss
HOST_GAP_MS = 60.0
ALLREDUCE_MS = 6.0  # planted on every tensor-parallel all-reduce (tests/planted)
#: planted per row (token) of every all-reduce's input in the growing part: at 24 decoding requests
#: and the tiny model's 5 all-reduces a step, 23 ms a step more than at one. The collectives of two
#: ranks on two shared cores take ~10 ms a step here, give or take 5, whatever the batch: 50 us a row
#: (+6 ms at 24) was lost in that noise (correlation too weak for a finding, 2026-12-01)
ALLREDUCE_US_PER_ROW = 200.0
UPDATE_MS = 10.0  # planted in the engine core's update_from_output, every step (host and busy parts)
#: the engine loop's pause after every step in the bubbles part's paused bursts: about a prefill
#: step, so that the idle loop, not the bursts' own queue, is the larger cause of their wait on
#: a slow machine too. At 10 ms, on a VM whose prefill steps took ~45 ms of host CPU, the pauses
#: cost the client 7 ms or nothing (the API server and the client took the core a pause freed)
#: and the queue outranked them; at 25 ms they cost it 23-77 ms and ranked first in one run of
#: three; at 50 ms 99 ms, the finding 103 (2026-12-01). On device-time steps (a worker sleep) the
#: longer steps' queue hid them instead.
LOOP_PAUSE_MS = 50
#: how far from the client's loss a finding may be where a plant's side effects on this VM's two
#: shared cores move the loss itself, not only the planted time: a plant that sleeps frees a core
#: the API server and the client take (the client then loses less than was planted), one that
#: spins takes one from the model (more). Measured 2026-12-01 on a VM half as fast as before, the
#: finding against the client's loss: host overhead 9.6 vs 13.1 ms planted as a pause (the model's
#: steps ran 3-4 ms slower beside it), 10.1 vs 16.7, 9.5 vs 8.6 and 10.0 vs 8.5 as busy Python (the
#: planted 10); the prefill budget 154 vs 212 ms; slow collectives 30.5 vs 25.2 ms (the planted
#: 6 ms x 5 calls). On the faster VM before, all within 15% (README). A finding a third off still
#: ranks its cause right, and where the planted time is known the finding is held to 15% of it.
SHARED_CORES_TOLERANCE = 0.40
FIRST_STEPS_MS, FIRST_STEPS = 150.0, 20  # planted on the first steps after start: ~5 requests of 4 tokens
#: planted in a worker's start-up, between loading the weights and warming up: a sixth of the
#: ~40 s a worker's cold start takes here (its idle otherwise ~20 ms), still over the finding's 5 %
#: on a VM that starts vLLM twice as slowly
STARTUP_IDLE_S = 8.0
SHARED = prompt_of(300, 999)
#: the prefix part's shared prefix (a long system prompt): its misses cost the client a size a
#: p50 over two dozen requests can tell from the noise
LONG_SHARED = prompt_of(1100, 998)
STOPWATCH = Path(__file__).with_name("stopwatch.py")


class _Stopwatch:
    """support/stopwatch.py, the client's stopwatch in a process the CPU scheduler serves first
    (started on first use, one per process that drives)."""

    proc: subprocess.Popen | None = None
    scheduling = ""
    lock = threading.Lock()

    @classmethod
    def ask(cls, query: dict) -> dict:
        with cls.lock:
            if cls.proc is None or cls.proc.poll() is not None:
                cls.proc = subprocess.Popen([PY, str(STOPWATCH)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, bufsize=1)
                cls.scheduling = json.loads(cls.proc.stdout.readline())["scheduling"]
            cls.proc.stdin.write(json.dumps(query) + "\n")
            cls.proc.stdin.flush()
            answer = json.loads(cls.proc.stdout.readline() or '{"error": "the stopwatch process died"}')
        assert "error" not in answer, answer["error"]
        return answer


def client_ttft(port: int, model: str, prompt: str, stream: bool, chat: bool = False, max_tokens: int = 4,
                cache_salt: str | None = None) -> dict:
    """One request timed by the stopwatch process (support/stopwatch.py: streaming, until the
    first SSE chunk carrying a token; non-streaming, until the whole response), as a row:
    ``rid`` (the response id), ``client_ms`` and ``client_cpu_wait_ms`` (how long the stopwatch
    waited for a CPU meanwhile: its witness is only as good as that is small)."""
    return _row(_Stopwatch.ask({"port": port, "model": model, "prompt": prompt, "stream": stream, "chat": chat,
                                "max_tokens": max_tokens, "cache_salt": cache_salt}))


#: the client's stopwatch is a witness only while it gets a CPU when it needs one. Most requests
#: (9 in 10) must have been timed with under 2 ms of waiting for a CPU, none with more than this:
#: a lone request that waited 2-3 ms (two in one clean-clone run, 2026-12-01, under SCHED_FIFO:
#: kernel work or a same-priority load client ahead of it) moves none of the p50s compared here
#: (effects of 10 ms and more, held to 15-40 %); a witness that waits often, or long, would
WITNESS_MAX_WAIT_MS = 10.0


def witness_ok(df: pl.DataFrame, effect_ms: float | None = None) -> tuple[bool, str]:
    """(the stopwatch was served a CPU when it needed one, its waits in words) for rows with
    ``client_cpu_wait_ms``: 9 waits in 10 under 2 ms and none over ``WITNESS_MAX_WAIT_MS`` — or,
    for an ``effect_ms`` compared that is large, under 2 % and 5 % of it (a burst's stopwatch
    waits once for all its requests: one 5-ms wait against a 1.2-s effect is 0.4 % of it)."""
    w = df["client_cpu_wait_ms"]
    p90, most = float(w.quantile(0.9)), float(w.max())
    e = abs(effect_ms or 0.0)
    return (p90 < max(2.0, 0.02 * e) and most < max(WITNESS_MAX_WAIT_MS, 0.05 * e),
            f"stopwatch CPU wait p90 {p90:.2f} ms, most {most:.2f} ms" + (f", effect {e:.1f} ms" if e else ""))


def _row(answer: dict) -> dict:
    return {"rid": answer["rid"], "client_ms": answer["s"] * 1e3, "client_cpu_wait_ms": answer["cpu_wait_ms"]}


def stopwatch_scheduling() -> str:
    return _Stopwatch.scheduling


def _warm(srv: VllmServer) -> None:
    """The server's first completion and the client's first calls, kept out of every comparison."""
    srv.completion("warm up", 2)
    for stream in (True, False):
        client_ttft(srv.port, srv.model, "warm up the client", stream)


def drive(srv: VllmServer, shared: bool = False, tag: str = "", warm: bool = True,
          max_tokens: int = 4, n: int = 24) -> list[dict]:
    """``n`` requests one at a time (streaming and not, completions and chat, 40–120-word prompts,
    the same every time; ``tag``, a one-token word, in front of each (after the shared prefix):
    prompts of the same length that the prefix cache has not seen in another part), ``max_tokens``
    each (1: a stream's first chunk ends it, so no wait for a token with text, whose length
    depends on which tokens the model happens to produce, adds to what the client times)."""
    if warm:
        srv.stream("warm up the stream", 2)
        _warm(srv)
    out = []
    for i in range(n):
        stream, chat = i % 3 != 2, i % 4 == 3
        # shared: every other prompt starts with the same 300 tokens (a system prompt)
        prompt = ((SHARED + " " if shared and i % 2 == 0 else "") + (tag + " " if tag else "")
                  + prompt_of(40 + 20 * (i % 5), 100 + i))
        out.append({**client_ttft(srv.port, srv.model, prompt, stream, chat, max_tokens), "stream": stream,
                    "shared": shared and i % 2 == 0, "i": i})
        time.sleep(0.05)
    return out


def drive_pairs(srv: VllmServer, switches: Path, fault: str, tags: tuple[str, str], n: int = 24) -> list[dict]:
    """The clean load's ``n`` prompts (its mix of streaming and not, completions and chat), each
    sent twice in a row, once as is and once with ``fault`` switched on (its file in
    ``switches``), alternating which goes first; ``tags``: the one-token word in front of each
    (the clean one's, the faulty one's: no prefix-cache hit from its twin). Clean and faulty
    requests share every condition of the run, so the fault's effect is their difference.
    One token each (a first token that decodes to no text would make a stream wait whole
    decode steps for one with text, a wait that varies from run to run with the tokens the
    dummy weights produce). Rows: ``faulty``."""
    flag = switches / fault
    out = []
    for i in range(n):
        stream, chat = i % 3 != 2, i % 4 == 3
        own = prompt_of(40 + 20 * (i % 5), 100 + i)
        for faulty in ((False, True) if i % 2 == 0 else (True, False)):
            if faulty:
                flag.touch()
            try:
                row = client_ttft(srv.port, srv.model, tags[faulty] + " " + own, stream, chat, 1)
            finally:
                flag.unlink(missing_ok=True)
            out.append({**row, "stream": stream, "faulty": faulty})
            time.sleep(0.05)
    return out


drive_pairs.toggles = True  # drive_parts hands it the switch directory: it switches its own fault


def drive_prefix(srv: VllmServer, n: int = 32) -> list[dict]:
    """``n`` prompts that start with the same long prefix (LONG_SHARED, then 40–120 words of
    their own, after a one-token tag), each sent three times in a row, the tag differing (the
    prompts share only the prefix): once as is (a prefix-cache hit) and twice right after vLLM's
    prefix cache was emptied (``POST /reset_prefix_cache``, vLLM's dev-mode endpoint: misses, as
    when a cache too small evicted the prefix), the hit first, second or last in turn: hits and
    misses share every condition of the run (the machine's hiccups, the collector's flushes).
    One token each (streaming and not). First the prefix's own prefill and a few hits, untimed
    (the first hits run slower while the engine warms to them; a ``cache_salt`` no longer makes a
    miss here: vLLM's own block hashes, which the plugin takes, keep a salted prompt apart from the
    hits' prefix, as vLLM's cache does). Rows: ``missed``, ``pair`` (the prompt's number),
    ``shared`` (all)."""
    for i in range(4):
        srv.completion(LONG_SHARED + " " + prompt_of(30, 1900 + i), 1)
    out = []
    for i in range(n):
        stream = i % 3 != 2
        own = prompt_of(40 + 20 * (i % 5), 1300 + i)
        for k, tag in enumerate("fgh"):  # after the prefix, a one-token tag: the three differ from there on
            missed, prompt = k != i % 3, LONG_SHARED + " " + tag + " " + own
            if missed:
                reset_prefix_cache(srv)
                time.sleep(0.05)
            out.append({**client_ttft(srv.port, srv.model, prompt, stream, False, 1), "stream": stream,
                        "shared": True, "missed": missed, "pair": i})
            time.sleep(0.05)
    return out


def reset_prefix_cache(srv: VllmServer, tries: int = 50) -> None:
    """Empties vLLM's prefix cache (its dev-mode endpoint: the server runs with
    ``VLLM_SERVER_DEV_MODE=1``); vLLM refuses while a request holds blocks, so it retries."""
    for _ in range(tries):
        req = urllib.request.Request(f"{srv.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            if json.loads(r.read() or b"{}").get("success", True):
                return
        time.sleep(0.02)
    raise RuntimeError("vLLM did not empty its prefix cache")


def _set(flag: Path, on: bool) -> None:
    """A planted fault's switch file (tests/planted) present while ``on``."""
    flag.touch() if on else flag.unlink(missing_ok=True)


#: the small token budget per step the prefill-budget scenario holds every other block at
BUDGET_TOKENS = 32


def drive_budget(srv: VllmServer, switches: Path, words: int = 900, blocks: int = 8, n: int = 12) -> list[dict]:
    """Long prompts (``words`` words, about as many tokens), one at a time, streaming, in
    ``blocks`` alternating blocks of ``n`` on one server:
    a small token budget per step (PLANTED_TOKEN_BUDGET) switched on for the even blocks, the
    server's own for the odd ones, so the small budget's baseline is the same server a few
    seconds apart. Rows: ``small``, and their block's ``since``/``until`` (epoch seconds): a
    small block's report is read over its own window, where every step is small."""
    flag = switches / "PLANTED_TOKEN_BUDGET"
    _warm(srv)
    for small in (False, True):  # a long prompt under each budget first: their first compiles
        _set(flag, small)
        client_ttft(srv.port, srv.model, prompt_of(words, 5 + small), True)
    out = []
    for b in range(blocks):
        small = b % 2 == 0
        _set(flag, small)
        time.sleep(0.3)
        since, rows = time.time(), []
        for i in range(n):
            rows.append({**client_ttft(srv.port, srv.model, prompt_of(words, 700 + b * n + i), True), "stream": True,
                         "small": small})
            time.sleep(0.05)
        until = time.time()
        out += [{**r, "since": since, "until": until} for r in rows]
    _set(flag, False)
    return out


def served_budget(tmp: Path, name: str) -> tuple[pl.DataFrame, str]:
    """``drive_budget`` on a server at ``--max-num-batched-tokens 2048`` (one step per prompt),
    the planted budget ``BUDGET_TOKENS`` switched on in every other block."""
    switches = tmp / "switches"
    return served(tmp, name, env=switched_env(switches, {"PLANTED_TOKEN_BUDGET": str(BUDGET_TOKENS)}),
                  drive=functools.partial(drive_budget, switches=switches), extra=["--max-num-batched-tokens", "2048"])


def drive_busy(srv: VllmServer, bg_tokens: int = 40, n: int = 16, clients: int = 2) -> list[dict]:
    """Measured requests at random moments while ``clients`` other clients keep the engine
    decoding (each streams ``bg_tokens``-token completions back to back, in a process of its
    own scheduled like the stopwatch: a starved background client would lighten the load)."""
    _warm(srv)
    bg = [subprocess.Popen([PY, str(STOPWATCH), "--load", str(srv.port), srv.model,
                            str(bg_tokens)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for _ in range(clients)]
    # timing starts once every background client has had a whole completion served (a fixed
    # sleep was not enough in a clean clone: the clients were still starting and no seat was taken)
    for p in bg:
        if p.stdout.readline().strip() != "loaded":
            for q in bg:
                q.terminate()
            raise AssertionError(f"a background client failed to start: {p.stderr.read()[-2000:]}")
    time.sleep(0.2)
    rng = random.Random(7)
    out = []
    try:
        for i in range(n):
            time.sleep(rng.uniform(0.0, 0.08))
            out.append({**client_ttft(srv.port, srv.model, prompt_of(30, 300 + i), True), "stream": True})
        dead = [p.stderr.read()[-2000:] for p in bg if p.poll() is not None]
    finally:
        for p in bg:
            p.terminate()
        for p in bg:
            p.wait(30)
    assert not dead, f"a background client failed: {dead}"
    return out


def drive_burst(srv: VllmServer, bursts: int = 3, size: int = 12, max_tokens: int = 32) -> list[dict]:
    """Bursts of ``size`` streaming requests sent at once (short prompts, exactly ``max_tokens``
    tokens each, read to the end: a request keeps its seat until it is done), one burst after
    the other finished: more requests at once than a small ``--max-num-seqs`` seats."""
    _warm(srv)
    out = []
    for b in range(bursts):
        q = [{"port": srv.port, "model": srv.model, "prompt": prompt_of(30, 900 + b * size + i), "stream": True,
              "max_tokens": max_tokens, "ignore_eos": True} for i in range(size)]
        out += [{**_row(a), "stream": True} for a in _Stopwatch.ask({"burst": q})["burst"]]
        time.sleep(0.3)
    return out


def drive_bubbles(srv: VllmServer, switches: Path, bursts: int = 24, size: int = 6) -> list[dict]:
    """Bursts of ``size`` streaming requests at once (80-word prompts, one token each: more
    prompt tokens than one step computes, so most wait in the queue for a few steps), the
    engine loop's pause after every step (PLANTED_LOOP_PAUSE_MS) switched on for every other
    burst: paused and clean bursts share every condition of the run. One clean burst first,
    not measured: the part's first burst is slower for reasons of its own. Rows: ``paused``.
    Twelve bursts of each (~18 s): a paused burst's TTFTs come in clusters a pause apart (60,
    150, 250, 380 ms here), so a p50 over few of them jumps with the cluster it lands in. What
    the pauses cost the client at p50, for a finding steady at 103-107 ms (2026-12-02, one
    server, four parts each): four bursts of each read 86-120 ms (75 in a CI run), twelve
    84-112 (their mean difference 88-102: the pauses' side effects vary too)."""
    flag = switches / "PLANTED_LOOP_PAUSE_MS"
    out = []
    for b in range(-1, bursts):  # burst -1: clean, unmeasured (a part's first burst ran ~35% slower here)
        paused = b >= 0 and b % 2 == 1
        if paused:
            flag.touch()
        q = [{"port": srv.port, "model": srv.model, "prompt": prompt_of(80, 2000 + b * size + i), "stream": True,
              "max_tokens": 1} for i in range(size)]
        rows = [{**_row(a), "stream": True, "paused": paused} for a in _Stopwatch.ask({"burst": q})["burst"]]
        out += rows if b >= 0 else []
        flag.unlink(missing_ok=True)
        time.sleep(0.3)
    return out


drive_bubbles.toggles = True  # drive_parts hands it the switch directory: it switches its own fault

#: planted per prompt token in vLLM's tokenizer pool during every other burst of drive_tokenizer_bursts: ~3 ms a
#: 200-token prompt, which the pool serves one at a time (a burst's last prompt waits ~150 ms for it), slower
#: than nothing but faster than the engine admits them at its 128-token step budget: the engine's queue stays
#: (~45-75 ms of impact at p50 on the slow bursts, ~80-117 on the others, measured 2026-12-07)
BURST_TOKENIZE_US_PER_TOKEN = 15


def drive_tokenizer_bursts(srv: VllmServer, switches: Path, bursts: int = 12, size: int = 50) -> list[dict]:
    """Bursts of ``size`` streaming requests at once (200-word prompts, 4 tokens each), the slow
    tokenizer (``BURST_TOKENIZE_US_PER_TOKEN``) switched on for every other burst; one clean burst
    first, not measured. Rows: ``slow`` and each burst's own window (``since``/``until``)."""
    _warm(srv)
    flag = switches / "PLANTED_TOKENIZE_US_PER_TOKEN"
    out = []
    for b in range(-1, bursts):
        slow = b >= 0 and b % 2 == 1
        if slow:
            flag.touch()
        q = [{"port": srv.port, "model": srv.model, "prompt": prompt_of(200, 70000 + b * size + i), "stream": True,
              "max_tokens": 4, "ignore_eos": True} for i in range(size)]
        since = time.time()
        rows = [{**_row(a), "stream": True, "slow": slow, "burst": b} for a in _Stopwatch.ask({"burst": q})["burst"]]
        flag.unlink(missing_ok=True)
        until = time.time()
        out += [{**r, "since": since, "until": until} for r in rows] if b >= 0 else []
        time.sleep(1.0)
    return out


#: during the seats' burst, every worker step this much longer (a sleep: time on the device, the
#: host's cores free), as when a step's time is mostly a GPU's
SEATS_STEP_MS = 10


def drive_seats(srv: VllmServer, switches: Path | None = None) -> list[dict]:
    """Two loads that need more seats than a small ``--max-num-seqs`` gives, one after the
    other on one server, each row with its ``part`` and the part's ``since``/``until`` (epoch
    seconds): "decodes" (three clients keep 80-token decodes running while 12 measured requests
    arrive at random moments) and "burst" (three bursts of 12 requests of 32 tokens at once).
    With ``switches`` (``served_seats``) the burst runs with every worker step ``SEATS_STEP_MS``
    longer: on this VM's tiny model a step is ~4.5 ms of host CPU (measured in the burst at 128
    seats), so twelve requests admitted at once flood two cores (their tokenizing, output
    processing and steps slow each other down by ~20 ms), a cost no counterfactual that removes
    the queue can see, and one a server whose steps are mostly device time does not pay."""
    out = []
    for part, drive in (("decodes", functools.partial(drive_busy, bg_tokens=80, n=12, clients=3)),
                        ("burst", drive_burst)):
        slow = switches is not None and part == "burst"
        if slow:
            _set(switches / "PLANTED_EXECUTE_MS", True)
        try:
            since = time.time()
            rows = drive(srv)
            until = time.time()
        finally:
            if slow:
                _set(switches / "PLANTED_EXECUTE_MS", False)
        out += [{**r, "part": part, "since": since, "until": until} for r in rows]
        time.sleep(1.0)
    return out


def served_seats(tmp: Path, name: str, seats: int) -> tuple[pl.DataFrame, str]:
    """``drive_seats`` (the burst on device-time steps) on a server at ``--max-num-seqs seats``."""
    switches = tmp / "switches"
    return served(tmp, name, env=switched_env(switches, {"PLANTED_EXECUTE_MS": str(SEATS_STEP_MS)}),
                  drive=functools.partial(drive_seats, switches=switches), extra=["--max-num-seqs", str(seats)])


#: the KV-cache scenario's server: 15 usable blocks of 128 tokens (vLLM keeps one of the 16), seats
#: and a token budget to spare, so that only the KV cache can hold a request back
KV_SERVER = ["--num-gpu-blocks-override", "16", "--max-model-len", "1536", "--max-num-seqs", "8"]
KV_BUDGET = 2048  # a held prompt is admitted whole (all its blocks at once) or not at all
#: every worker step this much longer (a sleep: device time), so a holder's decode lasts ~1 s here
KV_STEP_MS = 15
#: (prompt words, tokens out) of the request that holds the KV cache and of the one held back.
#: The holder's ~960 prompt tokens take 8 blocks (897-1024 tokens) and its 60 more stay within 8 or
#: 9: never short of a block (no preemption). The held request's ~1000 need 8, of 7 free: it waits
#: in the queue, a seat free, until the holder is done.
KV_HOLDER, KV_HELD = (960, 60), (1000, 1)


def drive_kv(srv: VllmServer, n: int = 6) -> list[dict]:
    """Three parts on one server (``KV_SERVER``), each row with its ``part`` and the part's
    ``since``/``until``: "alone" (``n`` long prompts, one at a time, nothing else running),
    "held" (``n`` pairs: the holder sent, then the same kind of long prompt 0.3 s later, while the
    holder decodes with 8 of the 15 blocks) and "after" (as alone). What the full KV cache cost
    the held requests is their TTFT against the alone and after parts' (the same prompts' kind,
    the same server, just before and after)."""
    _warm(srv)
    client_ttft(srv.port, srv.model, prompt_of(KV_HELD[0], 3000), True, max_tokens=1)  # a long prompt's first compile
    out = []
    for part in ("alone", "held", "after"):
        since, rows = time.time(), []
        for i in range(n):
            held = {"port": srv.port, "model": srv.model, "prompt": prompt_of(KV_HELD[0], 3100 + 10 * len(out) + i),
                    "stream": True, "max_tokens": KV_HELD[1]}
            if part == "held":
                holder = {"port": srv.port, "model": srv.model, "prompt": prompt_of(KV_HOLDER[0], 3500 + i),
                          "stream": True, "max_tokens": KV_HOLDER[1], "ignore_eos": True}
                a, b = _Stopwatch.ask({"burst": [holder, {**held, "after_s": 0.3}]})["burst"]
                rows += [{**_row(a), "role": "holder"}, {**_row(b), "role": "held"}]
            else:
                rows.append({**_row(_Stopwatch.ask(held)), "role": "held"})
            time.sleep(0.2)
        until = time.time()
        out += [{**r, "stream": True, "part": part, "since": since, "until": until} for r in rows]
        time.sleep(1.0)
    return out


def served_kv(tmp: Path, name: str) -> tuple[pl.DataFrame, str]:
    """``drive_kv`` on a ``KV_SERVER`` whose steps take ``KV_STEP_MS`` longer."""
    return served(tmp, name, env={"PYTHONPATH": str(PLANTED), "PLANTED_EXECUTE_MS": str(KV_STEP_MS)},
                  drive=drive_kv, extra=KV_SERVER, max_num_batched_tokens=KV_BUDGET)


# the faults that one server runs one after the other (tests/planted: switched on by a
# file named after the variable in PLANTED_SWITCH_DIR), with the load each is driven with
FAULTS = {
    "PLANTED_DELIVER_STALL_MS": str(STALL_MS),
    "PLANTED_TOKENIZE_US_PER_TOKEN": str(TOKENIZE_US_PER_TOKEN),
    "PLANTED_EXECUTE_MS": "30",
    "PLANTED_UPDATE_MS": str(UPDATE_MS),
    "PLANTED_LOOP_PAUSE_MS": str(LOOP_PAUSE_MS),
    "PLANTED_HOST_GAP_MS": str(HOST_GAP_MS),
}
SWITCHED_PARTS = {  # part -> (the faults switched on, the load); each part's prompts are the
    # same but for a one-token tag in front, so no part hits another's prefix cache
    "clean": ((), functools.partial(drive, tag="a")),
    # the clean load's prompts in clean and faulty twins (per-request faults: their baseline within)
    # (the stall's 48 pairs: with 24, what the client lost moved by ~+-4 ms around the planted 25)
    "stall": ((), functools.partial(drive_pairs, fault="PLANTED_DELIVER_STALL_MS", tags=("b", "i"), n=48)),
    "slowtok": ((), functools.partial(drive_pairs, fault="PLANTED_TOKENIZE_US_PER_TOKEN", tags=("c", "j"))),
    "hostgap": ((), functools.partial(drive_pairs, fault="PLANTED_HOST_GAP_MS", tags=("m", "o"))),
    # a fault the finding reads from every step of its window (the engine's host share): the whole
    # part, one token each, against the same load with no fault just before and just after it
    # (this VM's speed drifts by several ms a step within a minute: the two sides cancel a drift),
    # 96 requests each, the client's loss taken prompt by prompt (paired_loss: the same prompt's
    # TTFT varies by +-15 ms from one part to the next here, and a difference of p50s over 48
    # mixed prompts read 5.4 to 16.7 ms for the planted 10)
    "hostbase": ((), functools.partial(drive, tag="k", warm=False, max_tokens=1, n=96)),
    "host": (("PLANTED_UPDATE_MS",), functools.partial(drive, tag="d", warm=False, max_tokens=1, n=96)),
    "hostafter": ((), functools.partial(drive, tag="l", warm=False, max_tokens=1, n=96)),
    # long-prefix requests, each as a prefix-cache hit and after the cache was emptied (a miss), interleaved: what misses cost
    "prefix": ((), drive_prefix),
    # bursts that queue, the engine loop pausing 50 ms after every step in every other burst (see
    # LOOP_PAUSE_MS)
    "bubbles": ((), drive_bubbles),
    "busy": (("PLANTED_EXECUTE_MS", "PLANTED_UPDATE_MS"), drive_busy),
}
#: shared-prefix traffic (every other prompt starts with SHARED), one token per request
SHARED_LOAD = functools.partial(drive, shared=True, tag="e", max_tokens=1)


def switched_env(switches: Path, faults: dict[str, str] | None = None) -> dict:
    """A server environment with ``faults`` (default: every one in FAULTS, for ``drive_parts``)
    planted by tests/planted, each switched off until its file appears in ``switches``."""
    switches.mkdir(parents=True, exist_ok=True)
    return {"PYTHONPATH": str(PLANTED), "PLANTED_SWITCH_DIR": str(switches), **(FAULTS if faults is None else faults),
            "VLLM_SERVER_DEV_MODE": "1"}  # (drive_prefix empties the prefix cache through it)


def drive_parts(srv: VllmServer, switches: Path) -> list[dict]:
    """SWITCHED_PARTS one after the other on one server (``switched_env``): each part's faults
    switched on, its load driven, switched off; each row with its ``part`` and the part's
    ``since``/``until`` (epoch seconds), the window its report is read over."""
    out = []
    for part, (faults, load) in SWITCHED_PARTS.items():
        for f in faults:
            (switches / f).touch()
        time.sleep(0.3)
        since = time.time()
        toggles = getattr(getattr(load, "func", load), "toggles", False)  # (a partial's function)
        rows = load(srv, switches) if toggles else load(srv)
        until = time.time()
        for f in faults:
            (switches / f).unlink()
        out += [{**r, "part": part, "since": since, "until": until} for r in rows]
        time.sleep(1.0)  # the last part's stragglers (background decodes) finish outside the next window
    return out


def drive_cold(srv: VllmServer, n: int = 25) -> list[dict]:
    """Straight after start, no warm-up: ``n`` streaming requests one at a time (60-token
    prompts, 4 tokens each), each row with its ``order``."""
    out = []
    for i in range(n):
        out.append({**client_ttft(srv.port, srv.model, prompt_of(60, 1200 + i), True), "stream": True, "order": i})
        time.sleep(0.05)
    return out


def drive_switched(srv: VllmServer, flag: Path, n: int = 16) -> list[dict]:
    """The same requests (60-token prompts, streaming, one at a time) twice: ``part`` "clean",
    then "slowed" once ``flag`` exists (a planted fault switched on mid-run: one server, its
    own baseline); each row has its part's ``since`` and ``until`` (epoch seconds). One token
    each: its chunk ends the request (a first token that decodes to no text would otherwise
    make the client wait whole decode steps, which a fault in every step stretches too)."""
    _warm(srv)
    out = []
    for part in ("clean", "slowed"):
        if part == "slowed":
            flag.touch()
            time.sleep(0.5)
        since, rows = time.time(), []
        for i in range(n):
            rows.append({**client_ttft(srv.port, srv.model, prompt_of(60, 500 + i), True, max_tokens=1), "stream": True,
                         "part": part, "since": since})
            time.sleep(0.05)
        until = time.time()
        out += [{**r, "until": until} for r in rows]
    return out


def drive_growth(srv: VllmServer, row_flag: Path, sizes: tuple[int, ...] = (1, 4, 8, 12, 16, 20, 24),
                 max_tokens: int = 24) -> list[dict]:
    """Bursts of 1 to 24 streaming requests at once (short prompts, exactly ``max_tokens``
    tokens each, read to the end), one after the other finished: decode steps at every
    concurrency in between. Twice: ``part`` "flat", then "growing" once ``row_flag`` exists (a
    collective that grows with the step's tokens, PLANTED_ALLREDUCE_US_PER_ROW); each row with
    its part's ``since`` and ``until``."""
    out = []
    for part in ("flat", "growing"):
        if part == "growing":
            row_flag.touch()
            time.sleep(0.5)
        since, rows = time.time(), []
        for b, size in enumerate(sizes):
            q = [{"port": srv.port, "model": srv.model, "prompt": prompt_of(4, 1700 + b * 50 + i), "stream": True,
                  "max_tokens": max_tokens, "ignore_eos": True} for i in range(size)]
            rows += [{**_row(a), "stream": True, "part": part, "since": since}
                     for a in _Stopwatch.ask({"burst": q})["burst"]]
            time.sleep(0.2)
        until = time.time()
        out += [{**r, "until": until} for r in rows]
    row_flag.unlink()
    return out


def part_window(rows: pl.DataFrame, run: str) -> Window:
    """The report window of the rows' part (their ``since``..``until``, epoch seconds)."""
    return Window(int(rows["since"].min() * 1e9), int(rows["until"].max() * 1e9), run=run)


def client_rid(engine_rid: pl.Expr) -> pl.Expr:
    """The id the client was answered with, from the engine's request id: vLLM adds the prompt's
    index to a completion's (``cmpl-<hex>-0``), not to a chat completion's (``chatcmpl-<hex>``,
    whose hex may happen to be all decimal digits: only a completion's suffix is taken off)."""
    return engine_rid.str.replace(r"^(cmpl-[0-9a-f]+)-\d+$", "${1}")


def served(tmp: Path, name: str, env: dict | None = None, drive=drive, extra: list[str] | None = None, **server):
    # the collector shares the two cores with vLLM and the client: at its production flush
    # interval and a lower priority its flush queries do not land inside the requests timed here
    col = CollectorProc(str(tmp / "store"), tmp / "spool", flush_interval=2.0, nice=10).start()
    try:
        srv = VllmServer(tmp, col.url + "/v1/traces", run=name, env=env, extra=extra, **server).start()
        try:
            seen = drive(srv)
            # exports that failed (the collector, sharing two saturated cores, answered too late)
            # or were dropped (the plugin's queue full) leave requests without some spans: printed,
            # as what explains an attribution that fails below
            for ln in srv.output().splitlines():
                if "could not export" in ln:
                    print("plugin:", ln[-200:])
            waits = sorted(r["client_cpu_wait_ms"] for r in seen)
            print(f"stopwatch ({stopwatch_scheduling()} scheduling) waited for a CPU: median {waits[len(waits) // 2]:.2f} "
                  f"ms, most {waits[-1]:.2f} ms per request")
            col.wait_quiet()
        finally:
            srv.stop()
    finally:
        assert col.terminate() == 0
    store = open_store(col.store, create=False)
    mine = pl.DataFrame(seen, infer_schema_length=None)  # parts' rows carry columns of their own
    if "since" in mine.columns:  # each part over its own window, as its report reads it (a step
        # period, a baseline, is the window's: one part's must not be averaged with another's)
        df = pl.concat([decompose(store, part_window(p, name)) for p in mine.partition_by("since")],
                       how="diagonal_relaxed")
    else:
        df = decompose(store, Window.last(3600, run=name))
    df = df.with_columns(client_rid(pl.col("request_id")).alias("rid"))
    joined = mine.join(df, on="rid", how="left")
    missing = joined.filter(pl.col("ttft").is_null()).select([c for c in ("rid", "part", "since", "until")
                                                              if c in joined.columns])
    assert missing.height == 0, f"every client request is in the report; not: {missing}"
    return joined, col.store


def analyze(store: str, run: str, since: float | None = None, until: float | None = None,
            slo: str = "p50=5000,p95=10000,p99=20000") -> dict:
    """The report on ``run`` (over the last hour, or ``since``..``until``, epoch seconds) as JSON,
    against TTFT targets ``slo`` (a finding's severity follows from its impact against them)."""
    window = ["--last", "1h"] if since is None else ["--since", str(since), "--until", str(until or time.time())]
    r = subprocess.run([PY, "-m", "ttftscope", "analyze", "--store", store, *window, "--json", "--quiet",
                        "--run", run, "--slo", slo],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode in (0, 1), r.stderr  # 1: an SLO target missed (a queue wait under seats load)
    return json.loads(r.stdout)


#: findings whose counterfactual needs their detector's per-request numbers (not in the report)
PER_REQUEST = {"prefix_cache_misses", "scheduling_bubbles"}


@dataclass
class Sized:
    """A planted cause against the client's own stopwatch: the report's findings (ranked), what
    the fault cost the client at p50 (the faulty requests' TTFT p50 minus their baseline's, the
    same run), and what the cause's finding says removing it would save at p50 on the same
    client-timed requests (None without the finding). ``fault`` and ``base`` are the rows, with
    the detector's per-request numbers joined where it has them (PER_REQUEST)."""

    want: str
    kinds: list[str]
    effect_ms: float
    impact_ms: float | None
    finding: dict | None
    fault: pl.DataFrame
    base: pl.DataFrame
    findings: list[dict] = field(default_factory=list)  # the report's, ranked

    @property
    def top1(self) -> bool:
        return bool(self.kinds) and self.kinds[0] == self.want

    @property
    def error(self) -> float | None:
        """|impact - effect| / effect (None without an impact or an effect to speak of)."""
        if self.impact_ms is None or self.effect_ms <= 1.0:
            return None
        return abs(self.impact_ms - self.effect_ms) / self.effect_ms

    def __str__(self) -> str:
        imp = "none" if self.impact_ms is None else f"{self.impact_ms:.1f}"
        return f"{self.want}: top {self.kinds[:1]}, the client lost {self.effect_ms:.1f} ms at p50, the finding says {imp}"


def sized(report: dict, want: str, fault: pl.DataFrame, base: pl.DataFrame, store: str | None = None,
          window: Window | None = None, rows: pl.DataFrame | None = None, effect: float | None = None) -> Sized:
    """Size the finding ``want`` of ``report`` on the ``fault`` rows against their ``base``
    (what the fault cost the client: ``effect`` where the caller measures it, else the p50 of
    ``fault`` minus that of ``base``). For a PER_REQUEST finding its detector runs again over
    ``window`` of ``store`` (the analysis context's frame: ``rows``, default both sets) for the
    per-request numbers the report leaves out."""
    from ttftscope.analyzer.findings import Context, run_detectors
    from ttftscope.analyzer.gaps import engine_bubbles
    from ttftscope.analyzer.impact import REMOVED, finding_impact
    from ttftscope.schemas.slo import SLO

    if effect is None:
        effect = float(fault["client_ms"].median()) - float(base["client_ms"].median())
    f = next((x for x in report["findings"] if x["kind"] == want), None)
    if f is not None and want in PER_REQUEST:
        ctx_rows = pl.concat([fault, base], how="diagonal_relaxed") if rows is None else rows
        ctx = Context(open_store(store, create=False), window, SLO(), ctx_rows)
        ctx.bubbles = engine_bubbles(ctx.store, window, steps=ctx.step_gaps)  # as the report's context has it
        (f,) = run_detectors(ctx, only=[want])
        per = f.pop("per_request")
        fault, base = (d.join(per, on="trace_id", how="left") for d in (fault, base))
    imp = float(finding_impact(fault, f)[0]["p50"]) if f is not None and want in REMOVED else None
    return Sized(want, [x["kind"] for x in report["findings"]], effect, imp, f, fault, base, report["findings"])


def part_report(rows: pl.DataFrame, store: str, run: str) -> dict:
    """The report over one part's window (its rows' ``since``..``until``)."""
    return analyze(store, run, since=rows["since"].min(), until=rows["until"].max())


def sized_parts(df: pl.DataFrame, store: str, run: str, only: set[str] | None = None) -> dict[str, Sized]:
    """Every sized part of a ``drive_parts`` run (rows ``df``, served as ``run``): the delivery
    stall, the slow tokenizer and the host gap against their clean twins, the engine's host overhead against the
    same load with no fault just before and after it, prefix-cache misses against the hits on
    the same prompts, the bubbles' paused bursts against the clean ones."""
    part = {p: df.filter(pl.col("part") == p) for p in SWITCHED_PARTS}
    twins = {p: (part[p].filter(pl.col("faulty")), part[p].filter(~pl.col("faulty")))
             for p in ("stall", "slowtok", "hostgap")}
    plan = {  # what -> (the part whose window is reported, its finding, faulty rows, baseline rows)
        "stall": ("stall", "deliver_dominates", *twins["stall"]),
        "slowtok": ("slowtok", "tokenize_dominates", *twins["slowtok"]),
        "hostgap": ("hostgap", "host_gap", *twins["hostgap"]),
        "host": ("host", "engine_host_overhead", part["host"], pl.concat([part["hostbase"], part["hostafter"]])),
        "prefix": ("prefix", "prefix_cache_misses", part["prefix"].filter(pl.col("missed")),
                   part["prefix"].filter(~pl.col("missed"))),
        "bubbles": ("bubbles", "scheduling_bubbles", part["bubbles"].filter(pl.col("paused")),
                    part["bubbles"].filter(~pl.col("paused"))),
    }
    out = {}
    for what, (p, want, fault, base) in plan.items():
        if only is None or what in only:
            paired = paired_loss(part["host"], part["hostbase"], part["hostafter"]) if what == "host" else None
            out[what] = sized(part_report(part[p], store, run), want, fault, base, store,
                              part_window(part[p], run), rows=part[p], effect=paired)
    return out


def paired_loss(fault: pl.DataFrame, before: pl.DataFrame, after: pl.DataFrame) -> float:
    """What a fault switched on for a whole part cost the client at p50, prompt by prompt: the
    median over the part's prompts (``i``) of each one's TTFT minus its mean in the same load just
    before and just after (drift cancels; the prompts' own spread, 40-120 words, streaming or not,
    does not enter as it does into a difference of two p50s)."""
    b = before.select("i", pl.col("client_ms").alias("b")).join(after.select("i", pl.col("client_ms").alias("a")), on="i")
    d = fault.select("i", "client_ms").join(b, on="i")
    return float((d["client_ms"] - (d["a"] + d["b"]) / 2).median())


def sized_budget(df: pl.DataFrame, store: str, run: str) -> Sized:
    """A ``drive_budget`` run: the small-budget blocks against the others (the same server), each
    small block's report read over its own window (every step in it small, as on a server started
    with that budget) and its ``chunk_budget`` finding sized on that block's requests. ``kinds``:
    a small block's findings whose top is not the budget's, else the first block's."""
    from ttftscope.analyzer.impact import REMOVED, impact_ms

    small, large = df.filter(pl.col("small")), df.filter(~pl.col("small"))
    effect = float(small["client_ms"].median()) - float(large["client_ms"].median())
    blocks = small.partition_by("since", maintain_order=True)
    findings = [part_report(b, store, run)["findings"] for b in blocks]
    said = [next((x for x in fs if x["kind"] == "chunk_budget"), None) for fs in findings]
    kinds = [[x["kind"] for x in fs] for fs in findings]
    kinds = next((k for k in kinds if k[:1] != ["chunk_budget"]), kinds[0] if kinds else [])
    first = next((f for f in said if f is not None), None)
    removed = pl.concat([b.with_columns((REMOVED["chunk_budget"](f) if f else pl.lit(0)).alias("removed"))
                         for b, f in zip(blocks, said, strict=True)])
    imp = float(impact_ms(removed, pl.col("removed"))[0]["p50"]) if first else None
    return Sized("chunk_budget", kinds, effect, imp, first, small, large)
