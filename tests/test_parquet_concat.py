"""Merges that copy row groups as bytes (schemas/store/parquet_concat.py): the merged part holds
exactly its parts' rows and bytes, its footer's offsets point where the bytes now lie (Arrow,
with every page CRC checked, and chDB read it), a part damaged in the middle is named and
quarantined instead of carried into the merge, and parts the copy cannot take (no page CRCs,
small row groups) are merged by reading them, as before."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_otlp_sql import CASES
from ttftscope.collector.otlp import decode
from ttftscope.schemas.store import embedded, open_store, parquet_concat

from support.otlp import plugin_like_request

RG = 64  # rows per row group: small, so parts of a few hundred spans have several


T0 = 1_764_000_000 * 10**9


def _table(seed: int, n: int = 150) -> pa.Table:
    """Spans of one request batch, a second after the previous seed's (parts disjoint in time)."""
    return decode(plugin_like_request(n, seed=seed, t0=T0 + seed * 10**9), "protobuf")[0]


def _parts(st) -> list[dict]:
    return sorted(st.manifest()["parts"], key=lambda p: p["min_ts"])


def _path(st, part: dict) -> Path:
    return st.parts_dir / f"{part['name']}.parquet"


def _pages(st, part: dict) -> bytes:
    """A part's bytes between the magic and the footer: its row groups' pages."""
    path = _path(st, part)
    data = path.read_bytes()
    return data[4:parquet_concat._footer(path, data)[1]]


def _rows(t: pa.Table) -> list[tuple]:
    t = t.replace_schema_metadata(None)
    return sorted(zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True))


@pytest.mark.parametrize("case", ["plugin-like", "events and links", "value types"])
def test_a_footer_is_written_back_byte_for_byte(tmp_path, case):
    """The Thrift codec keeps every field of real parts, also those it does not know."""
    t = _table(1) if case == "plugin-like" else decode(CASES[case], "protobuf")[0]
    st = open_store(str(tmp_path / "s"), row_group_size=RG)
    st.insert_spans(t, "a")
    path = _path(st, _parts(st)[0])
    data = path.read_bytes()
    fmd, start = parquet_concat._footer(path, data)
    out = bytearray()
    parquet_concat.write_struct(out, fmd)
    assert bytes(out) == data[start:-8]
    st.close()


def test_big_parts_are_merged_by_copying_their_bytes(tmp_path):
    st = open_store(str(tmp_path / "s"), row_group_size=RG, merge_factor=4)
    tables = [_table(seed) for seed in range(4)]
    for i, t in enumerate(tables):
        st.insert_spans(t, f"tok-{i}")
    parts = _parts(st)
    groups = sum(pq.ParquetFile(_path(st, p)).metadata.num_row_groups for p in parts)
    bodies = b"".join(_pages(st, p) for p in parts)
    st.maintain()
    (merged,) = st.manifest()["parts"]
    assert merged["level"] == 1 and merged["rows"] == sum(t.num_rows for t in tables)
    assert _pages(st, merged).startswith(bodies), "the parts' bytes, in time order, unchanged"
    f = pq.ParquetFile(_path(st, merged), page_checksum_verification=True)
    assert f.metadata.num_row_groups == groups
    got = f.read()
    assert _rows(got) == _rows(pa.concat_tables(tables))
    meta = embedded.orjson.loads(f.schema_arrow.metadata[embedded.PART_META])
    assert meta["tokens"] == [f"tok-{i}" for i in range(4)] and meta["merged_from"] == [p["name"] for p in parts]
    # chDB reads it through the store: every span, and a trace found by its id
    assert st.query("SELECT count() FROM otel_traces").item() == got.num_rows
    tid = got.column("TraceId")[got.num_rows - 7].as_py()
    want = got.column("TraceId").to_pylist().count(tid)
    assert st.query("SELECT count() FROM otel_traces WHERE TraceId = {t:String}", {"t": tid}).item() == want
    # the store rebuilt from its parts alone knows the merged part's tokens
    assert st.rebuild_manifest()["parts"][0]["rows"] == got.num_rows
    assert not st.insert_spans(tables[0], "tok-2"), "a token the merged part holds is still a duplicate"
    st.close()


