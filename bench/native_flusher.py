"""The collector's flusher on its own, for bench/durable_floor.c: stores the spool segments the C
receiver seals, with the collector's own code (``Pipeline._write``: the compiled decode, the
phase metrics, a Parquet part, the manifest commit; ``Pipeline._maintain`` every 10 s: merges).

Together they are what a collector with its receiver outside Python would cost: the C receiver's
CPU per request beside this flusher's per span, read from /proc by bench/ingest. With
``--receiver LIB PORT`` the receiver runs in this process, a thread of C code (bench/
durable_floor.c built as a shared library, called through ctypes, which lets go of the GIL),
as a C receiver inside the collector would; without it, in a process of its own. For
measurement only. On SIGTERM it stores what is sealed and exits.
Run: ``python bench/native_flusher.py SPOOL_DIR STORE_DIR [--receiver LIB PORT]``."""

from __future__ import annotations

import ctypes
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from ttftscope.collector import otlp_compiled, phase_metrics
from ttftscope.collector.otlp_sql import warm_up
from ttftscope.collector.pipeline import Pipeline
from ttftscope.collector.spool import Segment, Spool
from ttftscope.schemas.store import open_store


def main(spool_dir: str, store_dir: str, receiver: tuple[str, int] | None = None) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    otlp_compiled.warm_up()
    phase_metrics.warm_up()
    warm_up()
    if receiver is not None:  # serves for ever: a daemon thread, gone with the process
        run = ctypes.CDLL(receiver[0]).durable_floor_run
        run.argtypes = (ctypes.c_int, ctypes.c_char_p)
        threading.Thread(target=run, args=(receiver[1], spool_dir.encode()), name="c-receiver", daemon=True).start()
    # the segments are the C receiver's; this Spool only lends its reading, tokens and removal
    p = Pipeline(lambda: open_store(store_dir), Spool(tempfile.mkdtemp(prefix="native-flusher-")))
    done: set[int] = set()
    last_maintain = time.monotonic()
    while True:
        stopping = stop.is_set()
        for path in sorted(Path(spool_dir).glob("*.sealed")):
            seq = int(path.stem)
            if seq in done:
                continue
            # rows: for the flusher's metrics only; not counted here (a second read of the
            # segment, which the collector's spool, counting as it appends, does not make)
            p._write(Segment(seq, path, 0, path.stat().st_size))
            done.add(seq)
        if stopping:
            break
        if time.monotonic() - last_maintain >= p.maintain_every_s:
            last_maintain = time.monotonic()
            p._maintain()
        stop.wait(0.5)  # (the collector's flusher sleeps until a segment is due)
    p.store.close() if p.store is not None else None


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], (a[3], int(a[4])) if len(a) >= 5 and a[2] == "--receiver" else None)
