"""Cold start split into phases on nested loading spans as real vLLM writes them (its truth on
real vLLM: tests/truth/test_client_ttft.py, a planted idle wait in a worker's start-up)."""

from __future__ import annotations

import numpy as np
from ttftscope.analyzer.coldstart import cold_start
from ttftscope.analyzer.synth import spans_table
from ttftscope.analyzer.window import Window
from ttftscope.schemas.store import open_store
from ttftscope.schemas.vocabulary import ResourceAttr, SpanName

S = 1_000_000_000
T0 = 1_700_000_000_000_000_000


def test_the_largest_gap_is_named_after_the_span_that_ended_last_before_it(tmp_path):
    """A worker's loading spans nest ("Load model" inside "Loading (CPU)", started after it and
    ending before it): the idle gap after them follows the outer span, whichever started last;
    before it is the first span after the gap."""
    rows = [  # (name, start s, duration s)
        (SpanName.PROCESS_START, 0.0, 30.0),
        ("Worker init", 1.0, 3.0),
        ("Loading (CPU)", 4.0, 6.0),  # 4-10
        ("Load model", 5.0, 4.5),  # 5-9.5, inside it
        ("Warmup (CPU)", 15.0, 12.0),  # after 5 s of nothing
        ("Allocate KV cache", 27.5, 2.5),
    ]
    n = len(rows)
    name, start, dur = zip(*rows, strict=True)
    t = spans_table(n, T0 + (np.array(start) * S).astype(np.int64), np.array(["t"] * n, dtype=object),
               np.array([f"{i:016x}" for i in range(n)]), "", np.array(name, dtype=object), "Internal", "vllm",
               {"service.name": "vllm", ResourceAttr.PROCESS_PID: "42", ResourceAttr.SERVICE_INSTANCE: "worker-42",
                ResourceAttr.ROLE: "worker"}, {"code.function": np.full(n, "f")}, (np.array(dur) * S).astype(np.int64))
    st = open_store(str(tmp_path / "s"))
    st.insert_spans(t, "p")
    (c,) = cold_start(st, Window(T0 - S, T0 + 60 * S))
    assert c["instance"] == "worker-42" and c["cold_start_s"] == 30.0
    g = c["largest_gap"]
    assert (g["after"], g["before"], g["seconds"]) == ("Loading (CPU)", "Warmup (CPU)", 5.0), g
    assert c["idle_s"] == 5.0 + 1.0 + 0.5  # 0-1, 10-15 and 27-27.5 s: nothing loading
