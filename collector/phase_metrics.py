"""Phase metrics derived from spans as they arrive (what vLLM's own metrics cannot show).

Histograms are kept as numpy bucket counts per label set and filled a whole batch at a
time (``np.searchsorted`` + ``np.bincount``), then exposed through prometheus-client as a
custom collector: no Python call per span.
"""

from __future__ import annotations

import threading

import numpy as np
import polars as pl
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

    def observe(self, df: pl.DataFrame, value: str) -> None:
        if df.height == 0:
            return
        for key, g in df.group_by(list(self.labels), maintain_order=True):
            v = g[value].to_numpy()
            idx = np.searchsorted(self.edges, v, side="left")  # le semantics: v <= edge
            counts = np.bincount(idx, minlength=len(self.edges) + 1)
            k = tuple(str(x) for x in (key if isinstance(key, tuple) else (key,)))
            cur = self.data.setdefault(k, [np.zeros(len(self.edges) + 1, dtype=np.int64), 0.0])
            cur[0] += counts
            cur[1] += float(v.sum())

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
        cols = {"name": names, "label": sa[Attr.PHASE], "own_model": sa[Attr.MODEL], "res_model": ra[ResourceAttr.MODEL],
                "priority": sa[Attr.PRIORITY], "streaming": sa[Attr.HTTP_STREAMING], "rank": sa[Attr.RANK],
                "instance": ra[ResourceAttr.SERVICE_INSTANCE], "role": ra[ResourceAttr.ROLE],
                "seconds": pc.divide(table.column("Duration").cast(pa.float64()), 1e9).combine_chunks()}
        every = pc.all(wanted).as_py()
        df = pl.from_arrow(pa.table({k: (v if every else v.filter(wanted)).cast(pa.string()) if k != "seconds"
                                     else (v if every else v.filter(wanted)) for k, v in cols.items()})).with_columns(
            pl.when(pl.col("own_model") != "").then(pl.col("own_model")).otherwise(pl.col("res_model")).alias("model"),
            pl.when(pl.col("label").is_in(SPAN_PHASES)).then(pl.col("label"))  # a label we know
            .otherwise(pl.col("name").replace_strict(OWN_SPAN_PHASE, default="")).alias("phase"))

        def only(name: str) -> pl.DataFrame:
            return df.filter(pl.col("name") == name)

        with self._lock:
            self.phase.observe(df.filter((pl.col("phase") != "") & (pl.col("name") != SpanName.ALLREDUCE_CALL)),
                               "seconds")
            self.ttft.observe(only(SpanName.HTTP), "seconds")
            self.allreduce.observe(only(SpanName.ALLREDUCE), "seconds")
            for r in only(SpanName.PROCESS_START).iter_rows(named=True):  # a few per start
                self.cold[(r["instance"], r["role"])] = r["seconds"]

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
