"""Phase metrics derived from spans as they arrive (what vLLM's own metrics cannot show).

Histograms are kept as numpy bucket counts per label set and filled a whole batch at a
time (``np.searchsorted`` + ``np.bincount``), then exposed through prometheus-client as a
custom collector: no Python call per span.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from ttftscope.schemas import metrics as M
from ttftscope.schemas.phases import OWN_SPAN_PHASE, SPAN_PHASES
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

from .otlp_wire import _jit

log = logging.getLogger("ttftscope.collector")


class _Hist:
    def __init__(self, name: str, doc: str, labels: tuple[str, ...], buckets=M.SECONDS_BUCKETS) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.edges = np.asarray(buckets, dtype=float)
        self.data: dict[tuple, list] = {}  # labels -> [bucket counts (len+1), sum]

    def observe(self, labels: list[pa.Array], v: np.ndarray) -> None:
        """Count ``v`` (seconds) into the buckets of each row's label set (``labels``: one
        string array per label name): label sets as integer codes, one ``bincount`` for all."""
        if len(v) == 0:
            return
        key = np.zeros(len(v), dtype=np.int64)
        dicts = []
        for a in labels:  # mixed-radix code of the row's label values
            enc = a.dictionary_encode()
            dicts.append(enc.dictionary.to_pylist())
            key = key * len(dicts[-1]) + enc.indices.to_numpy(zero_copy_only=False)
        groups, inv = np.unique(key, return_inverse=True)
        nb = len(self.edges) + 1
        idx = np.searchsorted(self.edges, v, side="left")  # le semantics: v <= edge
        counts = np.bincount(inv * nb + idx, minlength=len(groups) * nb).reshape(len(groups), nb)
        order = np.argsort(inv, kind="stable")  # each group's values in row order, for their sum
        bounds = np.searchsorted(inv[order], np.arange(len(groups) + 1))
        vs = v[order]
        for g, code in enumerate(groups.tolist()):
            k = []
            for d in reversed(dicts):
                code, i = divmod(code, len(d))
                k.append(str(d[i]))
            cur = self.data.setdefault(tuple(reversed(k)), [np.zeros(nb, dtype=np.int64), 0.0])
            cur[0] += counts[g]
            cur[1] += float(vs[bounds[g]:bounds[g + 1]].sum())

    def collect(self):
        m = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        for k, (counts, total) in sorted(self.data.items()):
            cum = np.cumsum(counts)
            buckets = [(M.le(e), int(c)) for e, c in zip(self.edges, cum[:-1], strict=True)]
            buckets.append(("+Inf", int(cum[-1])))
            m.add_metric(list(k), buckets, total)
        return m


def _first_hits(key_off, key_data, map_off, want_data, want_off, out):
    """``out[j, r]``: the entry index of the first key equal to wanted key ``j`` in row ``r``'s
    map (entries ``map_off[r]:map_off[r + 1]``, keys as string offsets into ``key_data``),
    left as it was (-1) where row ``r`` has none. One pass over the entries for every key."""
    k = want_off.shape[0] - 1
    for r in range(map_off.shape[0] - 1):
        for e in range(map_off[r], map_off[r + 1]):
            a = key_off[e]
            n = key_off[e + 1] - a
            for j in range(k):
                w = want_off[j]
                if out[j, r] >= 0 or want_off[j + 1] - w != n:
                    continue
                same = True
                for t in range(n):
                    if key_data[a + t] != want_data[w + t]:
                        same = False
                        break
                if same:
                    out[j, r] = e
                    break


if _jit is not None:
    _first_hits = _jit(_first_hits)

_compiled = False  # _first_hits compiled (warm_up): the flusher never waits for numba's compiler


def warm_up() -> bool:
    """Compile the lookup pass (from numba's cache after the first start). Until this is done,
    or without numba, :func:`_lookups` uses Arrow kernels (one walk over the keys per key)."""
    global _compiled
    if _jit is None:
        return False
    try:
        arr = pa.array([[("a", "1")]], pa.map_(pa.string(), pa.string()))
        # compiled first, then used: a flush meanwhile takes the Arrow path, never numba's lock
        _compiled = _lookups(arr, ("a",), compiled=True)["a"].to_pylist() == ["1"]
    except Exception:  # noqa: BLE001 - the Arrow path stays
        _compiled = False
        log.warning("cannot compile the phase metrics' lookup pass", exc_info=True)
    return _compiled


def _lookups(col: pa.ChunkedArray | pa.Array, keys: tuple[str, ...], compiled: bool | None = None) -> dict[str, pa.Array]:
    """Each key's value in every row of a string map column ("" where absent or the map is null;
    the first entry where a key repeats): one compiled pass over the entries for all keys
    (``compiled``: whether to take it; by default once :func:`warm_up` has compiled it)."""
    if isinstance(col, pa.ChunkedArray):  # (one chunk as it is: combining copies it)
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    else:
        arr = col
    if not (_compiled if compiled is None else compiled) or arr.type.key_type != pa.string():
        return _lookups_arrow(arr, keys)
    n = len(arr)
    ks = arr.keys  # the whole child: the map's offsets index it as they are
    kb = ks.buffers()
    key_off = np.frombuffer(kb[1], dtype=np.int32, count=len(ks) + 1, offset=ks.offset * 4) if len(ks) else \
        np.zeros(1, dtype=np.int32)
    key_data = np.frombuffer(kb[2], dtype=np.uint8) if kb[2] is not None else np.zeros(0, dtype=np.uint8)
    map_off = arr.offsets.to_numpy()
    for a in (key_off, key_data, map_off):  # all read-only: one compiled signature, whatever the source
        a.flags.writeable = False
    want = [k.encode() for k in keys]
    want_off = np.zeros(len(want) + 1, dtype=np.int64)
    want_off[1:] = np.cumsum([len(w) for w in want])
    pos = np.full((len(keys), n), -1, dtype=np.int64)
    _first_hits(key_off, key_data, map_off, np.frombuffer(b"".join(want) or b"\0", dtype=np.uint8), want_off, pos)
    if arr.null_count:
        pos[:, ~arr.is_valid().to_numpy(zero_copy_only=False)] = -1
    vs = arr.items
    return {key: pc.fill_null(pc.take(vs, pa.array(pos[j], mask=pos[j] < 0)), "") for j, key in enumerate(keys)}


def _lookups_arrow(arr: pa.Array, keys: tuple[str, ...]) -> dict[str, pa.Array]:
    """:func:`_lookups` with Arrow kernels: one ``pc.equal`` over the flattened keys per key
    (``pc.map_lookup`` walks the maps once per key and was slower still)."""
    n = len(arr)
    off = arr.offsets.to_numpy()
    lo, hi = int(off[0]), int(off[-1])
    ks, vs = arr.keys.slice(lo, hi - lo), arr.items.slice(lo, hi - lo)
    parents = np.repeat(np.arange(n), np.diff(off))
    valid = None if arr.null_count == 0 else arr.is_valid().to_numpy(zero_copy_only=False)[parents]
    out = {}
    for key in keys:
        hit = pc.equal(ks, key).to_numpy(zero_copy_only=False)
        if valid is not None:
            hit &= valid
        at = np.flatnonzero(hit)
        pos = np.full(n, -1, dtype=np.int64)
        pos[parents[at][::-1]] = at[::-1]  # the first entry wins
        got = pc.take(vs, pa.array(pos, mask=pos < 0))
        out[key] = pc.fill_null(got, "")
    return out


class PhaseMetrics:
    """Register on a registry; call :meth:`observe` with each accepted span batch."""

    def __init__(self, registry) -> None:
        self._lock = threading.Lock()
        self.phase = _Hist(M.PHASE_DURATION, "Duration of TTFT phase spans", ("phase", "model", "priority"))
        self.ttft = _Hist(M.TTFT, "TTFT as the client sees it (ttftscope.http spans: request received -> "
                          "first token bytes written; non-streaming: the whole response)", ("model", "priority", "streaming"))
        self.allreduce = _Hist(M.ALLREDUCE, "Tensor-parallel collective time per engine step and rank", ("rank",))
        self.cold: dict[tuple, float] = {}
        registry.register(self)

    def observe(self, table: pa.Table) -> None:
        # a span's phase: its ttftscope.phase attribute (another instrumentation's label) or its
        # name's. The attributes are looked up in every row and the few columns filtered after:
        # filtering the table first copied its maps (40 % of this method's time)
        sa = _lookups(table.column("SpanAttributes"), (Attr.PHASE, Attr.MODEL, Attr.PRIORITY, Attr.HTTP_STREAMING,
                                                       Attr.RANK))
        names = table.column("SpanName").combine_chunks()
        wanted = pc.or_(pc.is_in(sa[Attr.PHASE], pa.array(SPAN_PHASES)),
                        pc.is_in(names, pa.array([*OWN_SPAN_PHASE, SpanName.HTTP, SpanName.PROCESS_START])))
        if not pc.any(wanted).as_py():
            return
        ra = _lookups(table.column("ResourceAttributes"),
                      (ResourceAttr.MODEL, ResourceAttr.SERVICE_INSTANCE, ResourceAttr.ROLE))
        every = pc.all(wanted).as_py()

        def rows(a):  # the wanted rows of an array
            return a if every else a.filter(wanted)

        name, label = rows(names), rows(sa[Attr.PHASE])
        own_model, res_model = rows(sa[Attr.MODEL]), rows(ra[ResourceAttr.MODEL])
        model = pc.if_else(pc.not_equal(own_model, ""), own_model, res_model)
        own = pc.index_in(name, value_set=pa.array(list(OWN_SPAN_PHASE), pa.string()))
        by_name = pc.take(pa.array([*OWN_SPAN_PHASE.values(), ""], pa.string()),
                          pc.fill_null(own, len(OWN_SPAN_PHASE)))
        phase = pc.if_else(pc.is_in(label, pa.array(SPAN_PHASES)), label, by_name)  # a label we know, or the name's
        seconds = rows(pc.divide(table.column("Duration").cast(pa.float64()), 1e9).combine_chunks())
        sec = seconds.to_numpy(zero_copy_only=False)
        priority, streaming, rank = rows(sa[Attr.PRIORITY]), rows(sa[Attr.HTTP_STREAMING]), rows(sa[Attr.RANK])

        def only(mask) -> tuple[pa.Array, np.ndarray]:
            m = mask.to_numpy(zero_copy_only=False)
            return pa.array(m), sec[m]

        with self._lock:
            m, v = only(pc.and_(pc.not_equal(phase, ""), pc.not_equal(name, SpanName.ALLREDUCE_CALL)))
            self.phase.observe([phase.filter(m), model.filter(m), priority.filter(m)], v)
            m, v = only(pc.equal(name, SpanName.HTTP))
            self.ttft.observe([model.filter(m), priority.filter(m), streaming.filter(m)], v)
            m, v = only(pc.equal(name, SpanName.ALLREDUCE))
            self.allreduce.observe([rank.filter(m)], v)
            m, v = only(pc.equal(name, SpanName.PROCESS_START))
            for inst, role, s in zip(rows(ra[ResourceAttr.SERVICE_INSTANCE]).filter(m).to_pylist(),
                                     rows(ra[ResourceAttr.ROLE]).filter(m).to_pylist(), v.tolist(), strict=True):
                self.cold[(inst, role)] = s  # a few per start

    def collect(self):
        with self._lock:
            yield self.phase.collect()
            yield self.ttft.collect()
            yield self.allreduce.collect()
            g = GaugeMetricFamily(M.COLD_START, "Process start to ready (cold start)", labels=["instance", "role"])
            for (inst, role), v in sorted(self.cold.items()):
                g.add_metric([inst, role], v)
            yield g

    def describe(self):
        return []
