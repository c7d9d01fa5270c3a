"""The arrival check's per-span facts, read off the OTLP protobuf wire by compiled code.

``otlp.accept_protobuf`` must tell a client which spans it refused (OTLP partial success)
before acknowledging a request, so a few fields of every span are checked on arrival. Read
through the parsed message that is a Python loop over spans, most of the collector's CPU per
request once decoding moved into chDB. Here one pass over the raw bytes, compiled with numba,
fills a small table per span (id sizes, times, counts, its encoded size: a span's length
prefix is free), and numpy decides which spans are plainly fine. Only the rest (a bad id or
time, too many attributes, events, links, a big span) goes through the Python checks, which
stay the definition of what is accepted.

The bytes are scanned only after upb parsed them (so they are well-formed), yet every read
is bounds-checked: a scan that meets anything it does not expect (a group, a length past its
message, more spans than the parse found) gives up, and the caller checks every span in
Python as before. Without numba the same fallback is the only path.
"""

from __future__ import annotations

import logging

import numpy as np

from .otlp_wire import _all_zero, _fixed64, _jit, _skip, _tag, _varint

log = logging.getLogger("ttftscope.collector")

#: columns of the per-span table
SCOPE, TID_LEN, TID_ZERO, SID_LEN, SID_ZERO, PARENT_LEN, N_ATTRS, N_EVENTS_LINKS, SIZE = range(9)
N_COLS = 9

def _span(buf, pos, end, row, ints, times):
    """One Span message in ``buf[pos:end]`` into ``ints[row]`` / ``times[row]``; False when it
    cannot be scanned."""
    for c in range(1, N_COLS):
        ints[row, c] = 0
    times[row, 0] = 0
    times[row, 1] = 0
    ints[row, SIZE] = end - pos
    while pos < end:
        fnum, wire, pos = _tag(buf, pos, end)
        if pos < 0:
            return False
        if wire == 2 and (fnum == 1 or fnum == 2 or fnum == 4 or fnum == 9 or fnum == 11 or fnum == 13):
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return False
            nxt = pos + np.int64(n)
            if fnum == 1:  # trace_id (the last occurrence wins, as in the parsed message)
                ints[row, TID_LEN] = nxt - pos
                ints[row, TID_ZERO] = 1 if _all_zero(buf, pos, nxt) else 0
            elif fnum == 2:
                ints[row, SID_LEN] = nxt - pos
                ints[row, SID_ZERO] = 1 if _all_zero(buf, pos, nxt) else 0
            elif fnum == 4:
                ints[row, PARENT_LEN] = nxt - pos
            elif fnum == 9:
                ints[row, N_ATTRS] += 1
            else:
                ints[row, N_EVENTS_LINKS] += 1
            pos = nxt
        elif wire == 1 and (fnum == 7 or fnum == 8):
            if pos + 8 > end:
                return False
            times[row, fnum - 7] = _fixed64(buf, pos)
            pos += 8
        else:
            pos = _skip(buf, pos, end, wire)
            if pos < 0:
                return False
    return pos == end


def _scope(buf, pos, end, scope, row, ints, times):
    """The spans of one ScopeSpans message; the next row, or -1."""
    while pos < end:
        fnum, wire, pos = _tag(buf, pos, end)
        if pos < 0:
            return -1
        if fnum == 2 and wire == 2:
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos) or row >= ints.shape[0]:
                return -1
            nxt = pos + np.int64(n)
            ints[row, SCOPE] = scope
            if not _span(buf, pos, nxt, row, ints, times):
                return -1
            row += 1
            pos = nxt
        else:
            pos = _skip(buf, pos, end, wire)
            if pos < 0:
                return -1
    return row if pos == end else -1


def _scan(buf, ints, times, scopes):
    """Every span of an ExportTraceServiceRequest, in the parsed message's order. ``scopes``
    (one row per ScopeSpans: resource index, index within it) is filled as they come. Returns
    the number of spans, or -1 (scan failed: check in Python)."""
    end = buf.shape[0]
    pos = 0
    row = 0
    n_rs = 0
    n_scopes = 0
    while pos < end:
        fnum, wire, pos = _tag(buf, pos, end)
        if pos < 0:
            return -1
        if fnum == 1 and wire == 2:  # a ResourceSpans
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return -1
            rs_end = pos + np.int64(n)
            j = 0
            while pos < rs_end:
                f2, w2, pos = _tag(buf, pos, rs_end)
                if pos < 0:
                    return -1
                if f2 == 2 and w2 == 2:  # a ScopeSpans
                    m, pos = _varint(buf, pos, rs_end)
                    if pos < 0 or m > np.uint64(rs_end - pos) or n_scopes >= scopes.shape[0]:
                        return -1
                    ss_end = pos + np.int64(m)
                    scopes[n_scopes, 0] = n_rs
                    scopes[n_scopes, 1] = j
                    row = _scope(buf, pos, ss_end, n_scopes, row, ints, times)
                    if row < 0:
                        return -1
                    n_scopes += 1
                    j += 1
                    pos = ss_end
                else:
                    pos = _skip(buf, pos, rs_end, w2)
                    if pos < 0:
                        return -1
            if pos != rs_end:
                return -1
            n_rs += 1
        else:
            pos = _skip(buf, pos, end, wire)
            if pos < 0:
                return -1
    return row


