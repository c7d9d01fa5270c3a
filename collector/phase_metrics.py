"""Phase metrics derived from spans as they arrive (what vLLM's own metrics cannot show).

Histograms are kept as numpy bucket counts per label set and filled a whole batch at a
time (``np.searchsorted`` + ``np.bincount``), then exposed through prometheus-client as a
custom collector: no Python call per span.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from ttftscope.schemas import metrics as M
from ttftscope.schemas.phases import OWN_SPAN_PHASE, SPAN_PHASES
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName


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


def _lookups(col: pa.ChunkedArray, keys: tuple[str, ...]) -> dict[str, pa.Array]:
    """Each key's value in every row of a string map column ("" where absent; the first entry
    where a key repeats): one pass over the flattened entries for all keys (``pc.map_lookup``
    walks the maps once per key, and was most of this module's time)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
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
