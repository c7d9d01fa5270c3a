"""The arrival check's per-span facts, read off the OTLP protobuf wire by compiled code.

``otlp.accept_protobuf`` must tell a client which spans it refused (OTLP partial success)
before acknowledging a request, so a few fields of every span are checked on arrival. Read
through the parsed message that is a Python loop over spans, most of the collector's CPU per
request once decoding moved into chDB. Here one pass over the raw bytes, compiled with numba,
fills a small table per span (id sizes, times, counts, its encoded size: a span's length
prefix is free), and numpy decides which spans are plainly fine. Only the rest (a bad id or
time, too many attributes, events, links, a big span) goes through the Python checks, which
stay the definition of what is accepted.

Most requests are not parsed by upb at all: :func:`validate` walks every field of every
message (UTF-8 of every string included) and says when upb would parse the body, judging each
span as it goes (the same facts :func:`scan` reads, the same verdict as :func:`fine`); only
then, and when every span is plainly fine and no Resource is near a limit, is the parse
skipped (upb's parse was a quarter of the receiver's CPU) and no second walk is needed (a
35-span request's check 44-64 -> 32-39 us). Anything it does not judge (an unknown
field, a damaged body) is parsed by upb as before. Every read is bounds-checked: a walk that
meets anything it does not expect (a group, a length past its message, more spans than the
parse found) gives up, and the caller checks every span in Python as before. Without numba
the same fallback is the only path.
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


def _plain(tid_len, tid_zero, sid_len, sid_zero, parent_len, s, e, n_attrs, n_el, size, lo, hi, max_dur,
           max_attrs, small):
    """A span passes the Python checks untouched: valid ids, ``lo <= start <= hi``, ``start <=
    end <= start + max_dur``, at most ``max_attrs`` attributes, no events or links, and (``small``
    >= 0) at most ``small`` bytes. The one definition both :func:`_fine` and :func:`_validate` use."""
    return (tid_len == 16 and tid_zero == 0 and sid_len == 8 and sid_zero == 0
            and (parent_len == 0 or parent_len == 8)
            and s >= lo and s <= hi and e >= s and e - s <= max_dur
            and n_attrs <= max_attrs and n_el == 0 and (small < 0 or size <= small))


def _fine(ints, times, lo, hi, max_dur, max_attrs, small, out):
    """``out[i]``: span ``i`` passes the Python checks untouched (:func:`_plain`; ``small`` < 0:
    no span is big enough to reach a limit). Returns how many do. One compiled pass instead of
    a dozen numpy operations, whose fixed costs were most of a small request's check."""
    n = 0
    for i in range(ints.shape[0]):
        ok = _plain(ints[i, TID_LEN], ints[i, TID_ZERO], ints[i, SID_LEN], ints[i, SID_ZERO], ints[i, PARENT_LEN],
                    times[i, 0], times[i, 1], ints[i, N_ATTRS], ints[i, N_EVENTS_LINKS], ints[i, SIZE], lo, hi,
                    max_dur, max_attrs, small)
        out[i] = ok
        if ok:
            n += 1
    return n


