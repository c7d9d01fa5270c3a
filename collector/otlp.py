"""OTLP/HTTP trace payloads (protobuf or JSON) -> Arrow batches in ``otel_traces`` layout.

Both encodings feed one :class:`SpanBatchBuilder`, so a span looks the same in the store
whichever way it came. Values are spelled as the OpenTelemetry Collector's ClickHouse
exporter spells them (hex ids, ``Server``/``Error``, attribute values as strings).
Spans that cannot be stored faithfully (bad ids, absurd timestamps) are rejected one by one
and reported through OTLP partial success; a malformed payload raises :class:`DecodeError`.
"""

from __future__ import annotations

import base64
import functools
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import orjson
import pyarrow as pa
from google.protobuf.message import DecodeError as _PbDecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from ttftscope.schemas.columns import ARROW_SCHEMA, STR_MAP, TS
from ttftscope.schemas.vocabulary import SPAN_KINDS, STATUS_CODES

from . import otlp_scan as S  # the compiled per-span facts of the arrival check


class DecodeError(ValueError):
    """The payload is not a valid OTLP ExportTraceServiceRequest (-> HTTP 400)."""


@dataclass(frozen=True)
class Limits:
    """What one span may carry; beyond it attributes are dropped and the client told."""

    max_attributes: int = 256  # per map (resource, span, event, link)
    max_value_bytes: int = 64 * 1024  # longer attribute values are truncated
    max_events: int = 1024
    max_links: int = 1024
    max_name_bytes: int = 4096  # longer span/event names are truncated
    #: spans starting before this (ns since epoch) are absurd: 2000-01-01
    min_start_ns: int = 946_684_800 * 10**9
    #: spans starting later than now + this are absurd (clock far ahead)
    max_future_ns: int = 24 * 3600 * 10**9
    #: longer spans are absurd (a week)
    max_duration_ns: int = 7 * 24 * 3600 * 10**9


@dataclass
class DecodeReport:
    """What happened to the spans of one request (OTLP partial success)."""

    accepted: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> spans rejected
    warnings: dict[str, int] = field(default_factory=dict)  # e.g. attributes dropped

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def warn(self, what: str, n: int = 1) -> None:
        self.warnings[what] = self.warnings.get(what, 0) + n

    def message(self) -> str:
        parts = [f"{n} span(s) rejected: {r}" for r, n in sorted(self.reasons.items())]
        parts += [f"{w} ({n})" for w, n in sorted(self.warnings.items())]
        return "; ".join(parts)


_KIND_BY_NUM = dict(enumerate(SPAN_KINDS))
_KIND_BY_NAME = {f"SPAN_KIND_{k.upper()}": k for k in SPAN_KINDS}
_STATUS_BY_NUM = dict(enumerate(STATUS_CODES))
_STATUS_BY_NAME = {f"STATUS_CODE_{s.upper()}": s for s in STATUS_CODES}


