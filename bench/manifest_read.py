"""bench/manifest_read: what reading the embedded store's manifest costs once a collector has run
for hours, with the cyclic GC paused for the parse (``schemas/store/embedded._json_loads``) and
without.

The manifest keeps the last ``token_window`` (10,000) insert tokens, one a flush: a collector
flushing every 2 s gets there in under six hours, and stays there. Each flush reads the manifest
twice (``insert_spans``: the replay check, then the commit), and the first query after each flush
once. Parsed with the GC on, its ~10k small lists set off collections that walk every object of
the process; a collector holds ~180k once its pipeline has warmed up (pyarrow, numba, chDB's
bindings). Timed here in such a process (this bench warms the same pipeline up first): a read,
and a 5k-span ``insert_spans`` (a fleet's 2-s flush), on a fresh store and on one at the window,
thread CPU, median of interleaved --rounds. (How often the GC's older generations run depends on
the process's state: in this bench's process the reads cost the same either way, 1.6 ms, while
another process of the same kind read 7.9-8.2 ms with the GC on against 1.2-1.3 paused; a real
collector's figure is bench/ingest.py --aged-store.) Run it on an older ttftscope (no paused
parse) and it times the store as it is. Since the window is kept as runs of a spool's segment
numbers (``schemas/store/tokens.py``; this bench's own inserts use tokens of no spool form, an
entry each) a store at the window reads and inserts as a fresh one: the old tokens, one by one,
become one run at its first commit.

Usage: python bench/manifest_read.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # support/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ingest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()

    import orjson
    import ttftscope.schemas.store.embedded as E
    from ingest import age
    from ttftscope.collector import otlp_compiled
    from ttftscope.collector.otlp_sql import warm_up
    from ttftscope.collector.pipeline import Pipeline
    from ttftscope.collector.spool import Spool
    from ttftscope.schemas.store import open_store

    from support.otlp import plugin_like_request

    tmp = Path(tempfile.mkdtemp())
    spool = Spool(tmp / "spool", segment_bytes=1 << 30, segment_age_s=1e6)
    pipe = Pipeline(lambda: open_store(str(tmp / "warm")), spool)
    warm_up()
    otlp_compiled.warm_up()

    def table(seed: int):  # a fleet's 2-s flush: ~5k spans in 20-50-span bodies
        n, i = 0, 0
        while n < 5200:
            k = 20 + (seed * 7 + i * 13) % 31
            pipe.submit_otlp(plugin_like_request(k, seed=seed * 100_000 + i), k)
            n, i = n + k, i + 1
        spool.seal()
        seg = spool.sealed()[0]
        t = pipe._decode(seg)
        spool.remove(seg)
        return t

    pipe._get_store().insert_spans(table(0), "warm")  # the pipeline warmed up, as a collector's is
    age(str(tmp / "aged"))  # bench/ingest's: the manifest of a store that has run for hours
    fresh, aged = open_store(str(tmp / "fresh")), open_store(str(tmp / "aged"))
    for st in (fresh, aged):
        st.insert_spans(table(1), "first")
    tables = [table(2 + r) for r in range(4 * a.rounds)]
    paused = getattr(E, "_json_loads", None)  # (None: a ttftscope before it, to compare against)
    rows: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        ways = (("GC paused", paused), ("GC on", orjson.loads)) if paused is not None else (("as it is", None),)
        for parse, fn in ways if r % 2 == 0 else ways[::-1]:
            if fn is not None:
                E._json_loads = fn
            for name, st in (("fresh", fresh), ("at the window", aged)):
                t = time.thread_time()
                st._read_manifest()
                rows.setdefault((name, parse, "read"), []).append(time.thread_time() - t)
                tb = tables.pop()
                t = time.thread_time()
                st.insert_spans(tb, uuid.uuid4().hex)
                rows.setdefault((name, parse, "insert"), []).append(time.thread_time() - t)
    if paused is not None:
        E._json_loads = paused
    print(f"objects the GC tracks in this process: {len(gc.get_objects()):,}; manifest at the window: "
          f"{aged.manifest_path.stat().st_size:,} bytes")
    print(f"{'store':<15}{'parse':<11}{'read ms':>9}{'insert (5k spans) ms':>22}   (median of {a.rounds} rounds)")
    for name in ("fresh", "at the window"):
        for parse in sorted({k[1] for k in rows}):
            rd, ins = (statistics.median(rows[(name, parse, k)]) * 1e3 for k in ("read", "insert"))
            print(f"{name:<15}{parse:<11}{rd:>9.2f}{ins:>22.2f}")


if __name__ == "__main__":
    main()