# ------------------------------------------------------------------ validation
# Which bytes upb would parse, decided without building the message: every field of every
# message the request can hold, by (message, field number), with its kind. Anything else (an
# unknown field, a wire type that does not match, a group, nesting deeper than MAX_DEPTH) is
# not judged here: the caller parses with upb as before. So a "valid" verdict must be one upb
# agrees with, and an "unsure" one costs only the parse it would have done anyway.
#: message kinds
REQ, RS, RES, SS, SCOPE_MSG, SPAN, EVENT, LINK, STATUS, KV, ANY, ARR, KVLIST, ENTITY = range(14)
N_MSG = 14
#: field kinds
F_NONE, F_VARINT, F_FIXED64, F_FIXED32, F_BYTES, F_STRING, F_MSG = range(7)
#: (message, field number, kind, child message) from opentelemetry-proto (trace/common/resource v1);
#: tests/test_otlp_scan.py holds it to the installed descriptors
FIELDS = (
    (REQ, 1, F_MSG, RS),
    (RS, 1, F_MSG, RES), (RS, 2, F_MSG, SS), (RS, 3, F_STRING, 0),
    (RES, 1, F_MSG, KV), (RES, 2, F_VARINT, 0), (RES, 3, F_MSG, ENTITY),
    (ENTITY, 1, F_STRING, 0), (ENTITY, 2, F_STRING, 0), (ENTITY, 3, F_STRING, 0), (ENTITY, 4, F_STRING, 0),
    (SS, 1, F_MSG, SCOPE_MSG), (SS, 2, F_MSG, SPAN), (SS, 3, F_STRING, 0),
    (SCOPE_MSG, 1, F_STRING, 0), (SCOPE_MSG, 2, F_STRING, 0), (SCOPE_MSG, 3, F_MSG, KV), (SCOPE_MSG, 4, F_VARINT, 0),
    (SPAN, 1, F_BYTES, 0), (SPAN, 2, F_BYTES, 0), (SPAN, 3, F_STRING, 0), (SPAN, 4, F_BYTES, 0),
    (SPAN, 5, F_STRING, 0), (SPAN, 6, F_VARINT, 0), (SPAN, 7, F_FIXED64, 0), (SPAN, 8, F_FIXED64, 0),
    (SPAN, 9, F_MSG, KV), (SPAN, 10, F_VARINT, 0), (SPAN, 11, F_MSG, EVENT), (SPAN, 12, F_VARINT, 0),
    (SPAN, 13, F_MSG, LINK), (SPAN, 14, F_VARINT, 0), (SPAN, 15, F_MSG, STATUS), (SPAN, 16, F_FIXED32, 0),
    (EVENT, 1, F_FIXED64, 0), (EVENT, 2, F_STRING, 0), (EVENT, 3, F_MSG, KV), (EVENT, 4, F_VARINT, 0),
    (LINK, 1, F_BYTES, 0), (LINK, 2, F_BYTES, 0), (LINK, 3, F_STRING, 0), (LINK, 4, F_MSG, KV),
    (LINK, 5, F_VARINT, 0), (LINK, 6, F_FIXED32, 0),
    (STATUS, 2, F_STRING, 0), (STATUS, 3, F_VARINT, 0),
    (KV, 1, F_STRING, 0), (KV, 2, F_MSG, ANY), (KV, 3, F_VARINT, 0),
    (ANY, 1, F_STRING, 0), (ANY, 2, F_VARINT, 0), (ANY, 3, F_VARINT, 0), (ANY, 4, F_FIXED64, 0),
    (ANY, 5, F_MSG, ARR), (ANY, 6, F_MSG, KVLIST), (ANY, 7, F_BYTES, 0), (ANY, 8, F_VARINT, 0),
    (ARR, 1, F_MSG, ANY), (KVLIST, 1, F_MSG, KV),
)
MAX_FIELD = 16
MAX_DEPTH = 32  # upb allows 100; deeper requests are rare and parsed by upb
_KIND = np.zeros((N_MSG, MAX_FIELD + 1), dtype=np.int64)
_CHILD = np.zeros((N_MSG, MAX_FIELD + 1), dtype=np.int64)
for _m, _f, _k, _c in FIELDS:
    _KIND[_m, _f], _CHILD[_m, _f] = _k, _c
_WIRE = np.array([-1, 0, 1, 5, 2, 2, 2], dtype=np.int64)  # the wire type of each field kind


def _utf8(buf, a, b):
    """``buf[a:b]`` is well-formed UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing
    past U+10FFFF), as upb requires of a proto3 string."""
    i = a
    while i < b:
        c = buf[i]
        if c < 0x80:
            i += 1
            continue
        if c < 0xC2 or c > 0xF4:
            return False
        if c < 0xE0:
            if i + 1 >= b or buf[i + 1] & 0xC0 != 0x80:
                return False
            i += 2
            continue
        if c < 0xF0:
            if i + 2 >= b or buf[i + 1] & 0xC0 != 0x80 or buf[i + 2] & 0xC0 != 0x80:
                return False
            if (c == 0xE0 and buf[i + 1] < 0xA0) or (c == 0xED and buf[i + 1] >= 0xA0):
                return False
            i += 3
            continue
        if (i + 3 >= b or buf[i + 1] & 0xC0 != 0x80 or buf[i + 2] & 0xC0 != 0x80
                or buf[i + 3] & 0xC0 != 0x80):
            return False
        if (c == 0xF0 and buf[i + 1] < 0x90) or (c == 0xF4 and buf[i + 1] >= 0x90):
            return False
        i += 4
    return True