def format_double(v: float) -> str:
    """A double as Go's ``strconv.FormatFloat(v, 'f', -1, 64)`` (pcommon's AsString)."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    r = repr(v)
    if "e" in r or "E" in r:
        from decimal import Decimal

        r = format(Decimal(r), "f")
    if r.endswith(".0"):
        r = r[:-2]
    return r


class _MapCol:
    """A Map(String, String) column built from flat offsets/keys/values lists."""

    __slots__ = ("offsets", "keys", "values")

    def __init__(self) -> None:
        self.offsets = [0]
        self.keys: list[str] = []
        self.values: list[str] = []

    def add(self, d: dict[str, str]) -> None:
        self.keys.extend(d.keys())
        self.values.extend(d.values())
        self.offsets.append(len(self.keys))

    def array(self) -> pa.Array:
        return pa.MapArray.from_arrays(
            pa.array(self.offsets, pa.int32()),
            pa.array(self.keys, pa.string()),
            pa.array(self.values, pa.string()),
            type=STR_MAP,
        )


def span_problem(tid_bytes: float, tid_zero: bool, sid_bytes: float, sid_zero: bool, parent_bytes: float,
                 start: int, end: int, lo: int, hi: int, max_dur: int) -> str | None:
    """Why a span cannot be stored (the reason the client reads), or ``None``; id sizes in
    bytes, whichever encoding they came in."""
    if tid_bytes != 16 or tid_zero:
        return "invalid trace id (need 16 non-zero bytes)"
    if sid_bytes != 8 or sid_zero:
        return "invalid span id (need 8 non-zero bytes)"
    if parent_bytes and parent_bytes != 8:
        return "invalid parent span id (need 8 bytes or empty)"
    if start < lo or start > hi:
        return "absurd start timestamp (before 2000 or too far in the future)"
    if end < start:
        return "end before start"
    if end - start > max_dur:
        return "absurd duration (longer than the limit)"
    return None


class SpanBatchBuilder:
    """Collects spans column by column and turns them into one Arrow table."""

    def __init__(self, limits: Limits | None = None, now_ns: int | None = None) -> None:
        self.limits = limits or Limits()
        self.now_ns = now_ns if now_ns is not None else time.time_ns()
        self.report = DecodeReport()
        self.ts: list[int] = []
        self.trace_id: list[str] = []
        self.span_id: list[str] = []
        self.parent: list[str] = []
        self.state: list[str] = []
        self.name: list[str] = []
        self.kind: list[str] = []
        self.service: list[str] = []
        self.res_attrs = _MapCol()
        self.scope_name: list[str] = []
        self.scope_version: list[str] = []
        self.span_attrs = _MapCol()
        self.duration: list[int] = []
        self.status: list[str] = []
        self.status_msg: list[str] = []
        self.ev_off = [0]
        self.ev_ts: list[int] = []
        self.ev_name: list[str] = []
        self.ev_attrs = _MapCol()
        self.ln_off = [0]
        self.ln_trace: list[str] = []
        self.ln_span: list[str] = []
        self.ln_state: list[str] = []
        self.ln_attrs = _MapCol()

    # -- checks shared by both encodings ------------------------------------------------
    def check_span(self, trace_id: str, span_id: str, parent: str, start: int, end: int) -> str | None:
        """Why the span (ids in hex) cannot be stored, or ``None``."""
        lim = self.limits
        return span_problem(len(trace_id) / 2, trace_id == "0" * 32, len(span_id) / 2, span_id == "0" * 16,
                            len(parent) / 2, start, end, lim.min_start_ns, self.now_ns + lim.max_future_ns,
                            lim.max_duration_ns)

    def clip_attrs(self, d: dict[str, str]) -> dict[str, str]:
        lim = self.limits
        if len(d) > lim.max_attributes:
            self.report.warn(f"attributes dropped beyond {lim.max_attributes} per map", len(d) - lim.max_attributes)
            d = dict(list(d.items())[: lim.max_attributes])
        long = [k for k, v in d.items() if len(v) > lim.max_value_bytes]
        if long:
            self.report.warn(f"attribute values truncated to {lim.max_value_bytes} characters", len(long))
            for k in long:
                d[k] = d[k][: lim.max_value_bytes]
        return d

    def add_span(
        self,
        *,
        start: int,
        end: int,
        trace_id: str,
        span_id: str,
        parent: str,
        trace_state: str,
        name: str,
        kind: str,
        service: str,
        resource: dict[str, str],
        scope_name: str,
        scope_version: str,
        attrs: dict[str, str],
        status: str,
        status_msg: str,
        events: list[tuple[int, str, dict[str, str]]],
        links: list[tuple[str, str, str, dict[str, str]]],
        path: str = "",
    ) -> bool:
        """Append one span; False (rejected, with the field path) when an event or link of it
        cannot be stored."""
        for n, (t, _, _) in enumerate(events):
            if not 0 <= t < 1 << 63:
                self.report.reject(f"{path}.events[{n}].timeUnixNano: out of range (must be below 2^63)")
                return False
        for n, (tr, sp, _, _) in enumerate(links):
            if len(tr) != 32 or len(sp) != 16:
                self.report.reject(f"{path}.links[{n}]: invalid trace id or span id (need 16 and 8 bytes)")
                return False
        name = self.clip_name(name)
        self.ts.append(start)
        self.trace_id.append(trace_id)
        self.span_id.append(span_id)
        self.parent.append(parent)
        self.state.append(trace_state)
        self.name.append(name)
        self.kind.append(kind)
        self.service.append(service)
        self.res_attrs.add(resource)
        self.scope_name.append(scope_name)
        self.scope_version.append(scope_version)
        self.span_attrs.add(self.clip_attrs(attrs))
        self.duration.append(end - start)
        self.status.append(status)
        self.status_msg.append(status_msg)
        lim = self.limits
        if len(events) > lim.max_events:
            self.report.warn(f"events dropped beyond {lim.max_events} per span", len(events) - lim.max_events)
            events = events[: lim.max_events]
        for t, n, a in events:
            self.ev_ts.append(t)
            self.ev_name.append(self.clip_name(n))
            self.ev_attrs.add(self.clip_attrs(a))
        self.ev_off.append(len(self.ev_ts))
        if len(links) > lim.max_links:
            self.report.warn(f"links dropped beyond {lim.max_links} per span", len(links) - lim.max_links)
            links = links[: lim.max_links]
        for tr, sp, st, a in links:
            self.ln_trace.append(tr)
            self.ln_span.append(sp)
            self.ln_state.append(st)
            self.ln_attrs.add(self.clip_attrs(a))
        self.ln_off.append(len(self.ln_trace))
        self.report.accepted += 1
        return True

    def clip_name(self, name: str) -> str:
        if len(name) > self.limits.max_name_bytes:
            self.report.warn(f"names truncated to {self.limits.max_name_bytes} characters")
            return name[: self.limits.max_name_bytes]
        return name

    def __len__(self) -> int:
        return len(self.ts)

    def table(self) -> pa.Table:
        def lst(off: list[int], values: pa.Array) -> pa.Array:
            return pa.ListArray.from_arrays(pa.array(off, pa.int32()), values)

        s = pa.string()
        cols = [
            pa.array(self.ts, pa.int64()).cast(TS),
            pa.array(self.trace_id, s),
            pa.array(self.span_id, s),
            pa.array(self.parent, s),
            pa.array(self.state, s),
            pa.array(self.name, s),
            pa.array(self.kind, s),
            pa.array(self.service, s),
            self.res_attrs.array(),
            pa.array(self.scope_name, s),
            pa.array(self.scope_version, s),
            self.span_attrs.array(),
            pa.array(self.duration, pa.uint64()),
            pa.array(self.status, s),
            pa.array(self.status_msg, s),
            lst(self.ev_off, pa.array(self.ev_ts, pa.int64()).cast(TS)),
            lst(self.ev_off, pa.array(self.ev_name, s)),
            lst(self.ev_off, self.ev_attrs.array()),
            lst(self.ln_off, pa.array(self.ln_trace, s)),
            lst(self.ln_off, pa.array(self.ln_span, s)),
            lst(self.ln_off, pa.array(self.ln_state, s)),
            lst(self.ln_off, self.ln_attrs.array()),
        ]
        return pa.Table.from_arrays(cols, schema=ARROW_SCHEMA)


# ------------------------------------------------------------------------- protobuf


def _pb_value(v) -> str:
    which = v.WhichOneof("value")
    if which == "string_value":
        return v.string_value
    if which == "int_value":
        return str(v.int_value)
    if which == "bool_value":
        return "true" if v.bool_value else "false"
    if which == "double_value":
        return format_double(v.double_value)
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    if which == "array_value":
        return orjson.dumps([_pb_plain(x) for x in v.array_value.values]).decode()
    if which == "kvlist_value":
        return orjson.dumps({kv.key: _pb_plain(kv.value) for kv in v.kvlist_value.values}).decode()
    return ""


def _pb_plain(v):
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_pb_plain(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _pb_plain(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, which)


def _pb_attrs(kvs) -> dict[str, str]:
    return {kv.key: _pb_value(kv.value) for kv in kvs}


def decode_protobuf(body: bytes, builder: SpanBatchBuilder) -> None:
    """Decode a binary ``ExportTraceServiceRequest`` into ``builder``.

    This is the ingest hot loop: it appends straight into the builder's column lists (no
    per-span dicts or calls for the common cases) and falls back to the general path only
    for spans that need limits applied.
    """
    req = trace_service_pb2.ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except (_PbDecodeError, UnicodeDecodeError, ValueError) as e:
        raise DecodeError(f"invalid protobuf ExportTraceServiceRequest: {e}") from None
    b = builder
    report = b.report
    lim = b.limits
    max_attrs, max_val = lim.max_attributes, lim.max_value_bytes
    kinds, statuses = _KIND_BY_NUM, _STATUS_BY_NUM
    ts_a, tid_a, sid_a, par_a = b.ts.append, b.trace_id.append, b.span_id.append, b.parent.append
    state_a, name_a, kind_a, svc_a = b.state.append, b.name.append, b.kind.append, b.service.append
    sn_a, sv_a, dur_a, st_a, sm_a = (b.scope_name.append, b.scope_version.append, b.duration.append,
                                     b.status.append, b.status_msg.append)
    ra = b.res_attrs
    sa = b.span_attrs
    sa_k, sa_v, sa_off = sa.keys, sa.values, sa.offsets
    ev_off, ln_off = b.ev_off, b.ln_off
    accepted = 0
    max_name = lim.max_name_bytes
    for i, rs in enumerate(req.resource_spans):
        resource = b.clip_attrs(_pb_attrs(rs.resource.attributes))
        r_keys, r_vals = list(resource.keys()), list(resource.values())
        service = resource.get("service.name", "")
        for j, ss in enumerate(rs.scope_spans):
            scope_name, scope_version = ss.scope.name, ss.scope.version
            for k, sp in enumerate(ss.spans):
                tid, sid, pid = sp.trace_id.hex(), sp.span_id.hex(), sp.parent_span_id.hex()
                start, end = sp.start_time_unix_nano, sp.end_time_unix_nano
                why = b.check_span(tid, sid, pid, start, end)
                if why:
                    report.reject(why)
                    continue
                attrs = sp.attributes
                if len(attrs) > max_attrs or sp.events or sp.links:
                    b.add_span(
                        start=start, end=end, trace_id=tid, span_id=sid, parent=pid,
                        trace_state=sp.trace_state, name=sp.name,
                        kind=kinds.get(sp.kind, "Unspecified"), service=service, resource=resource,
                        scope_name=scope_name, scope_version=scope_version,
                        attrs=_pb_attrs(attrs), status=statuses.get(sp.status.code, "Unset"),
                        status_msg=sp.status.message,
                        events=[(e.time_unix_nano, e.name, _pb_attrs(e.attributes)) for e in sp.events],
                        links=[(ln.trace_id.hex(), ln.span_id.hex(), ln.trace_state, _pb_attrs(ln.attributes))
                               for ln in sp.links],
                        path=f"resourceSpans[{i}].scopeSpans[{j}].spans[{k}]",
                    )
                    continue
                ts_a(start)
                tid_a(tid)
                sid_a(sid)
                par_a(pid)
                state_a(sp.trace_state)
                nm = sp.name
                if len(nm) > max_name:
                    nm = b.clip_name(nm)
                name_a(nm)
                kind_a(kinds.get(sp.kind, "Unspecified"))
                svc_a(service)
                ra.keys.extend(r_keys)
                ra.values.extend(r_vals)
                ra.offsets.append(len(ra.keys))
                sn_a(scope_name)
                sv_a(scope_version)
                for kv in attrs:
                    v = kv.value
                    w = v.WhichOneof("value")
                    if w == "string_value":
                        x = v.string_value
                        if len(x) > max_val:
                            report.warn(f"attribute values truncated to {max_val} characters")
                            x = x[:max_val]
                    elif w == "int_value":
                        x = str(v.int_value)
                    else:
                        x = _pb_value(v)
                        if len(x) > max_val:
                            report.warn(f"attribute values truncated to {max_val} characters")
                            x = x[:max_val]
                    sa_k.append(kv.key)
                    sa_v.append(x)
                sa_off.append(len(sa_k))
                dur_a(end - start)
                st = sp.status
                st_a(statuses.get(st.code, "Unset"))
                sm_a(st.message)
                ev_off.append(ev_off[-1])
                ln_off.append(ln_off[-1])
                accepted += 1
    report.accepted += accepted


# ------------------------------------------------- protobuf, checked for the chDB decoder

_Z16, _Z8 = bytes(16), bytes(8)


def _clip_kvs(kvs, lim: Limits, report: DecodeReport) -> bool:
    """Apply the attribute limits to a repeated KeyValue in place; True when it changed.

    A value whose text form is too long becomes a string value holding the cut text, so
    the stored text is what the Python decoder stores."""
    changed = False
    if len(kvs) > lim.max_attributes:
        report.warn(f"attributes dropped beyond {lim.max_attributes} per map", len(kvs) - lim.max_attributes)
        del kvs[lim.max_attributes:]
        changed = True
    max_val = lim.max_value_bytes
    long = 0
    for kv in kvs:
        v = kv.value
        w = v.WhichOneof("value")
        if w == "string_value":
            if len(v.string_value) > max_val:
                v.string_value = v.string_value[:max_val]
                long += 1
        elif w in ("bytes_value", "array_value", "kvlist_value"):
            text = _pb_value(v)
            if len(text) > max_val:
                v.string_value = text[:max_val]
                long += 1
    if long:
        report.warn(f"attribute values truncated to {max_val} characters", long)
    return changed or bool(long)


def _cap(items, most: int, what: str, report: DecodeReport) -> bool:
    """Drop the repeated ``items`` beyond ``most`` (events, links), warning as ``add_span`` does."""
    if len(items) <= most:
        return False
    report.warn(f"{what} dropped beyond {most} per span", len(items) - most)
    del items[most:]
    return True


def _why_span(sp, lo: int, hi: int, max_dur: int) -> str | None:
    tid, sid = sp.trace_id, sp.span_id
    return span_problem(len(tid), tid == _Z16, len(sid), sid == _Z8, len(sp.parent_span_id),
                        sp.start_time_unix_nano, sp.end_time_unix_nano, lo, hi, max_dur)


def _clip_span(sp, path: str, lim: Limits, report: DecodeReport) -> tuple[str | None, bool]:
    """(reason to reject, changed) for a span that may exceed a limit: ``add_span``'s rules."""
    for n, e in enumerate(sp.events):
        if e.time_unix_nano >= 1 << 63:
            return f"{path}.events[{n}].timeUnixNano: out of range (must be below 2^63)", False
    for n, ln in enumerate(sp.links):
        if len(ln.trace_id) != 16 or len(ln.span_id) != 8:
            return f"{path}.links[{n}]: invalid trace id or span id (need 16 and 8 bytes)", False
    changed = False
    max_name = lim.max_name_bytes
    if len(sp.name) > max_name:
        report.warn(f"names truncated to {max_name} characters")
        sp.name = sp.name[:max_name]
        changed = True
    changed |= _clip_kvs(sp.attributes, lim, report)
    changed |= _cap(sp.events, lim.max_events, "events", report)
    for e in sp.events:
        if len(e.name) > max_name:
            report.warn(f"names truncated to {max_name} characters")
            e.name = e.name[:max_name]
            changed = True
        changed |= _clip_kvs(e.attributes, lim, report)
    changed |= _cap(sp.links, lim.max_links, "links", report)
    for ln in sp.links:
        changed |= _clip_kvs(ln.attributes, lim, report)
    return None, changed


