"""The embedded store: ClickHouse SQL on chDB over immutable Parquet parts.

Why this layout: a chDB data directory can be opened by one process only, yet the collector
must write while the CLI and the UI read. So writers never share an engine with readers:

* a writer turns each batch into an immutable part file (Parquet, sorted by Timestamp,
  ZSTD, bloom filter on TraceId), written to a temporary name, fsynced and renamed;
* ``manifest.json`` lists the live parts. It is replaced atomically (write, fsync, rename)
  under an exclusive ``flock``, so any number of writer processes can commit;
* a reader opens chDB in its own process and defines ``otel_traces`` as a view over the
  parts the manifest lists (``file('{a,b,...}.parquet', Parquet, <exact column types>)``),
  refreshed whenever the manifest changes. Every reader sees a consistent snapshot.

A writer killed at any point leaves either the old manifest or the new one; parts not in
the manifest are orphans, removed later. Small parts are merged in the background into
larger ones (like MergeTree); merged-away files are deleted after a grace period so that
a reader still holding the old snapshot can finish. Retention drops whole parts by age
(like ``ttl_only_drop_parts``). Insert tokens are remembered like ClickHouse's
``non_replicated_deduplication_window``: the same batch inserted twice is stored once (the
window kept as runs of a spool's consecutive segment numbers: ``tokens.py``).
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import re
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import engine
from ..columns import ARROW_SCHEMA, clickhouse_structure
from ..ddl import SCHEMA_VERSION, TRACE_ID_TS, TRACES
from ..sql import quote
from . import parquet_concat, tokens
from .base import Store, StoreError, StoreUnavailable

log = logging.getLogger("ttftscope.store")

FORMAT = "ttftscope-embedded"
#: Parquet key-value metadata every part carries, so a lost manifest can be rebuilt from the
#: parts alone: the insert token of a level-0 part, the names a merged part replaced.
PART_META = b"ttftscope.part"
REPAIR_HINT = "run `ttftscope store check --repair`"
NS_PER_DAY = 86_400 * 10**9
_BAD_PATH_CHARS = re.compile(r"[*?{}\[\]'\\,]")

#: overlapping parts are merged by reading and sorting them together up to this many rows, and
#: streamed (sorted within each row group) beyond it
SORTED_MERGE_ROWS = 131_072

#: a merge copies parts as bytes (their row groups kept) when each holds at least this share of
#: a row group (1/8: 4096 rows at the default 32,768), overlapping in time or not; smaller ones are
#: read and written again. A fleet's 2-s flushes of ~5k spans were re-encoded in their first
#: merge: as much CPU as the flush itself (bench/ingest's fleet: the flusher 20.2 -> 11.7 us a span
#: with merges off), while reads over 5k-row row groups measured the same as over 32k-row ones
#: (the analyzer over 189k spans: 2.79-2.80 s against 2.70-2.97 s)
COPY_MIN_ROW_GROUP_SHARE = 8

#: span and trace ids are unique: a dictionary page for them is work (and bytes) thrown away,
#: and their min/max statistics prune nothing (trace lookups use the bloom filter); nor do a
#: map's. bench/ingest's 50k-span flush: Parquet writing 74 -> 50 ms, parts 20% smaller.
_IDS = ("TraceId", "SpanId", "ParentSpanId", "Links.TraceId", "Links.SpanId")
_PARQUET = {
    "write_page_checksum": True,  # a merge copies pages as bytes (parquet_concat) after checking these
    "compression": "zstd",
    "compression_level": 1,
    # times and durations are nearly unique too (a 200k-span part: -7 % of the writing, -10 % of
    # the bytes); start times, stored in order, as deltas (another -6 % of the bytes)
    "use_dictionary": [f.name for f in ARROW_SCHEMA if f.name not in (*_IDS, "Timestamp", "Duration")],
    "column_encoding": {"Timestamp": "DELTA_BINARY_PACKED"},
    "write_statistics": [f.name for f in ARROW_SCHEMA if f.name not in _IDS and not pa.types.is_map(f.type)
                         and not (pa.types.is_list(f.type) and pa.types.is_map(f.type.value_type))],
}

# chDB keeps one engine per process: every EmbeddedStore shares it, one database each.
_ENGINE_LOCK = engine.LOCK
_session = engine.session


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _publish(tmp: Path, final: Path) -> None:
    """Make a finished part file durable, then visible under its final name."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def _json_loads(data: bytes) -> Any:
    """``orjson.loads`` with the cyclic GC paused. A manifest at its insert-token window (a
    collector flushing every 2 s gets there in under six hours, and stays there) is ~10k small
    lists; made with the GC on, they set off collections, and those that reach the older
    generations walk every object of the process (a collector holds ~180k: pyarrow, numba,
    chDB's bindings): 7.9-8.2 ms a read against 1.2-1.3 ms paused, in one such process (how
    often it happens depends on the process's state). Nothing it makes is a cycle. A fleet-fed
    collector on a store at the window (bench/ingest.py --aged-store): the flusher 7.5-7.7 us a
    span with the GC on, 5.2-6.3 paused."""
    if not gc.isenabled():
        return orjson.loads(data)
    gc.disable()
    try:
        return orjson.loads(data)
    finally:
        gc.enable()


