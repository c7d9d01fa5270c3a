"""Protobuf wire primitives for the compiled OTLP walkers (``otlp_scan``: the arrival check;
``otlp_compiled``: the flush decode), compiled with numba when it is installed.

Every read is bounds-checked against the end of the message being read: a position of -1
means "cannot be read" and the walker gives up on the body (its caller falls back).
"""

from __future__ import annotations

import numpy as np

try:  # numba ships with vLLM; the collector works without it (every span checked in Python)
    import numba

    _jit = numba.njit(cache=True, nogil=True, boundscheck=False)
except Exception:  # noqa: BLE001 - any import failure means: no compiled scan
    numba = None
    _jit = None


def _varint(buf, pos, end):
    """(value, next position); next position -1 when the varint runs past ``end`` or is too long."""
    result = np.uint64(0)
    shift = np.uint64(0)
    while pos < end:
        b = np.uint64(buf[pos])
        pos += 1
        result |= (b & np.uint64(0x7F)) << shift
        if b < np.uint64(0x80):
            return result, pos
        shift += np.uint64(7)
        if shift >= np.uint64(64):
            return result, -1
    return result, -1


def _skip(buf, pos, end, wire):
    """The position after a field's payload of wire type ``wire``; -1 when it cannot be skipped."""
    if wire == 0:
        _, pos = _varint(buf, pos, end)
        return pos
    if wire == 1:
        return pos + 8 if pos + 8 <= end else -1
    if wire == 5:
        return pos + 4 if pos + 4 <= end else -1
    if wire == 2:
        n, pos = _varint(buf, pos, end)
        if pos < 0 or n > np.uint64(end - pos):
            return -1
        return pos + np.int64(n)
    return -1  # groups (3, 4), reserved wire types: not in OTLP; the caller falls back


def _fixed64(buf, pos):
    v = np.uint64(0)
    for i in range(8):
        v |= np.uint64(buf[pos + i]) << np.uint64(8 * i)
    return v


def _all_zero(buf, lo, hi):
    for i in range(lo, hi):
        if buf[i] != 0:
            return False
    return True


def _tag(buf, pos, end):
    """A field's (number, wire type, position after the tag); the position is -1 when the
    tag's varint cannot be read (the number and type are then meaningless)."""
    tag, pos = _varint(buf, pos, end)
    return tag >> np.uint64(3), np.int64(tag & np.uint64(7)), pos


if _jit is not None:
    _varint, _skip, _fixed64, _all_zero = _jit(_varint), _jit(_skip), _jit(_fixed64), _jit(_all_zero)
    _tag = _jit(_tag)
