"""bench/engine_hooks: CPU per engine step of the plugin's scheduler hooks, by kind of step.

The engine core's hooks run on vLLM's engine loop, so their cost is paid on every step
(issue 16's budget: <= 3 us of CPU per step, <= 20 us per request). This drives the real
hook functions (``collector/vllm_plugin/engine.py``: ``_on_add``, ``_on_schedule``,
``_on_step_done``) with plain objects carrying the attributes they declare (real vLLM
drives them in tests/test_vllm_plugin.py and bench/overhead.py), into the real deferred-span
queue (what the export thread drains), and reports the CPU they add per step for:

  decode      decode-only steps, nobody waiting (merged into runs)
  waiting     decode-only steps with requests waiting (merged into runs of their own)
  prefill     a step that admits one new request (intake, queue, one prefill chunk)
  chunked     a step carrying the next chunk of a long prompt

Each figure is whole loops' CPU (``time.thread_time`` around --steps steps) with the hooks
minus the same loop without them (vLLM's side alone: this harness; the steps are built before
any timing), the least of interleaved
--rounds (the least: noise only adds); next to it the floor, measured the same way: the wrappers' clock reads and calls of
empty hooks (what any hook costs before it does anything).

Usage: python bench/engine_hooks.py [--steps 20000] [--rounds 5] [--kinds decode,prefill] [--thrash-mb 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kinds", default="decode,waiting,prefill,chunked", help="which kinds of step, comma-separated")
    ap.add_argument("--thrash-mb", type=float, default=0.0, metavar="MB",
                    help="between steps, in every mode, write this many MB (a model step's activations on a CPU "
                         "build do the same to the caches): the hooks then run cold, as in a serving engine core; "
                         "each step's own part is then timed alone (wall clock, one thread)")
    args = ap.parse_args()
    import numpy as np

    scratch = np.zeros(int(args.thrash_mb * (1 << 20)) // 8, dtype=np.int64) if args.thrash_mb > 0 else None

    from ttftscope.collector.otel_setup import DeferredSpans
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import HANDOFF_HEADER

    q = DeferredSpans(tracer=None, max_queue=10**9, max_batch=10**9)  # never full, never woken: hooks only
    RT.deferred = q
    tp = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}

    def request(i: int, tokens: int) -> NS:
        return NS(request_id=f"cmpl-{i}-0-deadbeef", external_req_id=f"cmpl-{i}-0",
                  trace_headers={**tp, HANDOFF_HEADER: str(time.time() - 0.001)}, num_computed_tokens=0,
                  num_prompt_tokens=tokens, prompt_token_ids=list(range(tokens)), priority=0,
                  prefill_stats=NS(num_prompt_tokens=tokens, num_cached_tokens=0))

    running = [NS() for _ in range(16)]

    def nothing(*a) -> None:
        return None

    def steps(kind: str, n: int) -> tuple[NS, list[tuple]]:
        """The scheduler and ``n`` steps of ``kind`` (built before any timing)."""
        sched = NS(requests={}, running=running, waiting=[], max_num_running_reqs=256, block_size=128,
                   _inflight_prefills=set())
        out, rid = [], None
        for i in range(n):
            new, tokens, waiting = (), {f"d{j}": 1 for j in range(16)}, 0
            if kind == "waiting":
                waiting = 3
            elif kind == "prefill":
                r = request(i, 100)
                new, rid = (r,), r.request_id
                tokens = {**tokens, rid: 100}
            elif kind == "chunked":
                if i % 8 == 0:
                    r = request(i, 800)
                    new, rid = (r,), r.request_id
                tokens = {**tokens, rid: 100}
            cont = [rid] if kind == "chunked" and not new else []  # a prompt's next chunk: a running request's
            so = NS(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                    scheduled_new_reqs=[NS(req_id=r.request_id, num_computed_tokens=0) for r in new],
                    finished_req_ids=set(), scheduled_cached_reqs=NS(req_ids=cont, num_computed_tokens=[i % 8 * 100] * len(cont),
                                             resumed_req_ids=set()))
            advance = [(rid, tokens[rid])] if kind in ("prefill", "chunked") else []  # its prompt tokens this step
            out.append((new, so, [0] * waiting, advance))
        return sched, out

    fold_cpu: dict[str, list[float]] = {}

    def run(kind: str, n: int, mode: str) -> float:
        """CPU seconds of ``n`` steps of ``kind`` on the engine loop: ``hooks`` the plugin's,
        ``floor`` the wrappers' clock reads and calls of empty hooks, ``bare`` vLLM's side alone
        (this harness). With ``hooks``, the work on the logged steps (prompt tokens sorted out,
        decode steps folded into runs; every 40 steps here, ~0.25 s of steps) is timed apart: it
        runs off the loop (in the export sidecar, or on the step-flush thread where there is none)."""
        st = SP.EngineState()
        sched, plan = steps(kind, n)
        on_add, on_schedule, on_done = ((E._on_add, E._on_schedule, E._on_step_done) if mode == "hooks"
                                        else (nothing, nothing, nothing))
        hooked = mode != "bare"
        clock = time.time if hooked else float
        reqs = sched.requests
        fold = section = 0.0
        pc = time.perf_counter
        c0 = time.thread_time()
        for new, out, waiting, advance in plan:
            s0 = pc()
            for r in new:  # vLLM's add_request and schedule() (their own work, in every mode)
                reqs[r.request_id] = r
                if hooked:
                    on_add(r, clock())
            for rid, k in advance:  # schedule() advances them and keeps its set of prefills in progress
                r = reqs[rid]
                r.num_computed_tokens += k
                (sched._inflight_prefills.add if r.num_computed_tokens < r.num_prompt_tokens
                 else sched._inflight_prefills.discard)(rid)  # (vLLM keeps the Request: the same truth)
            sched.waiting = waiting
            t0 = clock()
            t1 = clock()
            if hooked:
                on_schedule(st, sched, out, t0, t1)
            t_u0 = clock()
            if hooked:
                on_done(st, sched, out, t_u0, clock())
            section += pc() - s0
            if kind == "prefill":
                for r in new:
                    del reqs[r.request_id]
            if scratch is not None:  # the model's step: the same in every mode, so it cancels out
                np.add(scratch, 1, out=scratch)
            if len(q) > 1000:  # the export thread drains every 2 s
                q.take(len(q))
            if hooked and len(st.log) >= 40:
                f0 = time.thread_time()
                SP.flush_decode_run(st, idle_s=0.25)
                fold += time.thread_time() - f0
        if mode == "hooks":
            f0 = time.thread_time()
            SP.flush_decode_run(st)
            fold += time.thread_time() - f0
            fold_cpu.setdefault(kind, []).append(fold)
        cpu = time.thread_time() - c0 - fold
        if scratch is not None:  # the model's step is ms of noise: only the steps' own part is timed
            cpu = section
        q.take(len(q))
        return cpu

    kinds = args.kinds.split(",")
    cpu = {(k, m): [] for k in kinds for m in ("bare", "floor", "hooks")}
    for _ in range(args.rounds):  # interleaved: drift hits every mode alike
        for k in kinds:
            for m in ("bare", "floor", "hooks"):
                cpu[k, m].append(run(k, args.steps, m))
    us = {key: min(v) / args.steps * 1e6 for key, v in cpu.items()}  # noise only adds: the least is the cost
    for k in kinds:
        floor, hooks = us[k, "floor"] - us[k, "bare"], us[k, "hooks"] - us[k, "bare"]
        off = min(fold_cpu.get(k, [0.0])) / args.steps * 1e6
        print(f"{k:<8} {hooks:6.2f} us CPU per step over vLLM's side alone   (floor: the wrappers' clock reads and "
              f"calls {floor:4.2f} us; hooks x{hooks / max(floor, 1e-9):.1f} the floor); off the loop (prompt work sorted "
              f"out, decode steps folded into runs: in the export sidecar, or the step-flush thread without one): "
              f"{off:4.2f} us per step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
