"""The process's one chDB engine (chDB runs one per process).

The embedded store's reads and the collector's OTLP decoding share it; every use holds
:data:`LOCK`, since a session carries state (the current database) between queries.
"""

from __future__ import annotations

import threading

LOCK = threading.RLock()
_SESSION = None

#: chDB's session: in memory (its default), with ClickHouse's background memory worker ticking
#: once a second instead of every 50 ms. That thread (``MemoryWorker``, at nice -20) reads the
#: cgroup's memory use for the memory tracker on every tick, whether or not a query runs: 20
#: wake-ups and ~3 ms of CPU a second in every process with an engine -- an idle collector or
#: UI beside vLLM included, and 1.0-1.4 us a span of a fleet-fed collector's ~15 (bench/ingest).
#: The tracker counts allocations as they happen either way; the tick only resets it to the
#: resident size and starts jemalloc's purge of freed pages past a threshold: a second late at most.
CONNECTION = ":memory:?memory_worker_period_ms=1000"


def session():
    """The shared chDB session, started on first use (call with :data:`LOCK` held)."""
    global _SESSION
    if _SESSION is None:
        from chdb import session as chdb_session

        _SESSION = chdb_session.Session(CONNECTION)
    return _SESSION


def started():
    """The session if one was started, else ``None`` (for clean-up that must not start one)."""
    return _SESSION
