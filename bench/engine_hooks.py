"""bench/engine_hooks: CPU per engine step of the plugin's scheduler hooks, by kind of step.

The engine core's hooks run on vLLM's engine loop, so their cost is paid on every step
(issue 16's budget: <= 3 us of CPU per step, <= 20 us per request). This drives the real
hook functions (``collector/vllm_plugin/engine.py``: ``_on_add``, ``_on_schedule``,
``_on_step_done``) with plain objects carrying the attributes they declare (real vLLM
drives them in tests/test_vllm_plugin.py and bench/overhead.py), into the real deferred-span
queue (what the export thread drains), and reports CPU per step (``time.thread_time``) for:

  decode      decode-only steps, nobody waiting (merged into runs)
  waiting     decode-only steps with requests waiting (each its own span)
  prefill     a step that admits one new request (intake, queue, one prefill chunk)
  chunked     a step carrying the next chunk of a long prompt

next to the floor measured in the same run: the same wrappers around schedule() and
update_from_output() with empty bodies (two clock reads and a call each).

Usage: python bench/engine_hooks.py [--steps 20000]
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
    args = ap.parse_args()

    from ttftscope.collector.otel_setup import DeferredSpans
    from ttftscope.collector.vllm_plugin import engine as E
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

    def run(kind: str, n: int) -> float:
        st = E.EngineState()
        sched = NS(requests={}, running=running, waiting=[], max_num_running_reqs=256)
        cpu = 0.0
        for i in range(n):
            new, tokens, waiting = (), {f"d{j}": 1 for j in range(16)}, 0
            if kind == "waiting":
                waiting = 3
            elif kind == "prefill":
                r = request(i, 100)
                sched.requests[r.request_id] = r
                new, tokens = (NS(req_id=r.request_id),), {**tokens, r.request_id: 100}
            elif kind == "chunked":
                if i % 8 == 0:
                    r = request(i, 800)
                    sched.requests[r.request_id] = r
                    new = (NS(req_id=r.request_id),)
                rid = next(reversed(sched.requests))
                tokens = {**tokens, rid: 100}
            sched.waiting = [0] * waiting
            out = NS(num_scheduled_tokens=tokens, scheduled_new_reqs=list(new),
                     total_num_scheduled_tokens=sum(tokens.values()))
            c0 = time.thread_time()
            for nr in new:
                E._on_add(st, sched.requests[nr.req_id])
            cpu += time.thread_time() - c0
            for rid, k in tokens.items():  # what vLLM's schedule() itself does (not timed)
                if rid in sched.requests:
                    sched.requests[rid].num_computed_tokens += k
            c0 = time.thread_time()
            t0 = time.time()
            t1 = time.time()
            E._on_schedule(st, sched, out, t0, t1)
            t_u0 = time.time()
            E._on_step_done(st, sched, out, t_u0, time.time())
            cpu += time.thread_time() - c0
            for nr in new:
                if kind == "prefill":
                    sched.requests.pop(nr.req_id, None)
            if len(q) > 100_000:
                q.take(len(q))
        E.flush_decode_run(st)
        q.take(len(q))
        return cpu / n * 1e6

    def floor(n: int) -> float:
        def schedule():
            return None

        def update():
            return None

        cpu = 0.0
        for _ in range(n):
            c0 = time.thread_time()
            t0 = time.time()
            schedule()
            t1 = time.time()
            update()
            _ = (t0, t1, time.time())
            cpu += time.thread_time() - c0
        return cpu / n * 1e6

    base = floor(args.steps)
    print(f"floor (empty hooks, same clocks): {base:.2f} us per step")
    for kind in ("decode", "waiting", "prefill", "chunked"):
        us = run(kind, args.steps)
        print(f"{kind:<8} {us:6.2f} us CPU per step  (x{us / base:.1f} the floor)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
