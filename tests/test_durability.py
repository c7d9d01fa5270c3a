"""Nothing acknowledged is lost: kill -9, store outages, concurrent readers, back-pressure."""

from __future__ import annotations

import subprocess
import time

import requests
from conftest import PY, ROOT, ClickHouseFixture, free_port, ttftscope_sql

from support.otlp import PB, Sender
from support.otlp import numbered_batch as _batch
from support.otlp import numbered_ids as _ids


def _stored(store: str) -> list[str]:
    return [r["SpanId"] for r in ttftscope_sql(store, "SELECT SpanId FROM otel_traces WHERE ServiceName = 'dur'")]


def test_kill9_mid_ingest_then_restart_loses_nothing_duplicates_nothing(collector_factory, tmp_path):
    col = collector_factory().start()
    senders = [Sender(col.url, start_at=k * 10_000) for k in range(3)]
    for s in senders:
        s.start()
    time.sleep(2.0)
    col.kill9()  # mid-ingest: requests are in flight, segments half written
    for s in senders:
        s.stop.set()
        s.join(15)
    acked = set().union(*(s.acked for s in senders))
    assert len(acked) > 500, "the test must really have been ingesting"
    col.start()  # same spool: replays what the dead one acknowledged
    assert col.terminate() == 0, col.output()
    stored = _stored(col.store)
    assert len(stored) == len(set(stored)), "no duplicate span after replay"
    missing = acked - set(stored)
    assert not missing, f"{len(missing)} acknowledged spans lost"


def test_replayed_segment_already_in_store_is_not_duplicated(tmp_path):
    """Crash after the store write but before the spool segment was deleted."""
    from ttftscope.collector.otlp import decode
    from ttftscope.collector.pipeline import Pipeline, to_ipc
    from ttftscope.collector.spool import Spool
    from ttftscope.schemas.store import open_store

    store_dir = str(tmp_path / "store")
    table, _ = decode(_batch(1, 20), "protobuf")
    spool = Spool(tmp_path / "spool")
    spool.append(to_ipc(table), table.num_rows)
    spool.seal()
    (seg,) = spool.sealed()
    store = open_store(store_dir)
    store.insert_spans(table, spool.token(seg))  # the write that happened before the "crash"
    spool.close()
    spool = Spool(tmp_path / "spool")  # restart
    p = Pipeline(lambda: open_store(store_dir), spool)
    assert p.flush_once() == 20
    n = store.query("SELECT count() AS n, uniqExact(SpanId) AS u FROM otel_traces").row(0)
    assert n == (20, 20)


def test_torn_record_is_dropped_and_earlier_ones_kept(tmp_path):
    from ttftscope.collector.spool import Spool

    sp = Spool(tmp_path / "spool", fsync=False)
    sp.append(b"a" * 100, 1)
    sp.append(b"b" * 100, 2)
    path = next((tmp_path / "spool").glob("*.open"))
    sp._lock_fd and __import__("os").close(sp._lock_fd)  # simulate death: no seal
    with open(path, "ab") as f:
        f.write(b"TTS1\x64\x00\x00\x00")  # a header cut short by the crash
    sp2 = Spool(tmp_path / "spool")
    (seg,) = sp2.sealed()
    assert seg.rows == 3
    assert sp2.read(seg) == [b"a" * 100, b"b" * 100]
    assert sp2.torn_records_dropped == 1


def test_small_records_are_written_into_zeros_ahead_and_sealing_cuts_them_off(tmp_path):
    """The open segment is zeroed ahead, so a small record's sync does not change the file's
    size (what made each fdatasync journal); the sealed segment holds exactly its records."""
    from ttftscope.collector.spool import Spool

    sp = Spool(tmp_path / "spool", zero_ahead_bytes=64 << 10)
    sizes = []
    for i in range(20):
        sp.append(bytes([i]) * 1000, 1)
        sizes.append(next((tmp_path / "spool").glob("*.open")).stat().st_size)
    assert sizes[0] > 1016, "zeros were laid ahead of the first record"
    assert len(set(sizes)) == 1, f"small records grew the file: {sizes}"
    sp.seal()
    (seg,) = sp.sealed()
    assert seg.path.stat().st_size == seg.bytes == 20 * (16 + 1000)
    assert sp.read(seg) == [bytes([i]) * 1000 for i in range(20)]
    big = b"x" * (200 << 10)  # larger than the stretch: appended, no zeros after it
    sp.append(big, 5)
    sp.seal()
    assert [s.path.stat().st_size for s in sp.sealed()] == [seg.bytes, 16 + len(big)]


