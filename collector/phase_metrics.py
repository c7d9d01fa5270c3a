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


def _lookup(col: pa.ChunkedArray, key: str) -> pa.Array:
    return pc.fill_null(pc.map_lookup(col, key, "first"), "")


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
        # a span's phase: its ttftscope.phase attribute (another instrumentation's label) or its name's
        label = _lookup(table.column("SpanAttributes"), Attr.PHASE)
        wanted = pc.or_(pc.is_in(label, pa.array(SPAN_PHASES)),
                        pc.is_in(table.column("SpanName"), pa.array([*OWN_SPAN_PHASE, SpanName.HTTP, SpanName.PROCESS_START])))
        t = table.filter(wanted)
        if t.num_rows == 0:
            return
        sa, ra = t.column("SpanAttributes"), t.column("ResourceAttributes")
        own = _lookup(sa, Attr.MODEL)
        model = pc.if_else(pc.not_equal(own, ""), own, _lookup(ra, ResourceAttr.MODEL))
        df = pl.DataFrame({
            "name": t.column("SpanName").to_numpy(zero_copy_only=False),
            "label": label.filter(wanted).to_numpy(zero_copy_only=False),
            "seconds": t.column("Duration").to_numpy().astype(float) / 1e9,
            "model": model.to_numpy(zero_copy_only=False),
            "priority": _lookup(sa, Attr.PRIORITY).to_numpy(zero_copy_only=False),
        }).with_columns(pl.when(pl.col("label").is_in(SPAN_PHASES)).then(pl.col("label"))  # a label we know
                        .otherwise(pl.col("name").replace_strict(OWN_SPAN_PHASE, default="")).alias("phase"))

        def only(name: str, **keys: tuple[str, str]) -> pl.DataFrame:
            """The rows of one span name, with the attributes only they need (looked up there)."""
            mask = pc.equal(t.column("SpanName"), name)
            sub = t.filter(mask)
            cols = {k: _lookup(sub.column(col), key).to_numpy(zero_copy_only=False) for k, (col, key) in keys.items()}
            return df.filter(pl.Series(mask.to_numpy(zero_copy_only=False))).with_columns(
                [pl.Series(k, v, dtype=pl.Utf8) for k, v in cols.items()])

        http = only(SpanName.HTTP, streaming=("SpanAttributes", Attr.HTTP_STREAMING))
        allreduce = only(SpanName.ALLREDUCE, rank=("SpanAttributes", Attr.RANK))
        starts = only(SpanName.PROCESS_START, instance=("ResourceAttributes", ResourceAttr.SERVICE_INSTANCE),
                      role=("ResourceAttributes", ResourceAttr.ROLE))
        with self._lock:
            self.phase.observe(df.filter((pl.col("phase") != "") & (pl.col("name") != SpanName.ALLREDUCE_CALL)),
                               "seconds")
            self.ttft.observe(http, "seconds")
            self.allreduce.observe(allreduce, "seconds")
            for r in starts.iter_rows(named=True):  # a few per start
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