def _check_spans(ss, ks, i: int, j: int, *, lo: int, hi: int, max_dur: int, max_attrs: int, may_be_long: bool,
                 small: int, lim: Limits, report: DecodeReport) -> tuple[int, bool, bool]:
    """Check spans ``ks`` (indices, ascending) of the parsed ScopeSpans ``ss`` (``j`` of resource
    ``i``): ids and times, then the limits for one that may exceed them (many attributes,
    events, links, a big span); rejected ones are cut out. Returns (accepted, changed,
    some accepted span has events or links)."""
    accepted, changed, events_links, drop = 0, False, False, []
    for k in ks:
        sp = ss.spans[k]
        why, ch = _why_span(sp, lo, hi, max_dur), False
        if why is None and (len(sp.attributes) > max_attrs or sp.events or sp.links
                            or (may_be_long and sp.ByteSize() > small)):
            why, ch = _clip_span(sp, f"resourceSpans[{i}].scopeSpans[{j}].spans[{k}]", lim, report)
        changed |= ch
        if why is not None:
            report.reject(why)
            drop.append(k)
        else:
            accepted += 1
            events_links |= bool(sp.events or sp.links)
    for k in reversed(drop):
        del ss.spans[k]
    return accepted, changed or bool(drop), events_links


class Accepted(NamedTuple):
    body: bytes  #: what to store: the bytes received unless a span was rejected or clipped
    report: DecodeReport  #: what the response tells the client
    events_links: bool  #: some stored span has events or links (the decoder must read them)