def _validate(buf, kind, child, wire_of, lo, hi, max_dur, max_attrs, small, out):
    """Walk a whole ExportTraceServiceRequest (an explicit stack, no recursion). True when upb
    would parse it; then ``out`` = (spans, ScopeSpans, the most attributes of a Resource, the
    largest Resource's encoded size, spans plainly fine). False: not judged here (see above).

    A span is judged by :func:`_plain` on the fields :func:`_scan` reads (the last occurrence
    of each winning), read in this same walk: a request whose spans are all fine needs no
    second walk over its bytes."""
    n_fine = 0
    span_depth = -1  # the stack level of the span being walked (-1: none)
    tid_len = tid_zero = sid_len = sid_zero = parent_len = n_attrs = n_el = span_size = 0
    t_start = np.uint64(0)
    t_end = np.uint64(0)
    ends = np.empty(MAX_DEPTH + 1, dtype=np.int64)
    types = np.empty(MAX_DEPTH + 1, dtype=np.int64)
    depth = 0
    ends[0] = buf.shape[0]
    types[0] = REQ
    pos = 0
    n_spans = 0
    n_scopes = 0
    res_attrs = 0
    res_bytes = 0
    most_attrs = 0
    most_bytes = 0
    while True:
        end = ends[depth]
        if pos >= end:
            if depth == 0:
                break
            if depth == span_depth:  # a span's last field read: judge it
                span_depth = -1
                if _plain(tid_len, tid_zero, sid_len, sid_zero, parent_len, t_start, t_end, n_attrs, n_el,
                          span_size, lo, hi, max_dur, max_attrs, small):
                    n_fine += 1
            depth -= 1
            continue
        fnum, wire, pos = _tag(buf, pos, end)
        if pos < 0 or fnum == np.uint64(0) or fnum > np.uint64(MAX_FIELD):
            return False
        m = types[depth]
        f = np.int64(fnum)
        k = kind[m, f]
        if k == F_NONE or wire != wire_of[k]:
            return False
        if k == F_VARINT:
            _, pos = _varint(buf, pos, end)
            if pos < 0:
                return False
        elif k == F_FIXED64:
            if pos + 8 > end:
                return False
            if m == SPAN:
                if f == 7:
                    t_start = _fixed64(buf, pos)
                elif f == 8:
                    t_end = _fixed64(buf, pos)
            pos += 8
        elif k == F_FIXED32:
            if pos + 4 > end:
                return False
            pos += 4
        else:
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return False
            nxt = pos + np.int64(n)
            if k == F_STRING:
                if not _utf8(buf, pos, nxt):
                    return False
                pos = nxt
            elif k == F_BYTES:
                if m == SPAN:
                    if f == 1:
                        tid_len = nxt - pos
                        tid_zero = 1 if _all_zero(buf, pos, nxt) else 0
                    elif f == 2:
                        sid_len = nxt - pos
                        sid_zero = 1 if _all_zero(buf, pos, nxt) else 0
                    elif f == 4:
                        parent_len = nxt - pos
                pos = nxt
            else:
                if depth == MAX_DEPTH:
                    return False
                c = child[m, f]
                if c == SPAN:
                    n_spans += 1
                    span_depth = depth + 1
                    tid_len = tid_zero = sid_len = sid_zero = parent_len = n_attrs = n_el = 0
                    span_size = nxt - pos
                    t_start = np.uint64(0)
                    t_end = np.uint64(0)
                elif m == SPAN:
                    if f == 9:
                        n_attrs += 1
                    elif f == 11 or f == 13:
                        n_el += 1
                elif c == SS:
                    n_scopes += 1
                elif c == RS:  # (a Resource given twice is merged by upb: counted per ResourceSpans)
                    res_attrs = 0
                    res_bytes = 0
                elif c == RES:
                    res_bytes += nxt - pos
                    if res_bytes > most_bytes:
                        most_bytes = res_bytes
                elif c == KV and m == RES:
                    res_attrs += 1
                    if res_attrs > most_attrs:
                        most_attrs = res_attrs
                depth += 1
                ends[depth] = nxt
                types[depth] = c
    out[0] = n_spans
    out[1] = n_scopes
    out[2] = most_attrs
    out[3] = most_bytes
    out[4] = n_fine
    return True


if _jit is not None:
    _span = _jit(_span)
    _scope = _jit(_scope)
    _scan = _jit(_scan)
    _plain = _jit(_plain)
    _fine = _jit(_fine)
    _utf8 = _jit(_utf8)
    _validate = _jit(_validate)

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


def validate(body: bytes, lo: int = 0, hi: int = 2**64 - 1, max_dur: int = 2**64 - 1, max_attrs: int = 2**62,
             small: int = -1) -> tuple[int, int, int, int, int] | None:
    """``(spans, ScopeSpans, the most attributes of a Resource, the largest Resources' encoded
    size, spans plainly fine)`` of a request upb would parse, read without parsing it; None
    where this pass does not judge (not compiled yet, an unknown field, a malformed or invalid
    body: parse it). Plainly fine: as :func:`fine` judges a span with these limits."""
    global _broken
    if not (_ready and available()):
        return None
    buf = np.frombuffer(body, dtype=np.uint8)
    buf.flags.writeable = False
    out = np.zeros(5, dtype=np.int64)
    try:
        ok = _validate(buf, _KIND, _CHILD, _WIRE, np.uint64(lo), np.uint64(hi), np.uint64(max_dur), max_attrs,
                       small, out)
    except Exception:  # noqa: BLE001 - never lose a request to the fast path
        _broken = True
        log.exception("the compiled OTLP validation failed; parsing every request from now on")
        return None
    return (int(out[0]), int(out[1]), int(out[2]), int(out[3]), int(out[4])) if ok else None


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
        _validate(empty, _KIND, _CHILD, _WIRE, np.uint64(0), np.uint64(1), np.uint64(1), 1, -1,
                  np.zeros(5, dtype=np.int64))  # (validate()'s own types, as for _fine)
        _scan.disable_compile()
        _fine.disable_compile()
        _validate.disable_compile()
    except Exception:  # noqa: BLE001 - e.g. no compiler support on this platform
        _broken = True
        log.warning("cannot compile the OTLP arrival scan; spans are checked in Python", exc_info=True)
        return False
    _ready = True
    return True
