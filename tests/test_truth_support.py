"""The truth suite's own plumbing, checked without a server (its tests are slow: a mistake
here shows up as a rare, unexplained failure of a whole module's fixture)."""

import polars as pl

from support.truth import client_rid, witness_ok


def test_client_ids_are_recovered_from_engine_ids():
    # a chat completion's id whose 16 hex digits are all decimal (about 1 in 1,800) was once
    # cut to "chatcmpl": its request looked missing from the report
    engine = ["cmpl-9da446c5181aaa93-0", "cmpl-1234567890123456-3", "chatcmpl-8949047998111619",
              "chatcmpl-a3d6ed487267ca56", "cmpl-abc"]
    got = pl.DataFrame({"r": engine}).select(client_rid(pl.col("r")))["r"].to_list()
    assert got == ["cmpl-9da446c5181aaa93", "cmpl-1234567890123456", "chatcmpl-8949047998111619",
                   "chatcmpl-a3d6ed487267ca56", "cmpl-abc"]


def test_the_stopwatch_witness_check_tolerates_a_lone_wait_not_a_habit():
    """The client's stopwatch counts as a witness when 9 requests in 10 waited under 2 ms for a
    CPU and none waited 10 ms (support/truth.witness_ok)."""
    quiet = [0.05] * 95
    assert witness_ok(pl.DataFrame({"client_cpu_wait_ms": [*quiet, 3.3]}))[0]  # one 3.3 ms wait in 96
    assert not witness_ok(pl.DataFrame({"client_cpu_wait_ms": [*quiet[:76], *[3.0] * 20]}))[0]  # a fifth waited
    assert not witness_ok(pl.DataFrame({"client_cpu_wait_ms": [*quiet, 12.0]}))[0]  # one long wait


def test_against_a_large_effect_the_witness_may_wait_a_little_longer():
    """A burst's stopwatch waits once for its twelve requests: one 5.1-ms wait in three bursts
    fails the plain check, not one against a 1.2-s effect; against a 20-ms effect it still does."""
    bursts = pl.DataFrame({"client_cpu_wait_ms": [0.3] * 24 + [5.1] * 12})
    assert not witness_ok(bursts)[0]
    assert witness_ok(bursts, 1200.0)[0]
    assert not witness_ok(bursts, 20.0)[0]
    assert not witness_ok(pl.DataFrame({"client_cpu_wait_ms": [0.3] * 24 + [70.0] * 12}), 1200.0)[0]