def _accept_unparsed(body: bytes, lim: Limits, lo: int, hi: int, max_dur: int, small: int) -> Accepted | None:
    """The arrival check without upb's parse, for the common request: one upb would parse
    (``otlp_scan.validate``), every span plainly fine, no Resource that a limit could touch (at
    most ``max_attributes`` attributes, its values' text at most 4x its encoded size). None:
    check it the long way."""
    v = S.validate(body, lo, hi, max_dur, lim.max_attributes, small)  # (one walk judges every span too)
    if v is None:
        return None
    n_spans, _, res_attrs, res_bytes, n_fine = v
    if res_attrs > lim.max_attributes or res_bytes > lim.max_value_bytes // 4 or n_fine != n_spans:
        return None
    return Accepted(body, DecodeReport(accepted=n_spans), False)


def accept_protobuf(body: bytes, limits: Limits | None = None, now_ns: int | None = None) -> Accepted:
    """Check a binary ``ExportTraceServiceRequest`` the way :func:`decode_protobuf` does. What the
    store keeps is decoded later, in bulk (``otlp_compiled``, ``otlp_sql``); this pass reads a few
    fields per span and nothing per attribute, except for spans that may exceed a limit (big
    ones, many attributes, events or links). The common request is not parsed at all
    (:func:`_accept_unparsed`)."""
    lim = limits or Limits()
    now = now_ns if now_ns is not None else time.time_ns()
    lo, hi, max_dur = lim.min_start_ns, now + lim.max_future_ns, lim.max_duration_ns
    max_attrs = lim.max_attributes
    # a span's attribute text can be up to ~4x its encoded size (JSON of tiny nested
    # values); smaller spans cannot reach any length limit
    small = min(lim.max_value_bytes, lim.max_name_bytes) // 4
    may_be_long = len(body) > small
    if min(lo, max_dur) >= 0:  # (limits that fit the scan's unsigned times)
        plain = _accept_unparsed(body, lim, lo, hi, max_dur, small if may_be_long else -1)
        if plain is not None:
            return plain
    req = trace_service_pb2.ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except (_PbDecodeError, UnicodeDecodeError, ValueError) as e:
        raise DecodeError(f"invalid protobuf ExportTraceServiceRequest: {e}") from None
    report = DecodeReport()
    changed = events_links = False
    accepted = 0
    scopes = [ss for rs in req.resource_spans for ss in rs.scope_spans]
    check = functools.partial(_check_spans, lo=lo, hi=hi, max_dur=max_dur, max_attrs=max_attrs,
                              may_be_long=may_be_long, small=small, lim=lim, report=report)
    fast = (S.scan(body, sum(len(ss.spans) for ss in scopes), len(scopes))
            if min(lo, max_dur) >= 0 else None)  # (limits that fit the scan's unsigned times)
    # a span the Python checks would pass untouched: ids, times, no limit within reach
    plain = None if fast is None else S.fine(fast[0], fast[1], lo, hi, max_dur, max_attrs, small if may_be_long else -1)
    if plain is None:
        fast = None
    for rs in req.resource_spans:
        changed |= _clip_kvs(rs.resource.attributes, lim, report)
    if fast is None:  # every span checked in Python
        for i, rs in enumerate(req.resource_spans):
            for j, ss in enumerate(rs.scope_spans):
                n, ch, el = check(ss, range(len(ss.spans)), i, j)
                accepted, changed, events_links = accepted + n, changed | ch, events_links | el
    else:
        ints, times, where = fast
        accepted, fine = plain
        if accepted < len(fine):  # the few that need a closer look, scope by scope
            bad = np.flatnonzero(~fine)
            first = np.searchsorted(ints[:, S.SCOPE], np.arange(len(scopes)))  # each scope's first row
            for g in np.unique(ints[bad, S.SCOPE]).tolist():
                i, j = where[g].tolist()
                ks = (bad[ints[bad, S.SCOPE] == g] - first[g]).tolist()
                n, ch, el = check(req.resource_spans[i].scope_spans[j], ks, i, j)
                accepted, changed, events_links = accepted + n, changed | ch, events_links | el
    report.accepted = accepted
    return Accepted(req.SerializeToString() if changed else body, report, events_links)


