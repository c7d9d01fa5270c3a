"""Truth on real vLLM: queueing because every seat (``--max-num-seqs``) is taken is named, with its size.

The same loads on two servers that differ only in ``--max-num-seqs`` (2 and 128, the most the
default token budget here allows), each load in its own window (support/truth.drive_seats):

* decodes holding the seats: three clients keep long completions (80 tokens) decoding back to
  back while measured requests (streaming, short prompts) arrive at random moments. With 2
  seats both are held by the long decodes and a third waits, so each measured request waits in
  vLLM's queue until seats free up; with 128 it is scheduled at once, beside the same decodes;
* a burst over the seats: 12 requests of 32 tokens sent at once, three times; with 2 seats
  they are served two by two. During the burst every worker step is 10 ms longer (a sleep, as
  device time: tests/planted), as when a step is mostly a GPU's: with this VM's host-bound steps
  (~4.5 ms each in the burst at 128 seats), twelve
  requests admitted at once slowed each other's tokenizing, output processing and steps on two
  cores by ~20 ms, which the 128-seat baseline paid and no queue counterfactual sees (the finding
  was 2-21% above the client's loss, 149.7 vs 123.8 ms in the worst run; with the device-time
  steps: 1204.8 vs 1191.7 ms).

What the seats cost is the client's own stopwatch (a process the CPU scheduler serves first,
support/stopwatch.py; the background clients run the same way): TTFT p50 with 2 seats minus
with 128, same test, same load. The report on the 2-seat window must name the queue as its top
finding, say that the seats were full while requests waited, and put its impact at p50 within
15% of that cost (issue 12); the 128-seat window must not name the queue above low.
"""

from __future__ import annotations

import pytest

from support.truth import analyze, served_seats, witness_ok

pytestmark = pytest.mark.slow  # real vLLM servers


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return served_seats(tmp_path_factory.mktemp("seats-2"), "seats2", 2)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    return served_seats(tmp_path_factory.mktemp("seats-128"), "seats128", 128)


@pytest.mark.parametrize("part", ["decodes", "burst"])
def test_requests_waiting_for_a_seat_are_named_with_their_size(full, roomy, part):
    from ttftscope.analyzer.impact import REMOVED, impact_ms

    df, store = full
    base, base_store = roomy
    df, base = df.filter(df["part"] == part), base.filter(base["part"] == part)
    effect = float(df["client_ms"].median() - base["client_ms"].median())
    ok, waits = witness_ok(df, effect)
    assert ok, f"the stopwatch was served a CPU when it needed one ({waits})"
    print(f"{part}: the seats cost the client {effect:.1f} ms at p50; queue p50 {df['queue'].median() / 1e6:.1f} ms "
          f"(128 seats: {base['queue'].median() / 1e6:.1f} ms)")
    assert effect >= 20, "the full seats reached the client"
    report = analyze(store, "seats2", since=df["since"].min(), until=df["until"].max())
    top = report["findings"][0]
    assert top["kind"] == "queue_dominates", [(f["kind"], f.get("impact_ms")) for f in report["findings"]]
    ev = top["evidence"]
    assert ev.get("seats") == 2 and ev.get("full_share", 0) >= 0.8, ev
    on_timed, _ = impact_ms(df, REMOVED["queue_dominates"](top))
    assert abs(on_timed["p50"] - effect) <= 0.15 * effect, (on_timed, effect)
    quiet = {f["kind"]: f["severity"] for f in analyze(base_store, "seats128", since=base["since"].min(),
                                                        until=base["until"].max())["findings"]}
    assert quiet.get("queue_dominates") in (None, "low"), quiet