def _fine(ints, times, lo, hi, max_dur, max_attrs, small, out):
    """``out[i]``: span ``i`` passes the Python checks untouched (ids, times, no limit within
    reach; ``small`` < 0: no span is big enough to reach one). Returns how many do. One
    compiled pass instead of a dozen numpy operations, whose fixed costs were most of a
    small request's check."""
    n = 0
    for i in range(ints.shape[0]):
        s = times[i, 0]
        e = times[i, 1]
        ok = (ints[i, TID_LEN] == 16 and ints[i, TID_ZERO] == 0 and ints[i, SID_LEN] == 8
              and ints[i, SID_ZERO] == 0 and (ints[i, PARENT_LEN] == 0 or ints[i, PARENT_LEN] == 8)
              and s >= lo and s <= hi and e >= s and e - s <= max_dur
              and ints[i, N_ATTRS] <= max_attrs and ints[i, N_EVENTS_LINKS] == 0
              and (small < 0 or ints[i, SIZE] <= small))
        out[i] = ok
        if ok:
            n += 1
    return n


if _jit is not None:
    _span = _jit(_span)
    _scope = _jit(_scope)
    _scan = _jit(_scan)
    _fine = _jit(_fine)

_broken = False  # the compiled scan failed once: stay on the Python path
_ready = False  # compiled (or loaded from numba's cache) by warm_up()


def available() -> bool:
    """The compiled scan can be used (numba is installed and the scan has not failed)."""
    return _jit is not None and not _broken


def scan(body: bytes, n_spans: int, n_scopes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(ints, times, scopes)`` for the ``n_spans`` spans in ``n_scopes`` ScopeSpans of a
    parsed request body (``ints`` columns: SCOPE .. SIZE; ``times``: start, end as uint64;
    ``scopes``: resource index, scope index within it), or None where the scan cannot vouch
    for them (not compiled yet: :func:`warm_up`; an unexpected encoding; counts that differ
    from the parse's)."""
    global _broken
    if not (_ready and available()):
        return None
    ints = np.empty((n_spans, N_COLS), dtype=np.int64)
    times = np.empty((n_spans, 2), dtype=np.uint64)
    scopes = np.empty((n_scopes, 2), dtype=np.int64)
    buf = np.frombuffer(body, dtype=np.uint8)
    buf.flags.writeable = False  # one signature for bytes and bytearray bodies (see warm_up)
    try:
        got = _scan(buf, ints, times, scopes)
    except Exception:  # noqa: BLE001 - never lose a request to the fast path
        _broken = True
        log.exception("the compiled OTLP scan failed; checking spans in Python from now on")
        return None
    if got != n_spans:
        return None
    return ints, times, scopes


def fine(ints: np.ndarray, times: np.ndarray, lo: int, hi: int, max_dur: int, max_attrs: int,
         small: int) -> tuple[int, np.ndarray] | None:
    """(how many, which) of the spans :func:`scan` read pass the checks untouched: valid ids,
    ``lo <= start <= hi``, ``start <= end <= start + max_dur``, at most ``max_attrs``
    attributes, no events or links, and (``small`` >= 0) at most ``small`` bytes. None:
    check them all in Python."""
    global _broken
    out = np.empty(len(ints), dtype=np.bool_)
    try:
        n = _fine(ints, times, np.uint64(lo), np.uint64(hi), np.uint64(max_dur), max_attrs, small, out)
    except Exception:  # noqa: BLE001 - never lose a request to the fast path
        _broken = True
        log.exception("the compiled span check failed; checking spans in Python from now on")
        return None
    return n, out


def warm_up() -> bool:
    """Compile the scan (seconds; from numba's cache on later starts, well under one) and use it
    from then on. A collector calls this on a thread of its own: requests that arrive before it
    is done are checked in Python. True when the compiled scan is in use."""
    global _ready, _broken
    if not available():
        return False
    try:
        empty = np.frombuffer(b"", dtype=np.uint8)
        empty.flags.writeable = False
        _scan(empty, np.empty((0, N_COLS), dtype=np.int64), np.empty((0, 2), dtype=np.uint64),
              np.empty((0, 2), dtype=np.int64))
        _fine(np.empty((0, N_COLS), dtype=np.int64), np.empty((0, 2), dtype=np.uint64), np.uint64(0), np.uint64(1),
              np.uint64(1), 1, -1, np.empty(0, dtype=np.bool_))  # (fine()'s own types; a failure lands below)
        # the receiver's event loop calls these: a call that needed compiling would wait for the
        # compiler lock, which the flush decode's warm-up holds for seconds on a cold cache, and
        # hold every connection up meanwhile. Compiled once, for the types they are given.
        _scan.disable_compile()
        _fine.disable_compile()
    except Exception:  # noqa: BLE001 - e.g. no compiler support on this platform
        _broken = True
        log.warning("cannot compile the OTLP arrival scan; spans are checked in Python", exc_info=True)
        return False
    _ready = True
    return True
