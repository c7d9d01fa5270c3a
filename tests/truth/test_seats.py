"""Truth on real vLLM: queueing because decoding requests hold every seat is named, with its size.

The same load on two servers that differ only in ``--max-num-seqs``: three clients keep long
completions (80 tokens) decoding back to back while measured requests (streaming, short
prompts) arrive at random moments. With 2 seats both are held by the long decodes and a third
waits, and each measured request waits in vLLM's queue until seats free up; with 128 seats
(the most the default token budget here allows) it is scheduled at once, beside the same decodes. What the seats cost is the client's own stopwatch:
TTFT p50 with 2 seats minus with 128, same test. The report on the 2-seat run must name the
queue as its top finding, say that the seats were full while requests waited, and put its
impact at p50 within 15% of that cost (issue 12); the 128-seat run must not name the queue.
"""

from __future__ import annotations

import functools

import pytest

from support.truth import analyze, drive_busy, served

pytestmark = pytest.mark.slow  # real vLLM servers

_drive = functools.partial(drive_busy, bg_tokens=80, n=12, clients=3)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return served(tmp_path_factory.mktemp("seats-2"), "seats2", drive=_drive, extra=["--max-num-seqs", "2"])


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    return served(tmp_path_factory.mktemp("seats-128"), "seats128", drive=_drive, extra=["--max-num-seqs", "128"])


def test_decodes_holding_the_seats_are_named_with_their_size(full, roomy):
    from ttftscope.analyzer.impact import REMOVED, impact_ms

    df, store = full
    base, base_store = roomy
    effect = float(df["client_ms"].median() - base["client_ms"].median())
    print(f"seats cost the client {effect:.1f} ms at p50; queue p50 {df['queue'].median() / 1e6:.1f} ms "
          f"(128 seats: {base['queue'].median() / 1e6:.1f} ms)")
    assert effect >= 20, "the full seats reached the client"
    report = analyze(store, "seats2")
    top = report["findings"][0]
    assert top["kind"] == "queue_dominates", [(f["kind"], f.get("impact_ms")) for f in report["findings"]]
    ev = top["evidence"]
    assert ev.get("seats") == 2 and ev.get("full_share", 0) >= 0.8, ev
    on_timed, _ = impact_ms(df, REMOVED["queue_dominates"](top))
    assert abs(on_timed["p50"] - effect) <= 0.15 * effect, (on_timed, effect)
    quiet = {f["kind"]: f["severity"] for f in analyze(base_store, "seats128")["findings"]}
    assert quiet.get("queue_dominates") in (None, "low"), quiet
