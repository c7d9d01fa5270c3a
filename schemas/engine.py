"""The process's one chDB engine (chDB runs one per process).

The embedded store's reads and the collector's OTLP decoding share it; every use holds
:data:`LOCK`, since a session carries state (the current database) between queries.
"""

from __future__ import annotations

import threading

LOCK = threading.RLock()
_SESSION = None


def session():
    """The shared chDB session, started on first use (call with :data:`LOCK` held)."""
    global _SESSION
    if _SESSION is None:
        from chdb import session as chdb_session

        _SESSION = chdb_session.Session()
    return _SESSION


def started():
    """The session if one was started, else ``None`` (for clean-up that must not start one)."""
    return _SESSION
