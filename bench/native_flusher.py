"""The collector's flusher on its own, for bench/durable_floor.c: stores the spool segments the C
receiver seals with the collector's own flusher (``Pipeline.start()``: its thread, its wake-ups,
the compiled decode, the phase metrics, a Parquet part, the manifest commit, merges every 10 s).

Together they are what a collector with its receiver outside Python would cost: the C receiver's
CPU per request beside this flusher's per span, read from /proc by bench/ingest. With
``--receiver LIB PORT`` the receiver runs in this process, a thread of C code (bench/
durable_floor.c built as a shared library, called through ctypes, which lets go of the GIL),
as a C receiver inside the collector would; without it, in a process of its own. For
measurement only. It writes ``flusher.ready`` in the spool directory once it is ready, and on
SIGTERM stores what is sealed and exits.
Run: ``python bench/native_flusher.py SPOOL_DIR STORE_DIR [--receiver LIB PORT]``."""

from __future__ import annotations

import ctypes
import signal
import sys
import threading
import time

from ttftscope.collector import otlp_compiled, phase_metrics
from ttftscope.collector.pipeline import Pipeline
from ttftscope.collector.service import StopSignals
from ttftscope.collector.spool import Segment, Spool
from ttftscope.schemas.store import open_store


class AdoptingSpool(Spool):
    """A spool whose segments another writer (the C receiver) opens, fills and seals in its
    directory: the flusher finds them sealed, and is woken as the collector's is, when the
    segment open since the last seal falls due (every ``segment_age_s``)."""

    def __init__(self, directory: str, segment_age_s: float = 2.0) -> None:
        super().__init__(directory, segment_age_s=segment_age_s)  # (empty: nothing to recover)
        self._t0 = time.monotonic()

    def sealed(self) -> list[Segment]:
        for path in self.dir.glob("*.sealed"):
            seq = int(path.stem)
            if seq not in self._sealed:
                # rows: for the flusher's metrics only; not counted here (a second read of the
                # segment, which the collector's spool, counting as it appends, does not make)
                self._sealed[seq] = Segment(seq, path, 0, path.stat().st_size)
        return super().sealed()

    def due_in_s(self) -> float | None:
        age = self.segment_age_s
        return age - (time.monotonic() - self._t0) % age + 0.05  # just after the C code's seal


def main(spool_dir: str, store_dir: str, receiver: tuple[str, int] | None = None) -> None:
    stop = StopSignals(signal.SIGTERM).install()
    otlp_compiled.warm_up()
    phase_metrics.warm_up()
    spool = AdoptingSpool(spool_dir)
    p = Pipeline(lambda: open_store(store_dir), spool)
    p.start()  # its thread (ttftscope-flush in /proc) warms chDB up and flushes as the collector's
    if receiver is not None:  # serves for ever: a daemon thread, gone with the process
        run = ctypes.CDLL(receiver[0]).durable_floor_run
        run.argtypes = (ctypes.c_int, ctypes.c_char_p)
        threading.Thread(target=run, args=(receiver[1], spool_dir.encode()), name="c-receiver", daemon=True).start()
    (spool.dir / "flusher.ready").touch()
    stop.wait()
    p.stop(flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], (a[3], int(a[4])) if len(a) >= 5 and a[2] == "--receiver" else None)