def test_crash_before_seal_keeps_every_record_and_counts_no_torn_one_in_the_zeros(tmp_path):
    import os

    from ttftscope.collector.spool import Spool

    sp = Spool(tmp_path / "spool", zero_ahead_bytes=64 << 10)
    for i in range(5):
        sp.append(bytes([65 + i]) * 300, 2)
    path = next((tmp_path / "spool").glob("*.open"))
    os.close(sp._lock_fd)  # simulate death: no seal, the zeros stay behind the records
    assert path.stat().st_size > 5 * 316
    sp2 = Spool(tmp_path / "spool")
    (seg,) = sp2.sealed()
    assert (seg.rows, sp2.torn_records_dropped) == (10, 0)
    assert sp2.read(seg) == [bytes([65 + i]) * 300 for i in range(5)]
    assert seg.path.stat().st_size == 5 * 316, "the zeros were cut off on recovery"
    sp2.append(b"next", 1)  # and the spool goes on
    os.close(sp2._lock_fd)
    # a record torn inside the zeroed stretch (its header written, its payload not)
    path = next((tmp_path / "spool").glob("*.open"))
    with open(path, "r+b") as f:
        f.seek(16 + 4)
        f.write(b"TTS1\x64\x00\x00\x00")
    sp3 = Spool(tmp_path / "spool")
    assert sp3.torn_records_dropped == 1
    assert [Spool.read(s) for s in sp3.sealed()] == [[bytes([65 + i]) * 300 for i in range(5)], [b"next"]]


def test_the_spools_size_is_what_its_segments_hold_through_seals_removals_and_recovery(tmp_path):
    """The spool's size (its limit is checked on every request) is kept as segments come and go,
    not summed per request: it must stay exactly what the segment files hold."""
    import os
    import random

    from ttftscope.collector.spool import Spool, _scan

    def on_disk(_sp: Spool) -> tuple[int, int]:
        """(rows, bytes) of the records in the spool's files, read back (an open segment's zeros
        ahead are not records)."""
        got = [_scan(p)[:2] for p in (tmp_path / "spool").iterdir() if p.suffix in (".open", ".sealed")]
        return sum(r for _, r in got), sum(v for v, _ in got)

    rng = random.Random(3)
    sp = Spool(tmp_path / "spool", zero_ahead_bytes=16 << 10)
    for i in range(300):
        op = rng.random()
        if op < 0.7:
            sp.append(os.urandom(rng.randint(1, 5000)), rng.randint(1, 50))
        elif op < 0.9:
            sp.seal()
        elif sp.sealed():
            sp.remove(rng.choice(sp.sealed()))
        assert (sp.pending_rows, sp.pending_bytes) == on_disk(sp), i
    assert len(sp.sealed()) > 5  # the walk left several segments behind
    os.close(sp._lock_fd)  # gone without sealing: recovery seals the open one
    sp2 = Spool(tmp_path / "spool")
    assert (sp2.pending_rows, sp2.pending_bytes) == on_disk(sp2) and sp2.pending_rows > 0
    for seg in sp2.sealed():
        sp2.remove(seg)
    assert (sp2.pending_rows, sp2.pending_bytes) == (0, 0)


def test_store_outage_spools_then_delivers_on_recovery(collector_factory, tmp_path):
    ch = ClickHouseFixture(tmp_path / "ch", port=free_port()).start()
    url = ch.url("ttft")
    col = collector_factory(store=url).start()
    ok = requests.post(col.url + "/v1/traces", data=_batch(1, 30), headers=PB, timeout=10)
    assert ok.status_code == 200
    time.sleep(1.0)
    ch.stop()  # outage
    acked = _ids(1, 30)
    for b in range(2, 12):
        r = requests.post(col.url + "/v1/traces", data=_batch(b, 30), headers=PB, timeout=10)
        assert r.status_code == 200, "acknowledged while the store is down: spooled on disk"
        acked |= _ids(b, 30)
    deadline = time.time() + 20
    while col.metric("ttftscope_collector_store_up") != 0 and time.time() < deadline:
        time.sleep(0.2)
    assert col.metric("ttftscope_collector_store_up") == 0
    assert col.metric("ttftscope_collector_queue_spans") > 0
    assert not requests.get(col.url + "/healthz", timeout=5).json()["store_healthy"]
    ch = ClickHouseFixture(tmp_path / "ch", port=ch.port).start()  # recovery, same data
    deadline = time.time() + 60
    while col.metric("ttftscope_collector_queue_spans") > 0 and time.time() < deadline:
        time.sleep(0.3)
    assert col.metric("ttftscope_collector_queue_spans") == 0
    assert col.terminate() == 0
    stored = _stored(url)
    ch.stop()
    assert set(stored) == acked and len(stored) == len(acked)


