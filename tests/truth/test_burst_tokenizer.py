"""Truth on real vLLM: time before the queue, removed, is saved only as far as the queue lets it through.

Bursts of 50 prompts of 200 tokens at once on one server whose engine they keep busy (its queue
~80-120 ms at p50), a slow tokenizer (``support/truth.BURST_TOKENIZE_US_PER_TOKEN``: ~3 ms a
prompt in vLLM's tokenizer pool, which serves the burst one prompt at a time) switched on for
every other burst. The client's stopwatch says what the slow tokenizer cost: the shift of the slow
bursts' TTFT p50s from the others' — little, because the prompts it held back would have waited in the
engine's queue instead. Measured here before the fix: the report named tokenization first on
every slow burst with ~90 ms of impact at p50 (the plant's share of it, slow bursts minus the
others, 64-82 ms) where the client lost 2-24 ms (runs of eight and twelve bursts; another: -5 ms).
The impact of time before the queue now replays the engine's admissions (``analyzer.impact.through_the_queue``): the slow
bursts' tokenization impact less the others' must be within ``TOLERANCE_MS`` of what the client
lost, and on the slow bursts the queue, not tokenization, is the top finding. Twenty bursts of each
(2026-12-07, two runs): the client lost 6.1 and 5.9 ms, the replay said 9.9 and 12.1, the subtraction
66.4 and 67.8; with six of each, one CI run's witness had read -17 ms.
"""

from __future__ import annotations

import functools

import polars as pl
import pytest

from support.truth import (
    BURST_TOKENIZE_US_PER_TOKEN,
    WITNESS_MAX_WAIT_MS,
    analyze,
    drive_tokenizer_bursts,
    served,
    switched_env,
)

pytestmark = pytest.mark.slow  # a real vLLM server

#: the client's loss itself moves between runs here (-17 to 24 ms as the difference of pooled medians over
#: six bursts of each: one burst's p50 lies anywhere in 170-275 ms, clean or slow); the replay said 11-20
#: ms and the subtractive counterfactual 55-82 ms. Twenty bursts of each and a shift estimator that one
#: outlying burst cannot move hold the witness to a few ms; what this tells apart is a size of the
#: client's order from one several times it, not a few ms
TOLERANCE_MS = 25.0
#: bursts driven, every other one slow
BURSTS = 40


@pytest.fixture(scope="module")
def bursts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokbursts")
    sw = tmp / "switches"
    env = switched_env(sw, {"PLANTED_TOKENIZE_US_PER_TOKEN": str(BURST_TOKENIZE_US_PER_TOKEN)})
    return served(tmp, "tokbursts", env=env, drive=functools.partial(drive_tokenizer_bursts, switches=sw, bursts=BURSTS))


def shift(per: pl.DataFrame, col: str) -> float:
    """The slow bursts' ``col`` less the others', as the Hodges-Lehmann estimator: the median of
    every slow-minus-clean pair's difference (a burst whose p50 jumped by 80 ms moves it by one rank)."""
    slow, clean = per.filter(pl.col("slow")).select(col), per.filter(~pl.col("slow")).select(col)
    return float(slow.join(clean, how="cross", suffix="_clean").select(pl.col(col) - pl.col(f"{col}_clean"))
                 .to_series().median())


def test_a_slow_tokenizer_in_bursts_that_queue_is_sized_through_the_queue(bursts):
    from ttftscope.analyzer.impact import REMOVED, finding_impact, impact_ms

    df, store = bursts
    wait = df["client_cpu_wait_ms"]
    # (the harness's bound on a witness's wait, as every truth test's; 5 ms here failed a clean clone at 5.16)
    assert wait.max() < WITNESS_MAX_WAIT_MS, f"the stopwatch was served a CPU when it needed one (most {wait.max():.2f} ms)"
    tokenize = {"kind": "tokenize_dominates", "evidence": {}}
    per = pl.DataFrame([  # each burst over its own window: its client p50, the report's impact, the subtraction's
        {"burst": int(b["burst"][0]), "slow": bool(b["slow"][0]), "client": float(b["client_ms"].median()),
         "through": finding_impact(b, tokenize)[0]["p50"],
         "subtracted": impact_ms(b, REMOVED["tokenize_dominates"](tokenize))[0]["p50"]}
        for b in df.partition_by("burst")]).sort("burst")
    lost, plant, subtractive = (shift(per, c) for c in ("client", "through", "subtracted"))
    print(f"the slow tokenizer cost the client {lost:.1f} ms at p50; its impact through the queue {plant:.1f} ms "
          f"(subtracted: {subtractive:.1f} ms); per burst {per.rows()}")
    for burst in df.filter(pl.col("slow")).partition_by("burst"):
        report = analyze(store, "tokbursts", since=burst["since"].min(), until=burst["until"].max() + 1)
        kinds = [(f["kind"], (f.get("impact_ms") or {}).get("p50")) for f in report["findings"]]
        assert kinds and kinds[0][0] == "queue_dominates", kinds
    # the witness resolves the tolerance only where bursts of the same kind agree: the standard
    # error of the slow-minus-clean difference of per-burst p50s, from this run's own bursts (on a
    # machine where a burst's p50 was ~200 ms it was 3-8 ms; on one whose model ran ~10x slower,
    # ~2 s a burst, ~60 ms, and the client's "loss" read -11.5 ms: noise, not a measurement)
    g = per.group_by("slow").agg(pl.col("client").var().alias("v"), pl.len().alias("n"))
    se = float((g["v"] / g["n"]).sum()) ** 0.5
    if se > TOLERANCE_MS / 2:
        pytest.skip(f"this machine's bursts vary too much for the client's stopwatch to size a {TOLERANCE_MS:.0f}-ms "
                    f"difference (standard error {se:.1f} ms; clean p50s "
                    f"{[round(x, 1) for x in per.filter(~pl.col('slow'))['client']]} ms)")
    # the plant held the prompts back before the queue far beyond what the client lost: else this
    # test could not tell the replay from the subtraction
    assert subtractive - lost > TOLERANCE_MS, (subtractive, lost, per.rows())
    assert abs(plant - lost) <= TOLERANCE_MS, (plant, lost, per.rows())