# ----------------------------------------------------------------------------- JSON


class _J:
    """Typed access to OTLP/JSON objects with a path for error messages."""

    @staticmethod
    def get(obj: dict, camel: str, snake: str | None = None):
        v = obj.get(camel)
        if v is None and snake:
            v = obj.get(snake)
        return v

    @staticmethod
    def obj(v, path: str) -> dict:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise DecodeError(f"{path}: expected an object, got {type(v).__name__}")
        return v

    @staticmethod
    def arr(v, path: str) -> list:
        if v is None:
            return []
        if not isinstance(v, list):
            raise DecodeError(f"{path}: expected an array, got {type(v).__name__}")
        return v

    @staticmethod
    def str_(v, path: str) -> str:
        if v is None:
            return ""
        if not isinstance(v, str):
            raise DecodeError(f"{path}: expected a string, got {type(v).__name__}")
        return v

    @staticmethod
    def uint64(v, path: str) -> int:
        if v is None:
            return 0
        if isinstance(v, bool):
            raise DecodeError(f"{path}: expected an integer, got boolean")
        if isinstance(v, int):
            n = v
        elif isinstance(v, str):
            try:
                n = int(v)
            except ValueError:
                raise DecodeError(f"{path}: expected an integer, got string {v[:40]!r}") from None
        else:
            raise DecodeError(f"{path}: expected an integer, got {type(v).__name__}")
        if n < 0 or n >= 2**64:
            raise DecodeError(f"{path}: {n} is outside the range of fixed64")
        return n

    @staticmethod
    def id_hex(v, path: str, nbytes: int) -> str:
        """OTLP/JSON ids are hex strings (not base64)."""
        if v is None or v == "":
            return ""
        if not isinstance(v, str):
            raise DecodeError(f"{path}: expected a hex string, got {type(v).__name__}")
        h = v.lower()
        try:
            bytes.fromhex(h)
        except ValueError:
            raise DecodeError(f"{path}: {v[:40]!r} is not hex") from None
        return h

    @staticmethod
    def enum(v, path: str, by_num: dict, by_name: dict, default: str) -> str:
        if v is None:
            return default
        if isinstance(v, bool):
            raise DecodeError(f"{path}: expected an enum number, got boolean")
        if isinstance(v, int):
            return by_num.get(v, default)
        if isinstance(v, str):
            if v in by_name:
                return by_name[v]
            raise DecodeError(f"{path}: unknown enum value {v[:40]!r}")
        raise DecodeError(f"{path}: expected an enum number, got {type(v).__name__}")


