"""Checked OTLP protobuf bodies -> ``otel_traces`` rows by one compiled pass over the bytes.

The flush used to hand every segment to one chDB query (``otlp_sql``): the work stays in C++,
but the query costs ~25 ms of analysis per flush whatever its size, and reading the nested
Protobuf and building the maps came to ~4 µs a span. Here numba walks the bytes once, filling
flat arrays (offsets into the bodies, numbers) sized by the rows per byte seen so far (a guess
too small: count, then fill), and Arrow builds the columns from them in order of start time (the
order a part is stored in): strings gathered into one buffer, ids spelled as hex, attribute
values as text, maps from offsets. No Python per span or per attribute, except one call per
double attribute value (spelled by ``otlp.format_double``, the definition).

Only what the chDB query spells the same way is taken here: a body with span events or links,
an array, key-value-list or bytes attribute value, a message field given twice (protobuf merges
those), or anything the walk does not expect is left to ``otlp_sql`` — the caller passes those
bodies on. ``tests/test_otlp_compiled.py`` holds the two to the same rows.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from ttftscope.schemas.columns import ARROW_SCHEMA
from ttftscope.schemas.vocabulary import SPAN_KINDS, STATUS_CODES

from . import otlp_scan
from .otlp_wire import _fixed64, _jit, _skip, _tag, _varint

# value types of an attribute (AnyValue's oneof field numbers; 0: none set)
V_NONE, V_STR, V_BOOL, V_INT, V_DBL = 0, 1, 2, 3, 4

# per-span integer columns
(SP_BODY, SP_RES, SP_SCOPE, SP_TID, SP_TIDN, SP_SID, SP_SIDN, SP_PID, SP_PIDN, SP_TS, SP_TSN, SP_NAME, SP_NAMEN,
 SP_MSG, SP_MSGN, SP_KIND, SP_CODE, SP_AN) = range(18)
N_SP = 18  # (a span's attributes follow the previous span's in its table: their count is enough)
# per-attribute integer columns (span and resource attributes share one table)
AT_KEY, AT_KEYN, AT_TYPE, AT_VAL, AT_VALN, AT_INT = range(6)
N_AT = 6
# per-resource: first attribute, count; per-scope: name, version
RS_A0, RS_AN = range(2)
SC_NAME, SC_NAMEN, SC_VER, SC_VERN = range(4)

_TRUE = np.frombuffer(b"true", dtype=np.uint8)
_FALSE = np.frombuffer(b"false", dtype=np.uint8)


def _int32(v):
    """A protobuf int32 read from its varint: the low 32 bits, signed (as upb and ClickHouse)."""
    x = np.int64(v & np.uint64(0xFFFFFFFF))
    return x - np.int64(1 << 32) if x >= np.int64(1 << 31) else x


def _attr(buf, pos, end, fill, row, at, dbl):
    """One KeyValue in ``buf[pos:end]``; 0 ok, 1 take the body elsewhere."""
    if fill:
        at[row, AT_KEY] = 0
        at[row, AT_KEYN] = 0
        at[row, AT_TYPE] = V_NONE
        at[row, AT_VAL] = 0
        at[row, AT_VALN] = 0
        at[row, AT_INT] = 0
        dbl[row] = 0
    seen_value = False
    while pos < end:
        f, w, pos = _tag(buf, pos, end)
        if pos < 0:
            return 1
        if f == 1 and w == 2:  # key
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return 1
            if fill:
                at[row, AT_KEY] = pos
                at[row, AT_KEYN] = np.int64(n)
            pos += np.int64(n)
        elif f == 2 and w == 2:  # value: an AnyValue
            if seen_value:
                return 1  # given twice: protobuf merges the two
            seen_value = True
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return 1
            vend = pos + np.int64(n)
            while pos < vend:
                f2, w2, pos = _tag(buf, pos, vend)
                if pos < 0:
                    return 1
                if f2 == 1 and w2 == 2:
                    m, pos = _varint(buf, pos, vend)
                    if pos < 0 or m > np.uint64(vend - pos):
                        return 1
                    if fill:
                        at[row, AT_TYPE] = V_STR
                        at[row, AT_VAL] = pos
                        at[row, AT_VALN] = np.int64(m)
                    pos += np.int64(m)
                elif (f2 == 2 or f2 == 3) and w2 == 0:
                    v, pos = _varint(buf, pos, vend)
                    if pos < 0:
                        return 1
                    if fill:
                        at[row, AT_TYPE] = V_BOOL if f2 == 2 else V_INT
                        at[row, AT_INT] = np.int64(v) if f2 == 3 else (1 if v != np.uint64(0) else 0)
                elif f2 == 4 and w2 == 1:
                    if pos + 8 > vend:
                        return 1
                    if fill:
                        at[row, AT_TYPE] = V_DBL
                        dbl[row] = _fixed64(buf, pos)
                    pos += 8
                elif f2 >= 5 and f2 <= 7:
                    return 1  # arrays, key-value lists, bytes: spelled elsewhere
                else:
                    pos = _skip(buf, pos, vend, w2)
                    if pos < 0:
                        return 1
            if pos != vend:
                return 1
        else:
            pos = _skip(buf, pos, end, w)
            if pos < 0:
                return 1
    return 0 if pos == end else 1


def _attrs_of(buf, pos, end, field, fill, a_row, at, dbl):
    """The KeyValues under ``field`` of the message in ``buf[pos:end]``: (count, 0/1 as _attr)."""
    n_attrs = 0
    while pos < end:
        f, w, pos = _tag(buf, pos, end)
        if pos < 0:
            return n_attrs, 1
        if f == field and w == 2:
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return n_attrs, 1
            nxt = pos + np.int64(n)
            if _attr(buf, pos, nxt, fill, a_row + n_attrs, at, dbl) != 0:
                return n_attrs, 1
            n_attrs += 1
            pos = nxt
        else:
            pos = _skip(buf, pos, end, w)
            if pos < 0:
                return n_attrs, 1
    return n_attrs, 0 if pos == end else 1


def _span(buf, pos, end, fill, row, sp, times, a_row, at, dbl):
    """One Span; (attributes used, 0/1)."""
    if fill:
        for c in range(SP_TID, N_SP):
            sp[row, c] = 0
        times[row, 0] = 0
        times[row, 1] = 0
    n_attrs = 0
    seen_status = False
    while pos < end:
        f, w, pos = _tag(buf, pos, end)
        if pos < 0:
            return n_attrs, 1
        if w == 2 and (f == 1 or f == 2 or f == 3 or f == 4 or f == 5):
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return n_attrs, 1
            if fill:
                c = SP_TID if f == 1 else SP_SID if f == 2 else SP_TS if f == 3 else SP_PID if f == 4 else SP_NAME
                sp[row, c] = pos
                sp[row, c + 1] = np.int64(n)
            pos += np.int64(n)
        elif w == 2 and f == 9:
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return n_attrs, 1
            nxt = pos + np.int64(n)
            if _attr(buf, pos, nxt, fill, a_row + n_attrs, at, dbl) != 0:
                return n_attrs, 1
            n_attrs += 1
            pos = nxt
        elif w == 2 and (f == 11 or f == 13):
            return n_attrs, 1  # events, links: decoded elsewhere
        elif w == 2 and f == 15:  # status
            if seen_status:
                return n_attrs, 1
            seen_status = True
            n, pos = _varint(buf, pos, end)
            if pos < 0 or n > np.uint64(end - pos):
                return n_attrs, 1
            send = pos + np.int64(n)
            while pos < send:
                f2, w2, pos = _tag(buf, pos, send)
                if pos < 0:
                    return n_attrs, 1
                if f2 == 2 and w2 == 2:
                    m, pos = _varint(buf, pos, send)
                    if pos < 0 or m > np.uint64(send - pos):
                        return n_attrs, 1
                    if fill:
                        sp[row, SP_MSG] = pos
                        sp[row, SP_MSGN] = np.int64(m)
                    pos += np.int64(m)
                elif f2 == 3 and w2 == 0:
                    v, pos = _varint(buf, pos, send)
                    if pos < 0:
                        return n_attrs, 1
                    if fill:
                        sp[row, SP_CODE] = _int32(v)
                else:
                    pos = _skip(buf, pos, send, w2)
                    if pos < 0:
                        return n_attrs, 1
            if pos != send:
                return n_attrs, 1
        elif w == 0 and f == 6:
            v, pos = _varint(buf, pos, end)
            if pos < 0:
                return n_attrs, 1
            if fill:
                sp[row, SP_KIND] = _int32(v)
        elif w == 1 and (f == 7 or f == 8):
            if pos + 8 > end:
                return n_attrs, 1
            if fill:
                times[row, f - 7] = _fixed64(buf, pos)
            pos += 8
        else:
            pos = _skip(buf, pos, end, w)
            if pos < 0:
                return n_attrs, 1
    if fill:
        sp[row, SP_AN] = n_attrs
    return n_attrs, 0 if pos == end else 1


def _body(buf, pos, end, fill, body, cnt, sp, times, at, dbl, rat, rdbl, rs, sc):
    """One ExportTraceServiceRequest; ``cnt`` holds the running totals (spans, span attributes,
    resources, scopes, resource attributes: ``at``/``dbl`` and ``rat``/``rdbl``). 0 ok, 1 take the body elsewhere (the totals are then rolled back by
    the caller)."""
    while pos < end:
        f, w, pos = _tag(buf, pos, end)
        if pos < 0:
            return 1
        if not (f == 1 and w == 2):
            pos = _skip(buf, pos, end, w)
            if pos < 0:
                return 1
            continue
        n, pos = _varint(buf, pos, end)  # a ResourceSpans
        if pos < 0 or n > np.uint64(end - pos):
            return 1
        rend = pos + np.int64(n)
        res = cnt[2]
        cnt[2] += 1
        if fill:
            rs[res, RS_A0] = cnt[4]
            rs[res, RS_AN] = 0
        seen_resource = False
        while pos < rend:
            f2, w2, pos = _tag(buf, pos, rend)
            if pos < 0:
                return 1
            if f2 == 1 and w2 == 2:  # the Resource
                if seen_resource:
                    return 1
                seen_resource = True
                m, pos = _varint(buf, pos, rend)
                if pos < 0 or m > np.uint64(rend - pos):
                    return 1
                nxt = pos + np.int64(m)
                k, bad = _attrs_of(buf, pos, nxt, np.uint64(1), fill, cnt[4], rat, rdbl)
                if bad != 0:
                    return 1
                if fill:
                    rs[res, RS_A0] = cnt[4]
                    rs[res, RS_AN] = k
                cnt[4] += k
                pos = nxt
            elif f2 == 2 and w2 == 2:  # a ScopeSpans
                m, pos = _varint(buf, pos, rend)
                if pos < 0 or m > np.uint64(rend - pos):
                    return 1
                send = pos + np.int64(m)
                scope = cnt[3]
                cnt[3] += 1
                if fill:
                    for c in range(4):
                        sc[scope, c] = 0
                seen_scope = False
                while pos < send:
                    f3, w3, pos = _tag(buf, pos, send)
                    if pos < 0:
                        return 1
                    if f3 == 1 and w3 == 2:  # the InstrumentationScope
                        if seen_scope:
                            return 1
                        seen_scope = True
                        q, pos = _varint(buf, pos, send)
                        if pos < 0 or q > np.uint64(send - pos):
                            return 1
                        qend = pos + np.int64(q)
                        while pos < qend:
                            f4, w4, pos = _tag(buf, pos, qend)
                            if pos < 0:
                                return 1
                            if (f4 == 1 or f4 == 2) and w4 == 2:
                                r, pos = _varint(buf, pos, qend)
                                if pos < 0 or r > np.uint64(qend - pos):
                                    return 1
                                if fill:
                                    c = SC_NAME if f4 == 1 else SC_VER
                                    sc[scope, c] = pos
                                    sc[scope, c + 1] = np.int64(r)
                                pos += np.int64(r)
                            else:
                                pos = _skip(buf, pos, qend, w4)
                                if pos < 0:
                                    return 1
                        if pos != qend:
                            return 1
                    elif f3 == 2 and w3 == 2:  # a Span
                        q, pos = _varint(buf, pos, send)
                        if pos < 0 or q > np.uint64(send - pos):
                            return 1
                        qend = pos + np.int64(q)
                        row = cnt[0]
                        if fill:
                            sp[row, SP_BODY] = body
                            sp[row, SP_RES] = res
                            sp[row, SP_SCOPE] = scope
                        k, bad = _span(buf, pos, qend, fill, row, sp, times, cnt[1], at, dbl)
                        if bad != 0:
                            return 1
                        cnt[0] += 1
                        cnt[1] += k
                        pos = qend
                    else:
                        pos = _skip(buf, pos, send, w3)
                        if pos < 0:
                            return 1
                if pos != send:
                    return 1
            else:
                pos = _skip(buf, pos, rend, w2)
                if pos < 0:
                    return 1
        if pos != rend:
            return 1
    return 0 if pos == end else 1


def _walk(buf, starts, ends, fill, bounded, ok, cnt, sp, times, at, dbl, rat, rdbl, rs, sc):
    """Every body ``buf[starts[b]:ends[b]]`` whose ``ok[b]`` is set; a body the walk cannot
    take gets ``ok[b] = 0`` and leaves no rows (its totals are rolled back, the rows it wrote
    are written over). ``bounded``: the tables were sized by a guess, so before each body
    there must be room for the most rows its bytes can hold (a row takes at least 2 bytes),
    else ``cnt[5] = 1`` and the walk stops (the caller counts first, then fills)."""
    for b in range(starts.shape[0]):
        if ok[b] == 0:
            continue
        if bounded:
            most = (ends[b] - starts[b]) // 2 + 1
            if (cnt[0] + most > sp.shape[0] or cnt[1] + most > at.shape[0] or cnt[2] + most > rs.shape[0]
                    or cnt[3] + most > sc.shape[0] or cnt[4] + most > rat.shape[0]):
                cnt[5] = 1
                return
        keep = cnt.copy()
        if _body(buf, starts[b], ends[b], fill, b, cnt, sp, times, at, dbl, rat, rdbl, rs, sc) != 0:
            ok[b] = 0
            cnt[:] = keep


def _gather(buf, off, n, hexed):
    """The byte ranges ``buf[off[i]:off[i]+n[i]]`` as an Arrow string array's (offsets, data);
    ``hexed``: each byte as two lower-case hex digits."""
    k = off.shape[0]
    offsets = np.empty(k + 1, dtype=np.int32)
    total = 0
    offsets[0] = 0
    for i in range(k):
        total += n[i] * (2 if hexed else 1)
        offsets[i + 1] = total
    data = np.empty(total, dtype=np.uint8)
    digits = np.array([48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 97, 98, 99, 100, 101, 102], dtype=np.uint8)
    if hexed:
        for i in range(k):
            s = off[i]
            p = offsets[i]
            for j in range(n[i]):
                c = buf[s + j]
                data[p + 2 * j] = digits[c >> 4]
                data[p + 2 * j + 1] = digits[c & 15]
    else:
        for i in range(k):
            data[offsets[i]:offsets[i + 1]] = buf[off[i]:off[i] + n[i]]
    return offsets, data


def _gather_sizes(n, hexed, offsets, base):
    """Pass 1 of :func:`_gather_fill`, no byte read: column ``c``'s string offsets
    (``offsets[c]``, from 0) and where its bytes start in the shared data (``base[c]``)."""
    k, m = n.shape
    base[0] = 0
    for c in range(m):
        total = 0
        offsets[c, 0] = 0
        for i in range(k):
            total += n[i, c] * (2 if hexed[c] else 1)
            offsets[c, i + 1] = total
        base[c + 1] = base[c] + total


def _gather_fill(buf, off, n, hexed, offsets, base, data):
    """Several string columns of the same rows gathered in one pass, row by row (``off``,
    ``n``: (rows, columns)): a row's fields lie together in the body, so each of its cache
    lines is read once — a pass per column read the whole segment again each time, and on a
    segment larger than the caches that was most of the gathering."""
    k, m = n.shape
    digits = np.array([48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 97, 98, 99, 100, 101, 102], dtype=np.uint8)
    for i in range(k):
        for c in range(m):
            s = off[i, c]
            p = base[c] + offsets[c, i]
            if hexed[c]:
                for j in range(n[i, c]):
                    b = buf[s + j]
                    data[p + 2 * j] = digits[b >> 4]
                    data[p + 2 * j + 1] = digits[b & 15]
            else:
                for j in range(n[i, c]):
                    data[p + j] = buf[s + j]


def _kv_text(buf, at, k):
    """The first ``k`` attributes' keys and values as the text the store keeps (doubles left
    empty: spelled in Python): (key offsets, key bytes, value offsets, value bytes), filled in
    one pass (an attribute's key and value lie together in the body)."""
    koffsets = np.empty(k + 1, dtype=np.int32)
    offsets = np.empty(k + 1, dtype=np.int32)
    koffsets[0] = 0
    offsets[0] = 0
    ktotal = 0
    total = 0
    for i in range(k):
        ktotal += at[i, AT_KEYN]
        koffsets[i + 1] = ktotal
        t = at[i, AT_TYPE]
        if t == V_STR:
            total += at[i, AT_VALN]
        elif t == V_BOOL:
            total += 4 if at[i, AT_INT] != 0 else 5
        elif t == V_INT:
            v = at[i, AT_INT]
            digits = 1
            u = np.uint64(-(v + 1)) + np.uint64(1) if v < 0 else np.uint64(v)
            while u >= np.uint64(10):
                u //= np.uint64(10)
                digits += 1
            total += digits + (1 if v < 0 else 0)
        offsets[i + 1] = total
    kdata = np.empty(ktotal, dtype=np.uint8)
    data = np.empty(total, dtype=np.uint8)
    for i in range(k):
        s = at[i, AT_KEY]
        p = koffsets[i]
        for j in range(at[i, AT_KEYN]):
            kdata[p + j] = buf[s + j]
        p = offsets[i]
        t = at[i, AT_TYPE]
        if t == V_STR:
            s = at[i, AT_VAL]
            for j in range(at[i, AT_VALN]):
                data[p + j] = buf[s + j]
        elif t == V_BOOL:
            word = _TRUE if at[i, AT_INT] != 0 else _FALSE
            for j in range(word.shape[0]):
                data[p + j] = word[j]
        elif t == V_INT:
            v = at[i, AT_INT]
            u = np.uint64(-(v + 1)) + np.uint64(1) if v < 0 else np.uint64(v)
            q = offsets[i + 1] - 1
            while True:
                data[q] = np.uint8(48 + np.int64(u % np.uint64(10)))
                u //= np.uint64(10)
                q -= 1
                if u == np.uint64(0):
                    break
            if v < 0:
                data[p] = 45
    return koffsets, kdata, offsets, data


if _jit is not None:
    _int32 = _jit(_int32)
    _attr = _jit(_attr)
    _attrs_of = _jit(_attrs_of)
    _span = _jit(_span)
    _body = _jit(_body)
    _walk = _jit(_walk)
    _gather = _jit(_gather)
    _gather_sizes = _jit(_gather_sizes)
    _gather_fill = _jit(_gather_fill)
    _kv_text = _jit(_kv_text)


def _strings(offsets: np.ndarray, data: np.ndarray) -> pa.Array:
    return pa.StringArray.from_buffers(len(offsets) - 1, pa.py_buffer(offsets), pa.py_buffer(data))


def _text(buf: np.ndarray, off: np.ndarray, n: np.ndarray, hexed: bool = False) -> pa.Array:
    return _strings(*_gather(buf, off, n, hexed))


def _texts(buf: np.ndarray, off: np.ndarray, n: np.ndarray, hexed: tuple[bool, ...]) -> list[pa.Array]:
    """String columns of the same rows (``off``, ``n``: (rows, columns)) gathered in one pass."""
    k, m = n.shape
    hx = np.array(hexed, dtype=np.bool_)
    offsets = np.empty((m, k + 1), dtype=np.int32)
    base = np.empty(m + 1, dtype=np.int64)
    _gather_sizes(n, hx, offsets, base)
    data = np.empty(int(base[-1]), dtype=np.uint8)
    _gather_fill(buf, off, n, hx, offsets, base, data)
    return [_strings(offsets[c], data[base[c]:base[c + 1]]) for c in range(m)]


#: each thread's tables for the walk and its gathers, kept from flush to flush (see _tables)
_scratch = threading.local()


def _maps(buf: np.ndarray, at: np.ndarray, bits: np.ndarray, an: np.ndarray, first: np.ndarray | None = None
          ) -> pa.MapArray:
    """One string map per owner (span or resource) from its ``an`` attributes. Owner ``i``'s
    attributes are the rows of ``at`` from ``first[i]`` on (by default, owners' attributes
    follow each other in ``at`` in owner order)."""
    offsets = np.zeros(len(an) + 1, dtype=np.int32)
    np.cumsum(an, out=offsets[1:])
    k = int(offsets[-1])
    if first is not None:  # owners in another order: their attributes' rows, gathered
        rows = np.repeat(first - offsets[:-1], an) + np.arange(k)
        gathered = getattr(_scratch, "gathered", None)
        if gathered is None or gathered.shape[0] < k:  # kept per thread, as the walk's tables
            gathered = _scratch.gathered = np.empty((k + k // 4, N_AT), dtype=np.int64, order="F")
        for c in range(N_AT):  # column by column: a 2-D fancy index and a copy to column-major cost 3x
            np.take(at[:, c], rows, out=gathered[:k, c])
        at, bits = gathered, bits[rows]
    ko, kd, vo, vd = _kv_text(buf, at, k)
    keys, values = _strings(ko, kd), _strings(vo, vd)
    is_dbl = at[:k, AT_TYPE] == V_DBL
    if is_dbl.any():
        from .otlp import format_double

        spelled = [format_double(x) for x in bits[:k][is_dbl].view(np.float64).tolist()]
        values = pc.replace_with_mask(values, pa.array(is_dbl), pa.array(spelled, pa.string()))
    return pa.MapArray.from_arrays(pa.array(offsets), keys, values)


def _enum(codes: np.ndarray, names: tuple[str, ...]) -> pa.Array:
    idx = np.where((codes >= 0) & (codes < len(names)), codes, 0)
    return pc.take(pa.array(names, pa.string()), pa.array(idx))


#: rows per byte of body seen so far (spans, span attributes, resources, scopes, resource
#: attributes): sizes the tables for one walk; a guess too small costs a second walk
_density = np.array([1 / 64, 1 / 16, 1 / 4096, 1 / 4096, 1 / 1024])


_SHAPES = ((N_SP, np.int64), (2, np.uint64), (N_AT, np.int64), (0, np.uint64), (N_AT, np.int64), (0, np.uint64),
           (2, np.int64), (4, np.int64))
def _tables(caps, reuse: bool = True) -> tuple:
    """(sp, times, at, dbl, rat, rdbl, rs, sc) for at least ``caps`` rows each, column-major (a
    column is a contiguous array for the Arrow side). The walk writes every field of a row it
    uses, so a thread's tables are kept and reused from flush to flush: fresh ones cost a page
    fault per 4 KiB touched (~150 MB, a third of a 200k-span decode's CPU)."""
    have = getattr(_scratch, "tables", None) if reuse else None
    out = []
    for i, ((width, dtype), cap) in enumerate(zip(_SHAPES, caps[[0, 0, 1, 1, 4, 4, 2, 3]], strict=True)):
        # at least two rows: numba types a column-major table of 0 or 1 rows as row-major (it is
        # both), a signature of its own that the flusher would stop to compile
        cap = max(int(cap), 2)
        if have is not None and have[i].shape[0] >= cap:
            out.append(have[i])
            continue
        cap = cap + cap // 4 if reuse else cap  # room to grow
        out.append(np.empty((cap, width), dtype=dtype, order="F") if width else np.empty(cap, dtype=dtype))
    if reuse:
        _scratch.tables = tuple(out)
    return tuple(out)


def _one_buffer(bodies: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes, starts, ends) of ``bodies``: views of one buffer (a spool segment's records) are
    read where they lie; anything else is joined first."""
    base = bodies[0].obj if isinstance(bodies[0], memoryview) else None
    if base is not None and all(isinstance(b, memoryview) and b.obj is base and b.contiguous for b in bodies):
        buf = np.frombuffer(base, dtype=np.uint8)
        buf.flags.writeable = False  # (a bytearray's: the walk is compiled for read-only bytes)
        at0 = buf.ctypes.data
        starts = np.array([np.frombuffer(b, dtype=np.uint8).ctypes.data - at0 if len(b) else 0 for b in bodies],
                          dtype=np.int64)
        return buf, starts, starts + np.array([len(b) for b in bodies], dtype=np.int64)
    ends = np.cumsum([len(b) for b in bodies], dtype=np.int64)
    return np.frombuffer(b"".join(bodies), dtype=np.uint8), ends - np.array([len(b) for b in bodies]), ends


#: the span's string fields (offset columns; each length is the next column), hex or not
_TEXT_AT = np.array([SP_TID, SP_SID, SP_PID, SP_TS, SP_NAME, SP_MSG])
_TEXT_HEX = (True, True, True, False, False, False)


def decode(bodies: list) -> tuple[pa.Table, list[int]]:
    """The rows of the ``bodies`` this pass takes (``ARROW_SCHEMA``, in order of start time)
    and the indices of those it leaves to ``otlp_sql.decode_bodies``. Without numba, or before
    :func:`warm_up` has compiled the pass, every body is left."""
    if not bodies or not _ready:
        return ARROW_SCHEMA.empty_table(), list(range(len(bodies)))
    return _decode(bodies)


def _decode(bodies: list) -> tuple[pa.Table, list[int]]:
    global _density
    buf, starts, ends = _one_buffer(bodies)
    ok = np.ones(len(bodies), dtype=np.uint8)
    cnt = np.zeros(6, dtype=np.int64)
    most = int((ends - starts).max()) // 2 + 1
    tables = _tables((len(buf) * _density * 1.25).astype(np.int64) + most + 16)
    _walk(buf, starts, ends, True, True, ok, cnt, *tables)
    if cnt[5]:  # more rows than the guess: count, then fill tables of the exact size
        ok[:] = 1
        cnt[:] = 0
        z2 = np.zeros((0, 1), dtype=np.int64, order="F")
        z1 = np.zeros(0, np.uint64)
        _walk(buf, starts, ends, False, False, ok, cnt, z2, np.zeros((0, 2), np.uint64, order="F"), z2, z1, z2, z1,
              z2, z2)
        tables = _tables(cnt[:5].copy(), reuse=False)
        cnt[:] = 0
        _walk(buf, starts, ends, True, False, ok, cnt, *tables)
    sp, times, at, dbl, rat, rdbl, rs, sc = tables
    n_sp, n_at, n_rs, n_sc, n_rat = (int(x) for x in cnt[:5])
    if len(buf):
        _density = np.maximum(_density * 0.5, cnt[:5] / len(buf))
    left = np.flatnonzero(ok == 0).tolist()
    if n_sp == 0:
        return ARROW_SCHEMA.empty_table(), left
    start = times[:n_sp, 0].view(np.int64).copy()  # the table keeps it; the scratch is reused
    order = None if n_sp < 2 or bool(np.all(start[1:] >= start[:-1])) else np.argsort(start, kind="stable")

    def col(c: int) -> np.ndarray:  # a span column, in order of start time
        return sp[:n_sp, c] if order is None else sp[:n_sp, c][order]

    an = sp[:n_sp, SP_AN]
    first_at = None
    if order is not None:
        first_at = (np.cumsum(an) - an)[order]
        an = an[order]
        start = start[order]
        end = times[:n_sp, 1][order]
    else:
        end = times[:n_sp, 1]
    res_maps = _maps(buf, rat, rdbl, rs[:n_rs, RS_AN], rs[:n_rs, RS_A0])
    res_of = pa.array(col(SP_RES))
    scope_of = pa.array(col(SP_SCOPE))
    svc = pc.fill_null(pc.map_lookup(res_maps, "service.name", "first"), "")  # one per resource
    at_, n_ = sp[:n_sp, _TEXT_AT], sp[:n_sp, _TEXT_AT + 1]
    if order is not None:
        at_, n_ = at_[order], n_[order]
    # row-major, whatever the indexing gave (column-major unsorted, row-major sorted): one compiled
    # signature, the one warm_up compiles, so that a flush never waits for numba's compiler
    at_, n_ = np.ascontiguousarray(at_), np.ascontiguousarray(n_)
    tid, sid, pid, tstate, name, msg = _texts(buf, at_, n_, _TEXT_HEX)
    cols = {
        "Timestamp": pa.array(start).cast(pa.timestamp("ns")).cast(ARROW_SCHEMA.field("Timestamp").type),
        "TraceId": tid,
        "SpanId": sid,
        "ParentSpanId": pid,
        "TraceState": tstate,
        "SpanName": name,
        "SpanKind": _enum(col(SP_KIND), SPAN_KINDS),
        "ServiceName": pc.take(svc, res_of),
        "ResourceAttributes": pc.take(res_maps, res_of),
        "ScopeName": pc.take(_text(buf, sc[:n_sc, SC_NAME], sc[:n_sc, SC_NAMEN]), scope_of),
        "ScopeVersion": pc.take(_text(buf, sc[:n_sc, SC_VER], sc[:n_sc, SC_VERN]), scope_of),
        "SpanAttributes": _maps(buf, at, dbl, an, first_at),
        "Duration": pa.array(end - start.view(np.uint64)),
        "StatusCode": _enum(col(SP_CODE), STATUS_CODES),
        "StatusMessage": msg,
    }
    zeros = pa.array(np.zeros(n_sp + 1, dtype=np.int32))
    arrays = [cols[f.name].cast(f.type) if f.name in cols
              else pa.ListArray.from_arrays(zeros, pa.array([], f.type.value_type)) for f in ARROW_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=ARROW_SCHEMA), left


_ready = False


def ready() -> bool:
    """The pass is compiled and in use (:func:`warm_up` has finished)."""
    return _ready


def warm_up() -> bool:
    """Compile (or load from numba's cache) this pass now; until then every body is left to
    ``otlp_sql``. True when it is in use."""
    global _ready, _density
    if not otlp_scan.warm_up():
        return False
    try:  # compiled first, then said ready: a flush meanwhile takes the chDB path, never numba's lock
        table, left = _decode([_SAMPLE])
        # and the count-then-fill path (more rows than the tables' guess: a guess of none, fresh
        # tables), whose counting walk has a signature of its own
        saved, _density, _scratch.tables = _density, np.zeros_like(_density), None
        try:
            many, many_left = _decode([_SAMPLE] * 64)
        finally:
            _density, _scratch.tables = saved, None
        _ready = not left and table.num_rows == 1 and not many_left and many.num_rows == 64
    except Exception:  # noqa: BLE001 - the chDB path stays
        _ready = False
        otlp_scan.log.warning("cannot compile the OTLP decode pass; bodies are decoded by chDB", exc_info=True)
    return _ready


def _sample() -> bytes:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "warm-up"
    sp = rs.scope_spans.add().spans.add()
    sp.trace_id, sp.span_id, sp.name = b"\x01" * 16, b"\x02" * 8, "warm-up"
    for key, setter in (("s", "string_value"), ("b", "bool_value"), ("i", "int_value"), ("d", "double_value")):
        kv = sp.attributes.add()
        kv.key = key
        setattr(kv.value, setter, {"string_value": "x", "bool_value": True, "int_value": -3, "double_value": 0.5}[setter])
    return req.SerializeToString()


_SAMPLE = _sample()