def test_overlapping_parts_of_a_fleets_flushes_are_copied_and_tiny_ones_read_and_sorted(tmp_path):
    """A fleet's flushes are small parts that overlap in time (spans that started before the last
    flush ended). They were read, sorted and written again in their first merge, as much CPU as
    the flush itself; a part holding an eighth of a row group is now copied as bytes, its row
    groups kept. Parts smaller than that are still read and sorted into one ordered part."""
    def overlapping(n: int, k: int) -> list[pa.Table]:  # spans 1 us apart, each part 0.25 us later
        return [decode(plugin_like_request(n, seed=s, t0=T0 + s * 250), "protobuf")[0] for s in range(k)]

    st = open_store(str(tmp_path / "fleet"), row_group_size=RG, merge_factor=4)
    tables = overlapping(RG // 8, 4)
    for i, t in enumerate(tables):
        st.insert_spans(t, f"tok-{i}")
    parts = _parts(st)
    assert all(b["min_ts"] < a["max_ts"] for a, b in zip(parts, parts[1:], strict=False)), "they overlap"
    assert sum(p["rows"] for p in parts) <= embedded.SORTED_MERGE_ROWS
    bodies = b"".join(_pages(st, p) for p in parts)
    st.maintain()
    (merged,) = st.manifest()["parts"]
    assert _pages(st, merged).startswith(bodies), "copied as bytes, not read and written again"
    f = pq.ParquetFile(_path(st, merged), page_checksum_verification=True)
    assert _rows(f.read()) == _rows(pa.concat_tables(tables))
    assert st.query("SELECT count() FROM otel_traces").item() == sum(t.num_rows for t in tables)
    st.close()

    st = open_store(str(tmp_path / "tiny"), row_group_size=RG, merge_factor=4)
    tiny = overlapping(RG // 8 - 1, 4)
    for i, t in enumerate(tiny):
        st.insert_spans(t, f"tok-{i}")
    st.maintain()
    (merged,) = st.manifest()["parts"]
    got = pq.read_table(_path(st, merged))
    assert _rows(got) == _rows(pa.concat_tables(tiny))
    ts = got.column("Timestamp").cast("int64").to_pylist()
    assert ts == sorted(ts), "tiny overlapping parts read and sorted as a whole"
    st.close()


def test_a_part_damaged_in_the_middle_is_quarantined_not_merged(tmp_path):
    st = open_store(str(tmp_path / "s"), row_group_size=RG, merge_factor=4, garbage_grace_s=0.0)
    tables = [_table(seed) for seed in range(5)]
    for i, t in enumerate(tables):
        st.insert_spans(t, f"tok-{i}")
    victim = _parts(st)[1]
    path = _path(st, victim)
    data = bytearray(path.read_bytes())
    at = len(data) // 3  # inside a column chunk, far from the footer
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    assert st._part_problem(victim["name"]) is None, "the footer is fine: only the pages tell"
    st.maintain()
    live = st.manifest()["parts"]
    assert victim["name"] not in {p["name"] for p in live}
    assert (st.root / "quarantine" / path.name).exists(), "set aside, never deleted"
    want = sum(t.num_rows for t in tables) - victim["rows"]
    assert st.query("SELECT count() FROM otel_traces").item() == want
    assert [p["level"] for p in live] == [1], "the four good parts merged"
    st.close()


def test_parts_without_page_crcs_or_with_small_row_groups_are_merged_by_reading(tmp_path, monkeypatch):
    st = open_store(str(tmp_path / "s"), row_group_size=RG, merge_factor=4)
    tables = [_table(seed) for seed in range(2)] + [_table(seed, n=5) for seed in (2, 3)]  # 5 < RG // 8
    monkeypatch.setitem(embedded._PARQUET, "write_page_checksum", False)  # as parts written before CRCs
    st.insert_spans(tables[0], "old")
    monkeypatch.setitem(embedded._PARQUET, "write_page_checksum", True)
    for i, t in enumerate(tables[1:]):
        st.insert_spans(t, f"tok-{i}")
    with pytest.raises(parquet_concat.NotCopyable):
        parquet_concat.concat([_path(st, p) for p in _parts(st)], tmp_path / "x.parquet", embedded.ARROW_SCHEMA)
    st.maintain()
    (merged,) = st.manifest()["parts"]
    f = pq.ParquetFile(_path(st, merged), page_checksum_verification=True)
    got = f.read()
    assert _rows(got) == _rows(pa.concat_tables(tables))
    path = _path(st, merged)
    data = path.read_bytes()
    fmd, end = parquet_concat._footer(path, data)
    parquet_concat._check_pages(path, data, fmd, end)  # raises NotCopyable for a page without a CRC
    # read and written again: the old part's pages now carry CRCs, so the next merge can copy it
    st.close()
