"""The phase metrics' attribute lookups (collector/phase_metrics.py): the compiled pass over a
map column's entries against the Arrow kernels it replaced, on maps of every shape."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from ttftscope.collector import phase_metrics as P
from ttftscope.collector.otlp_wire import _jit

pytestmark = pytest.mark.skipif(_jit is None, reason="numba is not installed")


def _maps(rng: random.Random, n: int) -> pa.Array:
    keys = ["a", "b", "bb", "", "é", "ttftscope.phase", "x" * 40]
    rows = []
    for _ in range(n):
        if rng.random() < 0.1:
            rows.append(None)
            continue
        rows.append([(rng.choice(keys), str(rng.randrange(1000)) * rng.randint(0, 2)) for _ in range(rng.randint(0, 6))])
    return pa.array(rows, pa.map_(pa.string(), pa.string()))


def test_compiled_lookups_agree_with_the_arrow_kernels():
    assert P.warm_up(), "numba is installed: the lookup pass compiles"
    rng = random.Random(3)
    want = ("a", "bb", "", "é", "ttftscope.phase", "missing", "x" * 40)
    for trial in range(40):
        arr = _maps(rng, rng.randint(0, 60))
        if len(arr) > 4 and trial % 3 == 0:
            arr = arr.slice(rng.randrange(len(arr) // 2), len(arr) // 2)  # offsets that do not start at 0
        chunked = pa.chunked_array([arr, _maps(rng, 5)]) if trial % 4 == 0 else pa.chunked_array([arr])
        got = P._lookups(chunked, want)
        ref = P._lookups_arrow(chunked.combine_chunks(), want)
        for k in want:
            assert got[k].to_pylist() == ref[k].to_pylist(), (trial, k)
    # the first entry wins where a key repeats; a null map has no values
    arr = pa.array([[("a", "1"), ("a", "2")], None, []], pa.map_(pa.string(), pa.string()))
    assert P._lookups(arr, ("a",))["a"].to_pylist() == ["1", "", ""]