def test_full_spool_refuses_with_retry_after_and_keeps_serving_health(collector_factory, tmp_path):
    """Store unreachable + tiny spool: 503 with Retry-After, bounded disk, nothing acked lost."""
    dead = f"clickhouse://default:@127.0.0.1:{free_port()}/ttft"
    from google.rpc import status_pb2

    col = collector_factory(store=dead, extra=["--max-spool", "64K"]).start()
    deadline = time.time() + 20
    while col.metric("ttftscope_collector_store_up") != 0 and time.time() < deadline:
        time.sleep(0.1)
    assert col.metric("ttftscope_collector_store_up") == 0, "the outage is noticed before any write"
    statuses = []
    for b in range(1000):  # until the spool is full (a few hundred raw protobuf bodies)
        if statuses[-5:] == [503] * 5:
            break
        r = requests.post(col.url + "/v1/traces", data=_batch(b, 20), headers=PB, timeout=10)
        statuses.append(r.status_code)
        if r.status_code != 200:
            assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
            st = status_pb2.Status()
            st.ParseFromString(r.content)
            assert "store unavailable" in st.message
    assert statuses[0] == 200 and statuses[-1] == 503
    assert col.metric("ttftscope_collector_spans_dropped_total") > 0
    assert col.metric("ttftscope_collector_spool_bytes") < 64 * 1024 + 16 * 1024
    assert requests.get(col.url + "/healthz", timeout=5).status_code == 200
    rc = col.terminate()
    assert rc == 3 and "stay spooled" in col.output()


def test_concurrent_reads_while_writing(collector_factory):
    """`ttftscope sql` in other processes while the collector writes: consistent, growing counts."""
    col = collector_factory().start()
    sender = Sender(col.url, per_batch=100)
    sender.start()
    counts, seen, t0 = [], [], time.monotonic()
    try:
        deadline = time.monotonic() + 30
        while col.metric("ttftscope_collector_spans_written_total") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(5):
            r = subprocess.run([PY, "-m", "ttftscope", "sql", "--store", col.store, "--format", "csv",
                                "SELECT count(), uniqExact(SpanId) FROM otel_traces"],
                               capture_output=True, text=True, cwd=ROOT, timeout=60)
            assert r.returncode == 0, r.stderr
            n, u = map(int, r.stdout.strip().splitlines()[-1].split(","))
            assert n == u, "a reader never sees a duplicate (atomic snapshots)"
            counts.append(n)
            seen.append((round(time.monotonic() - t0, 2), n, col.metric("ttftscope_collector_spans_written_total"),
                         len(sender.acked), sender.refused))
    finally:
        sender.stop.set()
        sender.join(15)
    why = f"(seconds, read, written, acked, refused): {seen}\n{col.output()[-2000:]}"
    assert counts == sorted(counts) and counts[-1] > counts[0] > 0, why
    assert col.terminate() == 0
    assert len(_stored(col.store)) == len(sender.acked)


def test_merges_keep_every_row_and_readers_consistent(tmp_path):
    from ttftscope.collector.otlp import decode
    from ttftscope.schemas.store import open_store

    st = open_store(str(tmp_path / "s"), merge_factor=4, garbage_grace_s=0.0)
    for b in range(16):
        table, _ = decode(_batch(b, 25), "protobuf")
        assert st.insert_spans(table, f"t{b}")
    before = st.stats()
    assert before["parts"] == 16
    st.maintain()
    after = st.stats()
    assert after["parts"] == 1 and after["rows"] == 400  # 16 -> 4 (level 1) -> 1 (level 2)
    n, u = st.query("SELECT count(), uniqExact(SpanId) FROM otel_traces").row(0)
    assert (n, u) == (400, 400)
    files = sorted(p.name for p in (tmp_path / "s" / "otel_traces").glob("*.parquet"))
    assert len(files) == 2  # the merged part + the empty schema file; merged-away files deleted
    assert not st.insert_spans(decode(_batch(3, 25), "protobuf")[0], "t3"), "token remembered across merges"