def _literal(v: Any) -> str:
    """A value in ClickHouse's text format for a composite query parameter."""
    if isinstance(v, str):
        return quote(v)
    if isinstance(v, (list, tuple)):
        inner = ",".join(_literal(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def _text_params(parameters: dict[str, Any] | None) -> dict[str, Any] | None:
    """chDB binds scalars itself, reading strings in ClickHouse's escaped text format (a
    backslash starts an escape there, so it is doubled); arrays and tuples go as text literals."""
    if not parameters:
        return parameters
    return {k: (_literal(v) if isinstance(v, (list, tuple)) else v.replace("\\", "\\\\") if isinstance(v, str) else v)
            for k, v in parameters.items()}


class EmbeddedStore(Store):
    """See the module docstring. ``path`` is a directory (created when ``create``)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        create: bool = True,
        row_group_size: int = 32_768,
        merge_factor: int = 8,
        max_level: int = 4,
        max_part_rows: int = 4_000_000,
        token_window: int = 10_000,
        garbage_grace_s: float = 60.0,
        orphan_age_s: float = 3600.0,
    ) -> None:
        root = Path(path).expanduser().absolute()
        if _BAD_PATH_CHARS.search(str(root)):
            raise StoreError(
                f"embedded store path {str(root)!r} contains one of * ? {{ }} [ ] ' \\ , "
                "which ClickHouse file globs cannot escape; choose another directory"
            )
        self._setup(root, row_group_size=row_group_size, merge_factor=merge_factor, max_level=max_level,
                    max_part_rows=max_part_rows, token_window=token_window, garbage_grace_s=garbage_grace_s,
                    orphan_age_s=orphan_age_s)
        if not self.manifest_path.exists():
            if self._part_files():
                self.rebuild_manifest()  # parts without a manifest: never start empty over them
            elif not create:
                raise StoreError(f"no ttftscope store at {self.root} (run `ttftscope collect` first?)")
            else:
                self._init_dir()
        self.ensure_schema()

    @classmethod
    def for_check(cls, path: str | os.PathLike) -> EmbeddedStore:
        """An instance for ``check``/``rebuild_manifest`` that opens even when the manifest
        is missing or corrupt (it neither creates nor rebuilds anything by itself)."""
        root = Path(path).expanduser().absolute()
        if not (root / "manifest.json").exists() and not (root / TRACES).is_dir():
            raise StoreError(f"no ttftscope store at {root}")
        self = cls.__new__(cls)
        self._setup(root)  # the constructor's defaults, without its manifest handling
        return self

    def _setup(self, root: Path, *, row_group_size: int = 32_768, merge_factor: int = 8, max_level: int = 4,
               max_part_rows: int = 4_000_000, token_window: int = 10_000, garbage_grace_s: float = 60.0,
               orphan_age_s: float = 3600.0) -> None:
        self.root, self.url = root, str(root)
        self.parts_dir = root / TRACES
        self.manifest_path = root / "manifest.json"
        self.row_group_size = row_group_size
        self.merge_factor = merge_factor
        self.max_level = max_level
        self.max_part_rows = max_part_rows
        self.token_window = token_window
        self.garbage_grace_s = garbage_grace_s
        self.orphan_age_s = orphan_age_s
        self._db = "store_" + uuid.uuid4().hex[:12]
        self._view_key: tuple | None = None

    # ------------------------------------------------------------------ manifest
    def _init_dir(self) -> None:
        try:
            self.parts_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the store directory {self.root}: {e}") from e
        empty = self.parts_dir / "_empty.parquet"
        if not empty.exists():
            pq.write_table(ARROW_SCHEMA.empty_table(), empty)
        with self._locked() as m:
            if m is None:
                self._write_manifest(self._new_manifest())

    @staticmethod
    def _new_manifest() -> dict:
        return {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "generation": 0,
            "parts": [],
            "tokens": [],  # insert tokens one by one: only as an older ttftscope wrote them (read, then moved)
            "token_runs": [],  # the insert-token window (schemas/store/tokens.py)
            "garbage": [],
        }

    def _read_manifest(self) -> dict | None:
        try:
            data = self.manifest_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            m = _json_loads(data)
        except orjson.JSONDecodeError as e:
            raise StoreError(f"corrupt manifest {self.manifest_path}: {e}; {REPAIR_HINT}") from e
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise StoreError(f"{self.root} is not a ttftscope embedded store ({self.manifest_path} "
                             f"is not one of its manifests); if it was, {REPAIR_HINT}")
        for key in ("parts", "tokens", "garbage"):
            if not isinstance(m.get(key), list):
                raise StoreError(f"corrupt manifest {self.manifest_path}: {key!r} is "
                                 f"{'missing' if key not in m else type(m[key]).__name__}; {REPAIR_HINT}")
        for p in m["parts"]:
            if not isinstance(p, dict) or not {"name", "rows", "min_ts", "max_ts", "day", "level"} <= p.keys():
                raise StoreError(f"corrupt manifest {self.manifest_path}: a part entry is malformed; {REPAIR_HINT}")
        runs = m.get("token_runs", [])
        if not tokens.valid(runs):
            raise StoreError(f"corrupt manifest {self.manifest_path}: 'token_runs' is malformed; {REPAIR_HINT}")
        if m["tokens"]:  # written one by one, by an older ttftscope: the same window as runs
            try:
                runs = tokens.from_pairs(m["tokens"], self.token_window, runs=runs)
            except (TypeError, ValueError) as e:
                raise StoreError(f"corrupt manifest {self.manifest_path}: an insert token is malformed ({e}); "
                                 f"{REPAIR_HINT}") from e
            m["tokens"] = []
        m["token_runs"] = runs
        m.setdefault("quarantined", [])
        return m

    def _write_manifest(self, m: dict) -> None:
        m["generation"] = int(m.get("generation", 0)) + 1
        _atomic_write(self.manifest_path, orjson.dumps(m))

    @contextmanager
    def _locked(self, read: bool = True):
        """Exclusive access to the manifest across processes (flock)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / "manifest.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield self._read_manifest() if read else None
        finally:
            os.close(fd)  # closing releases the lock

    def manifest(self) -> dict:
        m = self._read_manifest()
        if m is None:
            raise StoreError(f"no ttftscope store at {self.root}")
        return m

    # ------------------------------------------------------------------- schema
    def ensure_schema(self) -> int:
        m = self.manifest()
        v = int(m.get("schema_version", 0))
        if v > SCHEMA_VERSION:
            raise StoreError(
                f"store {self.root} has schema version {v}, newer than this ttftscope "
                f"({SCHEMA_VERSION}); upgrade ttftscope"
            )
        if v < SCHEMA_VERSION:  # no migrations yet beyond version 1
            with self._locked() as m2:
                m2["schema_version"] = SCHEMA_VERSION
                self._write_manifest(m2)
        return SCHEMA_VERSION

    # ------------------------------------------------------------------- writes
    @staticmethod
    def _part_meta(meta: dict) -> dict[bytes, bytes]:
        return {PART_META: orjson.dumps(meta)}

    def _write_part(self, table: pa.Table, level: int, meta: dict | None = None) -> dict:
        ts = table.column("Timestamp").cast(pa.int64()).to_numpy()
        if len(ts) > 1 and not (ts[1:] >= ts[:-1]).all():  # the compiled decode gives rows in order already
            table = table.sort_by([("Timestamp", "ascending")])
            ts = table.column("Timestamp").cast(pa.int64()).to_numpy()
        table = table.replace_schema_metadata(self._part_meta(meta or {}))
        lo, hi = int(ts[0]), int(ts[-1])
        day = lo // NS_PER_DAY
        name = f"{day}-L{level}-{uuid.uuid4().hex}"
        final = self.parts_dir / f"{name}.parquet"
        tmp = self.parts_dir / f".{name}.tmp"
        pq.write_table(
            table,
            tmp,
            row_group_size=self.row_group_size,
            bloom_filter_options={"TraceId": {"ndv": max(table.num_rows, 1), "fpp": 0.01}},
            **_PARQUET,
        )
        _publish(tmp, final)
        return {
            "name": name,
            "rows": table.num_rows,
            "min_ts": lo,
            "max_ts": hi,
            "day": day,
            "level": level,
            "bytes": final.stat().st_size,
            "created": time.time(),
        }

    @staticmethod
    def _split_by_day(table: pa.Table) -> list[pa.Table]:
        days = pc.divide(table.column("Timestamp").cast(pa.int64()), NS_PER_DAY)
        uniq = pc.unique(days).to_pylist()
        if len(uniq) <= 1:
            return [table]
        return [table.filter(pc.equal(days, d)) for d in sorted(uniq)]

    def insert_spans(self, table: pa.Table, token: str) -> bool:
        if table.schema != ARROW_SCHEMA:
            table = table.select(list(ARROW_SCHEMA.names)).cast(ARROW_SCHEMA)
        # the replay check is made once, under the lock that commits: a manifest at its token
        # window is 600 KB of JSON, and a replay (a spool segment written before a crash) is rare
        # enough to pay for a part written and dropped (bench/manifest_read.py)
        if not self.manifest_path.exists():
            raise StoreUnavailable(f"store {self.root} lost its manifest; reopen it to rebuild")
        if table.num_rows == 0:
            new_parts: list[dict] = []
        else:
            try:
                new_parts = [self._write_part(t, 0, {"token": token}) for t in self._split_by_day(table)]
            except OSError as e:
                raise StoreUnavailable(f"cannot write to {self.parts_dir}: {e}") from e
        with self._locked() as m:
            if m is None:
                raise StoreUnavailable(f"store {self.root} lost its manifest; reopen it to rebuild")
            if tokens.contains(m["token_runs"], token):
                for p in new_parts:
                    (self.parts_dir / f"{p['name']}.parquet").unlink(missing_ok=True)
                return False
            m["parts"].extend(new_parts)
            tokens.add(m["token_runs"], token, time.time(), self.token_window)
            self._write_manifest(m)
        return True

    # ---------------------------------------------------------------- upkeep
    def maintain(self) -> None:
        while self._merge_once():
            pass
        self._collect_garbage()

    def _merge_once(self) -> bool:
        m = self.manifest()
        groups: dict[tuple[int, int], list[dict]] = {}
        for p in m["parts"]:
            if p["level"] < self.max_level:
                groups.setdefault((p["day"], p["level"]), []).append(p)
        for (_day, level), parts in sorted(groups.items()):
            if len(parts) < self.merge_factor:
                continue
            parts = sorted(parts, key=lambda p: p["min_ts"])[: self.merge_factor]
            if sum(p["rows"] for p in parts) > self.max_part_rows:
                continue
            try:
                merged = self._merge_parts(parts, level + 1)
            except parquet_concat.Damaged as e:
                self.quarantine([e.path.stem], f"damaged, found in a merge: {e}")
                return True
            except (OSError, pa.ArrowException) as e:
                bad = [p["name"] for p in parts if self._part_problem(p["name"]) is not None]
                if not bad:
                    raise
                self.quarantine(bad, f"unreadable during a merge: {e}")
                return True
            names = {p["name"] for p in parts}
            with self._locked() as m2:
                live = {p["name"] for p in m2["parts"]}
                if not names <= live:  # someone else merged or dropped them meanwhile
                    (self.parts_dir / f"{merged['name']}.parquet").unlink(missing_ok=True)
                    return False
                m2["parts"] = [p for p in m2["parts"] if p["name"] not in names] + [merged]
                m2["garbage"].extend([n, time.time()] for n in names)
                self._write_manifest(m2)
            return True
        return False

    def _merged_meta(self, parts: list[dict], paths: list[Path]) -> dict:
        """A merged part names the parts it replaces and keeps their insert tokens."""
        kept: list[str] = []
        for path in paths:
            kv = pq.ParquetFile(path).schema_arrow.metadata or {}
            meta = _json_loads(kv[PART_META]) if PART_META in kv else {}
            kept += ([meta["token"]] if meta.get("token") else []) + meta.get("tokens", [])
        return {"merged_from": [p["name"] for p in parts], "tokens": kept[-self.token_window:]}

    def _merge_parts(self, parts: list[dict], level: int) -> dict:
        """Merge parts into one, in order of their first span: their bytes copied when each is
        big enough to keep its row groups (``COPY_MIN_ROW_GROUP_SHARE``), else streamed row group
        by row group (memory: one row group). Small parts whose time ranges overlap (a span that
        started before the last flush ended; a spool replayed after a restart) are read and
        sorted together while that is small (``SORTED_MERGE_ROWS``): sorting every overlapping
        merge read up to ``max_part_rows`` rows at once — gigabytes at a sustained 100k spans/s
        (bench/ingest, ten minutes). Copied or streamed, each row group stays sorted within
        itself, which is what a time-window read prunes by."""
        paths = [self.parts_dir / f"{p['name']}.parquet" for p in parts]
        rows = sum(p["rows"] for p in parts)
        disjoint = all(b["min_ts"] >= a["max_ts"] for a, b in zip(parts, parts[1:], strict=False))
        copyable = all(p["rows"] >= self.row_group_size // COPY_MIN_ROW_GROUP_SHARE for p in parts)
        if not disjoint and not copyable and rows <= SORTED_MERGE_ROWS:
            return self._write_part(pa.concat_tables([pq.read_table(p).replace_schema_metadata(None) for p in paths]),
                                    level, self._merged_meta(parts, paths))
        lo, hi = min(p["min_ts"] for p in parts), max(p["max_ts"] for p in parts)
        name = f"{lo // NS_PER_DAY}-L{level}-{uuid.uuid4().hex}"
        final, tmp = self.parts_dir / f"{name}.parquet", self.parts_dir / f".{name}.tmp"
        schema = ARROW_SCHEMA.with_metadata(self._part_meta(self._merged_meta(parts, paths)))
        meta = {"name": name, "rows": rows, "min_ts": lo, "max_ts": hi, "day": lo // NS_PER_DAY, "level": level}
        if copyable:  # row groups worth keeping as they are
            try:
                parquet_concat.concat(paths, tmp, schema)
                _publish(tmp, final)
                return {**meta, "bytes": final.stat().st_size, "created": time.time()}
            except parquet_concat.NotCopyable as e:  # e.g. parts written before page CRCs
                log.debug("merging %s by reading: %s", name, e)
            finally:
                tmp.unlink(missing_ok=True)
        with pq.ParquetWriter(tmp, schema, bloom_filter_options={"TraceId": {"ndv": max(rows, 1), "fpp": 0.01}},
                              **_PARQUET) as w:
            for path in paths:
                f = pq.ParquetFile(path)
                for batch in f.iter_batches(batch_size=self.row_group_size):
                    w.write_batch(batch.replace_schema_metadata(schema.metadata), row_group_size=self.row_group_size)
        _publish(tmp, final)
        return {**meta, "bytes": final.stat().st_size, "created": time.time()}

    def apply_retention(self, days: float) -> int:
        cutoff = time.time_ns() - int(days * NS_PER_DAY)
        with self._locked() as m:
            old = [p for p in m["parts"] if p["max_ts"] < cutoff]
            if not old:
                return 0
            names = {p["name"] for p in old}
            m["parts"] = [p for p in m["parts"] if p["name"] not in names]
            m["garbage"].extend([n, time.time()] for n in names)
            self._write_manifest(m)
        return sum(p["rows"] for p in old)

    def _part_files(self) -> list[Path]:
        if not self.parts_dir.is_dir():
            return []
        return sorted(f for f in self.parts_dir.glob("*.parquet") if f.name != "_empty.parquet")

    def _collect_garbage(self) -> None:
        now = time.time()
        with self._locked() as m:
            if m is None:  # never judge files orphans without a manifest
                return
            due = [n for n, t in m["garbage"] if now - t >= self.garbage_grace_s]
            if due:
                for n in due:
                    (self.parts_dir / f"{n}.parquet").unlink(missing_ok=True)
                m["garbage"] = [[n, t] for n, t in m["garbage"] if n not in set(due)]
                self._write_manifest(m)
            known = {p["name"] for p in m["parts"]} | {n for n, _ in m["garbage"]}
        for f in self.parts_dir.iterdir():
            stem = f.name.removesuffix(".parquet")
            if f.name == "_empty.parquet" or stem in known:
                continue
            try:
                if now - f.stat().st_mtime > self.orphan_age_s:
                    f.unlink(missing_ok=True)  # left by a writer that died mid-insert
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------ integrity
    def _part_problem(self, name: str, full: bool = False) -> str | None:
        """Why a part cannot be read (missing, truncated, not Parquet), or None.
        The footer is read always; ``full`` reads every row group too."""
        path = self.parts_dir / f"{name}.parquet"
        if not path.exists():
            return "missing"
        try:
            f = pq.ParquetFile(path)
            if full:
                for i in range(f.num_row_groups):
                    f.read_row_group(i)
        except (OSError, pa.ArrowException) as e:
            return f"unreadable: {e}"[:300]
        return None

    def quarantine(self, names: list[str], reason: str) -> int:
        """Take parts out of the live set: moved to ``quarantine/`` (never deleted), listed
        in the manifest with the reason, logged. Returns how many were taken out."""
        qdir = self.root / "quarantine"
        qdir.mkdir(exist_ok=True)
        with self._locked() as m:
            if m is None:
                return 0
            live = {p["name"]: p for p in m["parts"]}
            out = [n for n in names if n in live]
            if not out:
                return 0
            for n in out:
                src = self.parts_dir / f"{n}.parquet"
                if src.exists():
                    os.replace(src, qdir / src.name)
                m["quarantined"].append({"name": n, "rows": live[n]["rows"], "reason": reason, "at": time.time()})
            m["parts"] = [p for p in m["parts"] if p["name"] not in set(out)]
            self._write_manifest(m)
        log.error("quarantined %d part(s) of %s (%s): %s; the rest of the store stays readable",
                  len(out), self.root, reason, ", ".join(out))
        return len(out)

    def _quarantine_unreadable(self) -> int:
        """After a failed read: find the live parts that cannot be read and take them out."""
        m = self.manifest()
        bad: dict[str, list[str]] = {}
        for p in m["parts"]:
            why = self._part_problem(p["name"])
            if why is not None:
                bad.setdefault(why.split(":")[0], []).append(p["name"])
        return sum(self.quarantine(names, why) for why, names in bad.items())

    def _describe_part(self, path: Path) -> tuple[dict, dict] | None:
        """(manifest entry, part metadata) from a part file alone; None if unreadable."""
        try:
            f = pq.ParquetFile(path)
            md = f.metadata
            kv = md.metadata or {}
            meta = _json_loads(kv[PART_META]) if PART_META in kv else {}
            col = f.schema_arrow.get_field_index("Timestamp")
            lo = hi = None
            for i in range(md.num_row_groups):
                st = md.row_group(i).column(col).statistics
                if st is None or not st.has_min_max:
                    ts = f.read_row_group(i, columns=["Timestamp"]).column(0).cast(pa.int64())
                    rlo, rhi = pc.min(ts).as_py(), pc.max(ts).as_py()
                else:
                    rlo, rhi = (int(pa.scalar(st.min, pa.timestamp("ns")).cast(pa.int64()).as_py())
                                if not isinstance(st.min, int) else st.min,
                                int(pa.scalar(st.max, pa.timestamp("ns")).cast(pa.int64()).as_py())
                                if not isinstance(st.max, int) else st.max)
                if rlo is not None:
                    lo = rlo if lo is None else min(lo, rlo)
                    hi = rhi if hi is None else max(hi, rhi)
        except (OSError, pa.ArrowException, orjson.JSONDecodeError, KeyError, ValueError):
            return None
        name = path.name.removesuffix(".parquet")
        head = name.split("-")
        level = int(head[1][1:]) if len(head) > 2 and head[1].startswith("L") and head[1][1:].isdigit() else 0
        lo = lo if lo is not None else 0
        entry = {"name": name, "rows": md.num_rows, "min_ts": lo, "max_ts": hi if hi is not None else lo,
                 "day": lo // NS_PER_DAY, "level": level, "bytes": path.stat().st_size,
                 "created": path.stat().st_mtime}
        return entry, meta

    def rebuild_manifest(self) -> dict:
        """A manifest from the part files alone (it was lost or is corrupt).

        Each part carries its rows and time range (Parquet statistics), its insert token
        (level 0) and the parts it replaced (merges). Parts that a merged part replaced are
        left out (their rows are in it), unreadable ones are quarantined, and the tokens are
        restored so that a spool replaying a segment the store already holds is still
        recognised. Nothing is deleted."""
        with self._locked(read=False):
            described, unreadable = [], []
            for path in self._part_files():
                d = self._describe_part(path)
                (described.append(d) if d else unreadable.append(path))
            replaced = {n for _, meta in described for n in meta.get("merged_from", [])}
            parts = [e for e, _ in described if e["name"] not in replaced]
            pairs = sorted(([t, e["created"]] for e, meta in described
                            for t in ([meta["token"]] if meta.get("token") else []) + meta.get("tokens", [])),
                           key=lambda t: t[1])
            pairs = list({t: c for t, c in pairs}.items())
            old = None
            if self.manifest_path.exists():
                old = self.manifest_path.with_name(f"manifest.json.corrupt-{int(time.time())}")
                os.replace(self.manifest_path, old)
            m = self._new_manifest()
            m["parts"] = parts
            m["token_runs"] = tokens.from_pairs(pairs, self.token_window)
            m["garbage"] = [[n, time.time()] for n in sorted(replaced)
                            if (self.parts_dir / f"{n}.parquet").exists()]
            m["quarantined"] = []
            qdir = self.root / "quarantine"
            for path in unreadable:
                qdir.mkdir(exist_ok=True)
                os.replace(path, qdir / path.name)
                m["quarantined"].append({"name": path.name.removesuffix(".parquet"), "rows": None,
                                         "reason": "unreadable when the manifest was rebuilt", "at": time.time()})
            self.parts_dir.mkdir(parents=True, exist_ok=True)
            empty = self.parts_dir / "_empty.parquet"
            if not empty.exists():
                pq.write_table(ARROW_SCHEMA.empty_table(), empty)
            self._write_manifest(m)
        log.warning("store %s: manifest %s; rebuilt it from %d part(s) holding %d rows%s%s",
                    self.root, f"was corrupt (kept as {old.name})" if old else "was missing", len(parts),
                    sum(p["rows"] for p in parts),
                    f", {len(replaced)} merged-away part(s) left out" if replaced else "",
                    f", {len(unreadable)} unreadable part(s) quarantined" if unreadable else "")
        return m

    def check(self, repair: bool = False) -> dict:
        """Verify the store: the manifest, every live part read in full, row counts, files no
        manifest lists. With ``repair``: rebuild a corrupt manifest, quarantine bad parts."""
        report: dict = {"store": str(self.root), "manifest": "ok", "parts": 0, "rows": 0, "problems": [],
                        "repaired": [], "orphans": [], "quarantined_before": 0}
        try:
            m = self.manifest()
        except StoreError as e:  # missing or corrupt
            report["manifest"] = str(e)
            report["problems"].append(f"manifest: {e}")
            if not repair:
                return report
            m = self.rebuild_manifest()
            report["repaired"].append("manifest rebuilt from the parts")
        report["quarantined_before"] = len(m.get("quarantined", []))
        bad: dict[str, list[str]] = {}
        for p in m["parts"]:
            why = self._part_problem(p["name"], full=True)
            if why is None:
                n = pq.ParquetFile(self.parts_dir / f"{p['name']}.parquet").metadata.num_rows
                if n != p["rows"]:
                    why = f"holds {n} rows, the manifest says {p['rows']}"
            if why is not None:
                report["problems"].append(f"part {p['name']}: {why}")
                bad.setdefault(why.split(":")[0], []).append(p["name"])
            else:
                report["parts"] += 1
                report["rows"] += p["rows"]
        known = {p["name"] for p in m["parts"]} | {n for n, _ in m["garbage"]}
        report["orphans"] = [f.name for f in self._part_files() if f.name.removesuffix(".parquet") not in known]
        if repair:
            for why, names in bad.items():
                if self.quarantine(names, why):
                    report["repaired"].append(f"quarantined {len(names)} part(s): {why}")
        return report

    # ------------------------------------------------------------------- reads
    def _refresh_views(self, force: bool = False) -> None:
        try:
            st = self.manifest_path.stat()
        except FileNotFoundError as e:
            raise StoreUnavailable(f"store {self.root} has no manifest") from e
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key == self._view_key and not force:
            return
        m = self.manifest()
        names = [p["name"] for p in m["parts"]]
        gone = [n for n in names if not (self.parts_dir / f"{n}.parquet").exists()]
        if gone and self.quarantine(gone, "missing"):  # a file glob would skip them silently
            return self._refresh_views(force=True)
        if names:
            glob = "{" + ",".join(names) + "}" if len(names) > 1 else names[0]
            src = f"{self.parts_dir}/{glob}.parquet"
        else:
            src = f"{self.parts_dir}/_empty.parquet"
        s = _session()
        db = self._db
        s.query(f"CREATE DATABASE IF NOT EXISTS {db}")
        s.query(
            f"CREATE OR REPLACE VIEW {db}.{TRACES} AS SELECT *, "
            "arrayMap((k, v) -> concat(k, '=', v), mapKeys(ResourceAttributes), mapValues(ResourceAttributes)) AS ResourceAttributeItems, "
            "arrayMap((k, v) -> concat(k, '=', v), mapKeys(SpanAttributes), mapValues(SpanAttributes)) AS SpanAttributeItems "
            f"FROM file('{src}', Parquet, '{clickhouse_structure()}')"
        )
        s.query(
            f"CREATE OR REPLACE VIEW {db}.{TRACE_ID_TS} AS SELECT TraceId, "
            "toDateTime(min(Timestamp)) AS Start, toDateTime(max(Timestamp)) AS End "
            f"FROM {db}.{TRACES} WHERE TraceId != '' GROUP BY TraceId"
        )
        self._view_key = key

    def _run(self, sql: str, fmt: str, parameters: dict[str, Any] | None):
        from chdb import ChdbError

        with _ENGINE_LOCK:
            for attempt in (0, 1, 2):
                self._refresh_views(force=attempt > 0)
                s = _session()
                try:
                    s.query(f"USE {self._db}")
                    return s.query(sql, fmt, params=_text_params(parameters) or None)
                except (ChdbError, RuntimeError) as e:
                    msg = str(e)
                    if attempt == 0 and ("FILE_DOESNT_EXIST" in msg or "CANNOT_OPEN_FILE" in msg):
                        continue  # a merge replaced parts under us: reload the snapshot
                    if attempt < 2 and self._reads_parts(msg) and self._quarantine_unreadable():
                        continue  # a part that cannot be read is set aside; the rest answers
                    raise StoreError(msg.strip()) from None
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _reads_parts(msg: str) -> bool:
        """An error reading the part files (not a mistake in the SQL)."""
        return any(k in msg for k in ("Parquet", "parquet", "FILE_DOESNT_EXIST", "CANNOT_OPEN_FILE",
                                      "CANNOT_READ", "INCORRECT_DATA", "ATTEMPT_TO_READ_AFTER_EOF",
                                      "UNEXPECTED_END_OF_FILE", "CANNOT_PARSE"))

    def query_arrow(self, sql: str, parameters: dict[str, Any] | None = None) -> pa.Table:
        return self._run(sql, "ArrowTable", parameters)

    def query_text(self, sql: str, fmt: str = "PrettyCompact", parameters: dict[str, Any] | None = None) -> bytes:
        res = self._run(sql, fmt, parameters)
        return res.bytes() if hasattr(res, "bytes") else bytes(res)

    def ping(self) -> None:
        if not self.manifest_path.exists():
            raise StoreUnavailable(f"store {self.root} is gone")

    def stats(self) -> dict:
        m = self.manifest()
        return {
            "parts": len(m["parts"]),
            "rows": sum(p["rows"] for p in m["parts"]),
            "bytes": sum(p["bytes"] for p in m["parts"]),
            "generation": m["generation"],
            "quarantined": len(m["quarantined"]),
        }

    def close(self) -> None:
        with _ENGINE_LOCK:
            if engine.started() is not None and self._view_key is not None:
                try:
                    engine.started().query(f"DROP DATABASE IF EXISTS {self._db}")
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass
            self._view_key = None