def _json_plain(v: dict, path: str):
    v = _J.obj(v, path)
    if not v:
        return None
    (key, val), = list(v.items())[:1]
    if key == "stringValue":
        return _J.str_(val, path + ".stringValue")
    if key == "boolValue":
        if not isinstance(val, bool):
            raise DecodeError(f"{path}.boolValue: expected a boolean, got {type(val).__name__}")
        return val
    if key == "intValue":
        if isinstance(val, bool) or not isinstance(val, (int, str)):
            raise DecodeError(f"{path}.intValue: expected an integer, got {type(val).__name__}")
        try:
            return int(val)
        except ValueError:
            raise DecodeError(f"{path}.intValue: {str(val)[:40]!r} is not an integer") from None
    if key == "doubleValue":
        if isinstance(val, bool) or not isinstance(val, (int, float, str)):
            raise DecodeError(f"{path}.doubleValue: expected a number, got {type(val).__name__}")
        try:
            return float(val)
        except ValueError:
            raise DecodeError(f"{path}.doubleValue: {str(val)[:40]!r} is not a number") from None
    if key == "bytesValue":
        return _J.str_(val, path + ".bytesValue")
    if key == "arrayValue":
        vals = _J.arr(_J.obj(val, path + ".arrayValue").get("values"), path + ".arrayValue.values")
        return [_json_plain(x, f"{path}.arrayValue.values[{i}]") for i, x in enumerate(vals)]
    if key == "kvlistValue":
        vals = _J.arr(_J.obj(val, path + ".kvlistValue").get("values"), path + ".kvlistValue.values")
        out = {}
        for i, kv in enumerate(vals):
            p = f"{path}.kvlistValue.values[{i}]"
            kv = _J.obj(kv, p)
            out[_J.str_(kv.get("key"), p + ".key")] = _json_plain(kv.get("value"), p + ".value")
        return out
    return None  # unknown keys are ignored, as OTLP/JSON asks


