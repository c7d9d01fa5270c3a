"""Engine-loop bubbles sized per request, on planted intervals (their truth on real vLLM:
tests/truth/test_client_ttft.py, a planted pause in the engine loop)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from ttftscope.analyzer.gaps import bubble_delays
from ttftscope.analyzer.synth import spans_table
from ttftscope.analyzer.window import Window
from ttftscope.schemas.store import open_store
from ttftscope.schemas.vocabulary import Attr, SpanName

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def _spans(rows: list[tuple[str, str, int, int]], ipc_ns=None, engine: str = "engine-0") -> pa.Table:
    """(span name, trace id, start ms, duration ms) -> spans on one engine; ``ipc_ns``: each
    span's intake IPC attribute (only intake spans carry one)."""
    n = len(rows)
    name, trace, start, dur = (np.array(c, dtype=object) for c in zip(*rows, strict=True))
    attrs = {Attr.ENGINE: np.full(n, engine, dtype=object)}
    t = spans_table(n, T0 + start.astype(np.int64) * MS, trace, np.array([f"{i:016x}" for i in range(n)]), "", name,
               "Internal", "vllm", {"service.name": "vllm"}, attrs, dur.astype(np.int64) * MS)
    if ipc_ns is None:
        return t
    with_ipc = spans_table(n, T0 + start.astype(np.int64) * MS, trace, np.array([f"{i:016x}" for i in range(n)]), "", name,
                      "Internal", "vllm", {"service.name": "vllm"}, {**attrs, Attr.INTAKE_IPC_NS: ipc_ns},
                      dur.astype(np.int64) * MS)
    return pa.concat_tables([t.filter(pa.array(name != SpanName.INTAKE)), with_ipc.filter(pa.array(name == SpanName.INTAKE))])


def test_idle_between_steps_counts_inside_each_requests_wait_only(tmp_path):
    # steps at 0-4, 14-18, 28-32, 33-37 (ms): idle 10, 10 and 1 ms (the last below the 2 ms floor)
    steps = [(SpanName.STEP, f"s{i}", a, 4) for i, a in enumerate((0, 14, 28, 33))]
    reqs = [
        # scheduled at 1 ms, prefilled in the steps at 14 and 28: both 10 ms bubbles delayed it
        (SpanName.QUEUE, "a", 1, 13), (SpanName.PREFILL, "a", 14, 4), (SpanName.PREFILL, "a", 28, 4),
        # the scheduler had it at 20 ms, mid-bubble: 8 ms of it, none of the 1 ms one
        (SpanName.QUEUE, "b", 20, 8), (SpanName.PREFILL, "b", 33, 4),
        # prefilled in the first step: no bubble inside its wait
        (SpanName.QUEUE, "c", -1, 1), (SpanName.PREFILL, "c", 0, 4),
        # the input thread had it at 6 ms (sent at 5, 1 ms of IPC), the loop paused until 14:
        # scheduled then, prefilled in the step at 28: 8 + 10 ms of bubbles
        (SpanName.INTAKE, "d", 5, 9), (SpanName.QUEUE, "d", 14, 14), (SpanName.PREFILL, "d", 28, 4),
    ]
    st = open_store(str(tmp_path / "s"))
    ipc = np.array([MS if r[0] == SpanName.INTAKE else 0 for r in reqs])
    st.insert_spans(pa.concat_tables([_spans(steps), _spans(reqs, ipc)]), "p")
    got = dict(bubble_delays(st, Window(T0 - 10**9, T0 + 10**9)).iter_rows())
    assert got == {"a": 20 * MS, "b": 8 * MS, "d": 18 * MS}, got


def test_a_stretch_of_unwatched_quiet_steps_is_no_bubble_and_the_idle_after_it_is(tmp_path):
    """The plugin watches a sample of quiet decode steps (TTFTSCOPE_QUIET_STEPS); the steps it
    did not watch are one ``unobserved`` span. A request that reached the engine core's input
    thread inside that stretch waited for the engine stepping, not idle: no bubble there; the
    engine loop's pause after the stretch is one, from the stretch's end. Without the stretch on
    the timeline the same request would be charged the whole stretch (checked: the same spans
    with the unobserved one left out)."""
    from ttftscope.analyzer.gaps import engine_bubbles

    steps = [(SpanName.STEP, "s0", 0, 4), (SpanName.UNOBSERVED, "u", 4, 40), (SpanName.STEP, "s1", 50, 4)]
    # the input thread had it at 30 ms (sent at 29), mid-stretch; the stretch ended at 44, the loop
    # paused until 50 (a 6 ms bubble inside its wait), prefilled in the step at 50
    reqs = [(SpanName.INTAKE, "r", 29, 21), (SpanName.QUEUE, "r", 50, 0), (SpanName.PREFILL, "r", 50, 4)]
    ipc = np.array([MS if r[0] == SpanName.INTAKE else 0 for r in reqs])
    w = Window(T0 - 10**9, T0 + 10**9)
    got = {}
    for name, kept in (("whole", steps), ("without the stretch", [s for s in steps if s[0] != SpanName.UNOBSERVED])):
        st = open_store(str(tmp_path / name))
        st.insert_spans(pa.concat_tables([_spans(kept), _spans(reqs, ipc)]), "p")
        got[name] = dict(bubble_delays(st, w).iter_rows())
        if name == "whole":
            b = engine_bubbles(st, w)
            assert b["steps"] == 1 and b["busy_ms"] == 4.0, b  # (the first step has no gap before it) the stretch is no busy step
    assert got == {"whole": {"r": 6 * MS}, "without the stretch": {"r": 20 * MS}}, got