def _json_value(v, path: str) -> str:
    p = _json_plain(v, path)
    if p is None:
        return ""
    if isinstance(p, str):
        return p
    if isinstance(p, bool):
        return "true" if p else "false"
    if isinstance(p, int):
        return str(p)
    if isinstance(p, float):
        return format_double(p)
    return orjson.dumps(p).decode()


def _json_attrs(v, path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, kv in enumerate(_J.arr(v, path)):
        p = f"{path}[{i}]"
        kv = _J.obj(kv, p)
        out[_J.str_(kv.get("key"), p + ".key")] = _json_value(kv.get("value"), p + ".value")
    return out


def decode_json(body: bytes, builder: SpanBatchBuilder) -> None:
    """Decode an OTLP/JSON ``ExportTraceServiceRequest`` into ``builder``."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise DecodeError(f"invalid JSON: {e}") from None
    doc = _J.obj(doc, "$")
    report = builder.report
    for i, rs in enumerate(_J.arr(_J.get(doc, "resourceSpans", "resource_spans"), "resourceSpans")):
        prs = f"resourceSpans[{i}]"
        rs = _J.obj(rs, prs)
        res = _J.obj(rs.get("resource"), prs + ".resource")
        resource = builder.clip_attrs(_json_attrs(res.get("attributes"), prs + ".resource.attributes"))
        service = resource.get("service.name", "")
        for j, ss in enumerate(_J.arr(_J.get(rs, "scopeSpans", "scope_spans"), prs + ".scopeSpans")):
            pss = f"{prs}.scopeSpans[{j}]"
            ss = _J.obj(ss, pss)
            scope = _J.obj(ss.get("scope"), pss + ".scope")
            scope_name = _J.str_(scope.get("name"), pss + ".scope.name")
            scope_version = _J.str_(scope.get("version"), pss + ".scope.version")
            for k, sp in enumerate(_J.arr(ss.get("spans"), pss + ".spans")):
                p = f"{pss}.spans[{k}]"
                sp = _J.obj(sp, p)
                g = _J.get
                tid = _J.id_hex(g(sp, "traceId", "trace_id"), p + ".traceId", 16)
                sid = _J.id_hex(g(sp, "spanId", "span_id"), p + ".spanId", 8)
                pid = _J.id_hex(g(sp, "parentSpanId", "parent_span_id"), p + ".parentSpanId", 8)
                start = _J.uint64(g(sp, "startTimeUnixNano", "start_time_unix_nano"), p + ".startTimeUnixNano")
                end = _J.uint64(g(sp, "endTimeUnixNano", "end_time_unix_nano"), p + ".endTimeUnixNano")
                status = _J.obj(sp.get("status"), p + ".status")
                events = []
                for n, ev in enumerate(_J.arr(sp.get("events"), p + ".events")):
                    pe = f"{p}.events[{n}]"
                    ev = _J.obj(ev, pe)
                    events.append(
                        (
                            _J.uint64(g(ev, "timeUnixNano", "time_unix_nano"), pe + ".timeUnixNano"),
                            _J.str_(ev.get("name"), pe + ".name"),
                            _json_attrs(ev.get("attributes"), pe + ".attributes"),
                        )
                    )
                links = []
                for n, ln in enumerate(_J.arr(sp.get("links"), p + ".links")):
                    pl_ = f"{p}.links[{n}]"
                    ln = _J.obj(ln, pl_)
                    links.append(
                        (
                            _J.id_hex(g(ln, "traceId", "trace_id"), pl_ + ".traceId", 16),
                            _J.id_hex(g(ln, "spanId", "span_id"), pl_ + ".spanId", 8),
                            _J.str_(g(ln, "traceState", "trace_state"), pl_ + ".traceState"),
                            _json_attrs(ln.get("attributes"), pl_ + ".attributes"),
                        )
                    )
                attrs = _json_attrs(sp.get("attributes"), p + ".attributes")
                kind = _J.enum(sp.get("kind"), p + ".kind", _KIND_BY_NUM, _KIND_BY_NAME, "Unspecified")
                code = _J.enum(status.get("code"), p + ".status.code", _STATUS_BY_NUM, _STATUS_BY_NAME, "Unset")
                why = builder.check_span(tid, sid, pid, start, end)
                if why:
                    report.reject(why)
                    continue
                builder.add_span(
                    start=start,
                    end=end,
                    trace_id=tid,
                    span_id=sid,
                    parent=pid,
                    trace_state=_J.str_(g(sp, "traceState", "trace_state"), p + ".traceState"),
                    name=_J.str_(sp.get("name"), p + ".name"),
                    kind=kind,
                    service=service,
                    resource=resource,
                    scope_name=scope_name,
                    scope_version=scope_version,
                    attrs=attrs,
                    status=code,
                    status_msg=_J.str_(status.get("message"), p + ".status.message"),
                    events=events,
                    links=links,
                    path=p,
                )


def decode(body: bytes, content_type: str, limits: Limits | None = None) -> tuple[pa.Table, DecodeReport]:
    """Decode one request body. ``content_type`` is ``protobuf`` or ``json``."""
    b = SpanBatchBuilder(limits)
    if content_type == "protobuf":
        decode_protobuf(body, b)
    elif content_type == "json":
        decode_json(body, b)
    else:  # pragma: no cover - the HTTP layer checks first
        raise ValueError(content_type)
    return b.table(), b.report


def encode_response(report: DecodeReport, content_type: str) -> bytes:
    """``ExportTraceServiceResponse`` (with partial success when needed)."""
    if not (report.rejected or report.reasons or report.warnings):  # all accepted: an empty message
        return b"{}" if content_type == "json" else b""
    msg = report.message()
    if content_type == "json":
        if report.rejected or msg:
            return orjson.dumps(
                {"partialSuccess": {"rejectedSpans": str(report.rejected), "errorMessage": msg}}
            )
        return b"{}"
    resp = trace_service_pb2.ExportTraceServiceResponse()
    if report.rejected or msg:
        resp.partial_success.rejected_spans = report.rejected
        resp.partial_success.error_message = msg
    return resp.SerializeToString()
