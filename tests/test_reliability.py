"""Nothing acknowledged is lost, for real: restarts, a damaged store directory, multi-member
gzip, bounded memory under big concurrent bodies, stalled connections, an honest SIGTERM.

Every test here counts exactly which spans were acknowledged (HTTP 200) and which are in the
store afterwards, read back through ``ttftscope sql`` in another process.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import resource
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import orjson
import pytest
import requests
from conftest import PY, ROOT, free_port, ttftscope_sql
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from test_durability import _stored

from support.otlp import PB, Sender, otlp_request
from support.otlp import numbered_batch as _batch
from support.otlp import numbered_ids as _ids


def _post_batches(url: str, first: int, count: int, per: int = 100) -> set[str]:
    acked: set[str] = set()
    for b in range(first, first + count):
        r = requests.post(url + "/v1/traces", data=_batch(b, per), headers=PB, timeout=30)
        assert r.status_code == 200, r.content
        acked |= _ids(b, per)
    return acked


def _wait_written(col, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while col.metric("ttftscope_collector_spans_written_total") < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert col.metric("ttftscope_collector_spans_written_total") >= n


def _exact(store: str, acked: set[str]) -> None:
    stored = _stored(store)
    assert len(stored) == len(set(stored)), "a span stored twice"
    missing = acked - set(stored)
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged spans are not in the store"
    assert set(stored) == acked


# ------------------------------------------------------------------------- restarts

@pytest.mark.parametrize("how", ["sigterm", "kill9-idle", "sigterm-other-port"])
def test_restart_keeps_every_acknowledged_span(collector_factory, tmp_path, how):
    """3 x 100 spans, stop, start again on the same store, 3 x 100 more: 600 stored."""
    col = collector_factory().start()
    acked = _post_batches(col.url, 0, 3)
    if how == "kill9-idle":
        _wait_written(col, 300)  # idle: everything written, the spool empty
        col.kill9()
    else:
        assert col.terminate() == 0, col.output()
    if how == "sigterm-other-port":
        col = collector_factory(spool=tmp_path / "spool-2")
    col.start()
    acked |= _post_batches(col.url, 3, 3)
    assert col.terminate() == 0, col.output()
    assert "every acknowledged span is in the store" in col.output()
    _exact(col.store, acked)
    assert len(acked) == 600


def test_many_restarts_with_the_default_spool(tmp_path):
    """The default spool (per store and listen address), as `ttftscope collect` runs it."""
    store, port = str(tmp_path / "store"), free_port()
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    acked: set[str] = set()
    for cycle in range(4):
        p = subprocess.Popen([PY, "-m", "ttftscope", "collect", "--store", store, "--listen", f"127.0.0.1:{port}",
                              "--flush-interval", "0.1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        from conftest import wait_http

        wait_http(url + "/healthz", p)
        acked |= _post_batches(url, cycle * 2, 2, per=50)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
    _exact(store, acked)


# ------------------------------------------------------------- a damaged store directory

def _filled_store(tmp_path: Path, batches: int = 12, merge: bool = True) -> tuple[str, set[str]]:
    """A store written the way the collector writes it: level-0 parts, merges, garbage."""
    from ttftscope.collector.otlp import decode
    from ttftscope.schemas.store import open_store

    path = str(tmp_path / "store")
    st = open_store(path, merge_factor=4)
    acked: set[str] = set()
    for b in range(batches):
        table, _ = decode(_batch(b, 25), "protobuf")
        assert st.insert_spans(table, f"tok-{b}")
        acked |= _ids(b, 25)
    if merge:
        st.maintain()  # 12 -> 3 merged parts; the 12 merged-away files stay (grace period)
    st.close()
    return path, acked


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    for f in path.rglob("*.parquet"):
        os.utime(f, (t, t))


def test_missing_manifest_is_rebuilt_from_the_parts_and_nothing_is_deleted(tmp_path):
    from ttftscope.collector.otlp import decode
    from ttftscope.schemas.store import open_store

    path, acked = _filled_store(tmp_path)
    files_before = sorted((Path(path) / "otel_traces").glob("*.parquet"))
    assert len(files_before) > 4, "merged parts and merged-away ones are both on disk"
    (Path(path) / "manifest.json").unlink()
    _age(Path(path), 7200)  # older than the orphan age: a naive upkeep would delete them
    st = open_store(path, garbage_grace_s=3600)
    st.maintain()
    n, u = st.query("SELECT count(), uniqExact(SpanId) FROM otel_traces").row(0)
    assert (n, u) == (len(acked), len(acked)), "merged-away parts are not counted twice"
    assert not st.insert_spans(decode(_batch(5, 25), "protobuf")[0], "tok-5"), "insert tokens restored"
    st.close()
    _exact(path, acked)


def test_collector_on_a_store_without_manifest_keeps_the_data(collector_factory, tmp_path):
    path, acked = _filled_store(tmp_path, merge=False)
    (Path(path) / "manifest.json").unlink()
    _age(Path(path), 7200)
    col = collector_factory(store=path).start()
    acked |= _post_batches(col.url, 100, 2)
    assert col.terminate() == 0, col.output()
    _exact(path, acked)


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"format": "ttftscope-embedded", "parts": null}',
                                     b'{"format": "ttftscope-embedded", "generation": 3}', b"[]",
                                     b'{"format": "ttftscope-embedded", "parts": [], "tokens": [], "garbage": [], '
                                     b'"token_runs": [["x", 1, 2]]}',
                                     b'{"format": "ttftscope-embedded", "parts": [], "tokens": [["x"]], "garbage": []}'])
def test_every_corrupt_manifest_is_a_clear_error_then_repaired(tmp_path, content):
    """In the store every command opens (the CLI's path is the next test): each kind of damage
    is a StoreError that says how to repair, `check` reports it, `check --repair` rebuilds the
    manifest from the parts, and every acknowledged span is there exactly once."""
    from ttftscope.schemas.store import open_store
    from ttftscope.schemas.store.base import StoreError
    from ttftscope.schemas.store.embedded import REPAIR_HINT, EmbeddedStore

    path, acked = _filled_store(tmp_path)
    (Path(path) / "manifest.json").write_bytes(content)
    with pytest.raises(StoreError, match="store check --repair") as e:
        open_store(path, create=False).query_arrow("SELECT count() FROM otel_traces")
    assert REPAIR_HINT in str(e.value)
    report = EmbeddedStore.for_check(path).check()
    assert report["problems"] and "manifest" in report["problems"][0] and not report["repaired"]
    fixed = EmbeddedStore.for_check(path).check(repair=True)
    assert fixed["repaired"] == ["manifest rebuilt from the parts"], fixed
    _exact(path, acked)
    assert not EmbeddedStore.for_check(path).check()["problems"]


def test_corrupt_manifest_is_a_clear_error_in_every_command_then_repaired(tmp_path):
    """As a user meets it: sql and analyze fail with the repair hint and no traceback, the
    collector refuses to start instead of acknowledging what it could never write, `store check`
    says so, `store check --repair` rebuilds the manifest and nothing acknowledged is lost."""
    path, acked = _filled_store(tmp_path)
    (Path(path) / "manifest.json").write_bytes(b"{not json")
    r = subprocess.run([PY, "-m", "ttftscope", "sql", "--store", path, "SELECT count() FROM otel_traces"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "store check --repair" in r.stderr
    r = subprocess.run([PY, "-m", "ttftscope", "analyze", "--store", path, "--last", "1h"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    port = free_port()
    r = subprocess.run([PY, "-m", "ttftscope", "collect", "--store", path, "--listen", f"127.0.0.1:{port}",
                        "--spool", str(tmp_path / "sp")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and "store check --repair" in r.stderr, r.stderr
    check = subprocess.run([PY, "-m", "ttftscope", "store", "check", "--store", path],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert check.returncode == 1 and "manifest" in check.stdout
    fix = subprocess.run([PY, "-m", "ttftscope", "store", "check", "--repair", "--store", path],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert fix.returncode == 0, fix.stdout + fix.stderr
    assert "manifest rebuilt" in fix.stdout
    _exact(path, acked)
    again = subprocess.run([PY, "-m", "ttftscope", "store", "check", "--store", path],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert again.returncode == 0, again.stdout


def _live_parts(path: str) -> list[dict]:
    import orjson

    return orjson.loads((Path(path) / "manifest.json").read_bytes())["parts"]


@pytest.mark.parametrize("damage", ["truncate", "delete", "garbage"])
def test_one_bad_part_is_quarantined_and_the_rest_stays_readable(tmp_path, damage):
    from ttftscope.collector.otlp import decode
    from ttftscope.schemas.store import open_store

    path, acked = _filled_store(tmp_path, batches=6, merge=False)
    victim = _live_parts(path)[2]
    f = Path(path) / "otel_traces" / f"{victim['name']}.parquet"
    if damage == "truncate":
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        f.unlink()
    else:
        f.write_bytes(b"not parquet at all " * 50)
    rows = ttftscope_sql(path, "SELECT count() AS n FROM otel_traces")
    assert int(rows[0]["n"]) == len(acked) - victim["rows"]
    assert victim["name"] not in {p["name"] for p in _live_parts(path)}
    if damage != "delete":
        assert (Path(path) / "quarantine" / f.name).exists(), "set aside, never deleted"
    st = open_store(path, merge_factor=2)
    assert st.stats()["quarantined"] == 1
    st.maintain()  # merges work again
    assert st.insert_spans(decode(_batch(50, 10), "protobuf")[0], "after")
    assert st.query("SELECT count() FROM otel_traces").item() == len(acked) - victim["rows"] + 10
    st.close()
    chk = subprocess.run([PY, "-m", "ttftscope", "store", "check", "--store", path],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert chk.returncode == 0 and "1 part(s) quarantined" in chk.stdout, chk.stdout


def test_store_check_finds_a_damaged_part_and_repairs(tmp_path):
    path, acked = _filled_store(tmp_path, batches=5, merge=False)
    victim = _live_parts(path)[0]
    f = Path(path) / "otel_traces" / f"{victim['name']}.parquet"
    f.write_bytes(f.read_bytes()[:-30])
    chk = subprocess.run([PY, "-m", "ttftscope", "store", "check", "--store", path],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert chk.returncode == 1 and victim["name"] in chk.stdout
    fix = subprocess.run([PY, "-m", "ttftscope", "store", "check", "--repair", "--store", path],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert fix.returncode == 0 and "quarantined 1 part" in fix.stdout, fix.stdout
    assert int(ttftscope_sql(path, "SELECT count() AS n FROM otel_traces")[0]["n"]) == len(acked) - victim["rows"]


# ------------------------------------------------------------------------ the wire

def test_multi_member_gzip_stores_every_member_and_garbage_is_400(collector_factory):
    col = collector_factory().start()
    a, b = _batch(1, 30), _batch(2, 40)
    body = gzip.compress(a) + gzip.compress(b)
    # two members = one protobuf message concatenated (protobuf merges repeated fields)
    r = requests.post(col.url + "/v1/traces", data=body, headers={**PB, "Content-Encoding": "gzip"}, timeout=10)
    assert r.status_code == 200
    resp = trace_service_pb2.ExportTraceServiceResponse()
    resp.ParseFromString(r.content)
    assert resp.partial_success.rejected_spans == 0
    for bad in (gzip.compress(_batch(3, 5)) + b"trailing junk", gzip.compress(_batch(4, 5)) + gzip.compress(b"x")[:10]):
        r = requests.post(col.url + "/v1/traces", data=bad, headers={**PB, "Content-Encoding": "gzip"}, timeout=10)
        assert r.status_code == 400, r.status_code
    assert col.terminate() == 0
    _exact(col.store, _ids(1, 30) | _ids(2, 40))


def test_concurrent_senders_share_spool_syncs_and_each_span_is_stored_once(collector_factory):
    """Group commit: requests completed together are acknowledged by one spool sync, none
    before it (the kill -9 tests check what a sync promises); every span stored once."""
    col = collector_factory().start()
    senders, per = 8, 12
    codes: list[int] = []

    def send(k: int) -> None:
        with requests.Session() as s:
            for j in range(per):
                r = s.post(col.url + "/v1/traces", data=_batch(k * 100 + j, 20), headers=PB, timeout=30)
                codes.append(r.status_code)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert codes == [200] * senders * per
    syncs = col.metric("ttftscope_collector_commit_requests_count")
    acked = col.metric("ttftscope_collector_commit_requests_sum")
    assert acked == senders * per, "every acknowledged request waited for a sync"
    assert syncs < acked, f"{syncs:.0f} syncs for {acked:.0f} concurrent requests: none shared"
    assert col.terminate() == 0
    _exact(col.store, set().union(*(_ids(k * 100 + j, 20) for k in range(senders) for j in range(per))))


def test_pipelined_requests_are_answered_in_order(collector_factory):
    """Three requests in one write on one connection: three answers, in order, all stored."""
    col = collector_factory().start()
    bodies = [_batch(k, 5 + k) for k in range(3)]
    head = "POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
    wire = b"".join(f"{head}Content-Length: {len(b)}\r\n\r\n".encode() + b for b in bodies[:2])
    wire += f"{head}Connection: close\r\nContent-Length: {len(bodies[2])}\r\n\r\n".encode() + bodies[2]
    with socket.create_connection(("127.0.0.1", col.port), timeout=30) as s:
        s.sendall(wire)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    answers = got.split(b"HTTP/1.1 ")[1:]
    assert [a[:3] for a in answers] == [b"200"] * 3, got[:300]
    assert b"Connection: close" in answers[2] and b"Connection: close" not in answers[0]
    assert col.terminate() == 0
    _exact(col.store, _ids(0, 5) | _ids(1, 6) | _ids(2, 7))


def test_a_request_that_arrives_in_pieces_is_read_whole(collector_factory):
    """The request line, the headers and the body in separate writes with pauses (a slow
    network): one answer, the spans stored."""
    col = collector_factory().start()
    body = _batch(9, 12)
    pieces = [b"POST /v1/traces HTTP/1.1\r\nHo", b"st: x\r\nContent-Type: application/x-protobuf\r\n",
              f"Connection: close\r\nContent-Length: {len(body)}\r\n".encode(), b"\r\n", body[:7], body[7:]]
    with socket.create_connection(("127.0.0.1", col.port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for p in pieces:
            s.sendall(p)
            time.sleep(0.15)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"HTTP/1.1 ") == 1, got[:300]
    assert col.terminate() == 0
    _exact(col.store, _ids(9, 12))


def _vm(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


@pytest.mark.parametrize("encoding,budget_mb", [("protobuf", 64), ("json", 256)])
def test_memory_is_bounded_under_concurrent_maximum_size_bodies(collector_factory, encoding, budget_mb):
    """16 concurrent 4 MiB bodies (half gzip): the cost of handling each (its encoding's
    factor times the decoded size) is admitted against --max-memory before it starts, the rest
    get 429 + Retry-After, RSS stays bounded. Protobuf is only checked on arrival (the flusher
    decodes it), JSON is decoded in the request: a smaller budget fills with protobuf."""
    budget = budget_mb << 20
    col = collector_factory(extra=["--max-body", "4M", "--max-memory", f"{budget_mb}M"]).start()
    deadline = time.monotonic() + 180  # numba compiling on a cold cache holds ~100 MB for a while
    while not requests.get(col.url + "/healthz", timeout=10).json()["compiled"] and time.monotonic() < deadline:
        time.sleep(0.5)
    requests.post(col.url + "/v1/traces", data=_batch(0, 10), headers=PB, timeout=10)  # warm
    base = _vm(col.proc.pid, "VmRSS")
    n_spans = 30_000 if encoding == "protobuf" else 13_000

    def big(k: int) -> bytes:
        if encoding == "json":
            spans = [{"traceId": f"{k + 1:032x}", "spanId": f"{(k << 16) + i + 1:016x}", "name": "ok",
                      "startTimeUnixNano": str(time.time_ns()), "endTimeUnixNano": str(time.time_ns() + 1000),
                      "attributes": [{"key": "ttftscope.request.id", "value": {"stringValue": f"req-{k}-{i}-" + "x" * 40}}]}
                     for i in range(n_spans)]
            return orjson.dumps({"resourceSpans": [{"resource": {"attributes": [
                {"key": "service.name", "value": {"stringValue": "dur"}}]}, "scopeSpans": [{"spans": spans}]}]})
        req = otlp_request(1, service="dur", ids=lambda i: (k + 1, (k << 16) + i + 1))
        span = req.resource_spans[0].scope_spans[0].spans[0]
        for i in range(1, n_spans):  # ~4 MB of spans with attributes
            sp = req.resource_spans[0].scope_spans[0].spans.add()
            sp.CopyFrom(span)
            sp.span_id = ((k << 16) + i + 1).to_bytes(8, "big")
            kv = sp.attributes.add()
            kv.key, kv.value.string_value = "ttftscope.request.id", f"req-{k}-{i}-" + "x" * 40
        return req.SerializeToString()

    bodies = []
    for k in range(16):
        b = big(k + 100)
        assert 3 << 20 <= len(b) <= 4 << 20
        bodies.append((k, gzip.compress(b) if k % 2 else b, bool(k % 2)))
    results: dict[int, requests.Response] = {}
    ctype = {"Content-Type": "application/json"} if encoding == "json" else PB

    def send(k: int, body: bytes, gz: bool) -> None:
        h = {**ctype, **({"Content-Encoding": "gzip"} if gz else {})}
        results[k] = requests.post(col.url + "/v1/traces", data=body, headers=h, timeout=300)

    threads = [threading.Thread(target=send, args=x) for x in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    codes = sorted(r.status_code for r in results.values())
    assert set(codes) <= {200, 429}, codes
    assert 200 in codes and 429 in codes, codes
    assert all(int(r.headers["Retry-After"]) > 0 for r in results.values() if r.status_code == 429)
    peak = _vm(col.proc.pid, "VmHWM")
    # without admission control 16 x 4 MiB JSON decodes at once peak near 1 GB above the base
    assert peak - base < budget + (192 << 20), f"peak RSS {peak >> 20} MiB over a base of {base >> 20} MiB"
    assert col.metric("ttftscope_collector_requests_over_budget_total") == codes.count(429)
    acked_k = [k for k, r in results.items() if r.status_code == 200]
    assert col.terminate() == 0
    n = ttftscope_sql(col.store, "SELECT count() AS n FROM otel_traces WHERE ServiceName = 'dur'")
    assert int(n[0]["n"]) == n_spans * len(acked_k) + 10


def _threads(pid: int) -> int:
    return _vm(pid, "Threads") // 1024


def test_stalled_connections_are_cut_off_and_capped(collector_factory):
    col = collector_factory(extra=["--read-timeout", "1", "--max-connections", "20"]).start()
    seen, deadline = [], time.monotonic() + 20  # the chDB engine starts its threads at start-up
    while (len(seen) < 5 or len(set(seen[-5:])) > 1) and time.monotonic() < deadline:
        seen.append(_threads(col.proc.pid))
        time.sleep(0.2)
    base = seen[-1]
    socks = []
    for _ in range(60):  # a header, then silence
        s = socket.create_connection(("127.0.0.1", col.port))
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    time.sleep(0.3)
    assert _threads(col.proc.pid) <= base + 20, "one thread per connection, at most --max-connections"
    # a body shorter than its Content-Length: 408 once the read timeout passes
    s = socket.create_connection(("127.0.0.1", col.port), timeout=30)
    deadline = time.monotonic() + 20
    while True:  # the cap may still be full of the stalled ones until they time out
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b"\x0a" * 10)
        reply = s.recv(4096)
        if not reply.startswith(b"HTTP/1.1 503") or time.monotonic() > deadline:
            break
        s.close()
        time.sleep(0.5)
        s = socket.create_connection(("127.0.0.1", col.port), timeout=30)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    s.close()
    for s in socks:
        s.close()
    r = requests.post(col.url + "/v1/traces", data=_batch(1, 10), headers=PB, timeout=10)
    assert r.status_code == 200
    assert col.metric("ttftscope_collector_connections_refused_total") >= 40
    assert col.metric('ttftscope_collector_requests_total{code="408"}') == 1
    assert col.terminate() == 0
    assert "Traceback" not in col.output()
    _exact(col.store, _ids(1, 10))


def _fleet_round(port: int, n: int, first: int) -> tuple[list[bytes], set[str]]:
    """``n`` keep-alive connections open at once, as a fleet's exporting processes hold them;
    each posts one batch of 5 numbered spans. The status lines in connection order, and the ids
    of the batches answered 200."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(n)]
    for k, s in enumerate(socks):
        body = _batch(first + k, 5)
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    status, acked = [], set()
    for k, s in enumerate(socks):
        head = b""
        while b"\r\n" not in head:
            got = s.recv(4096)
            if not got:
                break
            head += got
        status.append(head.split(b"\r\n", 1)[0])
        if head.startswith(b"HTTP/1.1 200"):
            acked |= _ids(first + k, 5)
    for s in socks:
        s.close()
    return status, acked


def test_a_fleet_of_kept_alive_exporters_is_served_whole(collector_factory):
    """A fleet of vLLM servers holds an export connection a process to one collector (an API
    server, an engine core and a worker a GPU each, kept alive between exports: a hundred servers at
    TP = 4 hold 600):
    1,100 at once are every one served, though the collector starts under the usual soft
    open-file limit of 1,024 (it raises its own, up to the hard limit). At the old cap of 256 the
    rest were answered 503 -- for as long as the others stayed connected, so their spans piled up
    in the exporters' queues until dropped."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    n = 1100
    if hard != resource.RLIM_INFINITY and hard < 2 * n + 1024:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room for {n} connections on both ends")
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 256, hard))
    col = collector_factory(nofile=(1024, hard)).start()
    status, acked = _fleet_round(col.port, n, 0)
    assert status == [b"HTTP/1.1 200 OK"] * n, {s: status.count(s) for s in set(status)}
    assert col.terminate() == 0
    _exact(col.store, acked)


def test_an_open_file_limit_below_the_connection_cap_lowers_the_cap_and_says_so(collector_factory):
    """Started where even the hard open-file limit is 400, the collector does not promise 4,096
    connections it cannot open (an accept failing for want of a descriptor): it says what it
    lowered the cap to and why, and answers connections past it 503, as it does at any cap."""
    col = collector_factory(nofile=(400, 400)).start()
    status, acked = _fleet_round(col.port, 300, 0)
    ok = status.count(b"HTTP/1.1 200 OK")
    assert 0 < ok < 300 and set(status) == {b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable"}, set(status)
    assert col.metric("ttftscope_collector_connections_refused_total") == 300 - ok
    r = requests.post(col.url + "/v1/traces", data=_batch(1000, 5), headers=PB, timeout=10)
    assert r.status_code == 200
    health = requests.get(col.url + "/healthz", timeout=10).json()  # what `ttftscope doctor` warns of
    assert (health["max_connections"], health["max_connections_asked"]) == (ok, 4096), health
    assert col.terminate() == 0
    out = col.output()
    assert "open-file limit" in out and f"--max-connections lowered to {ok}" in out, out[-2000:]
    assert "Traceback" not in out
    _exact(col.store, acked | _ids(1000, 5))


def test_sigterm_acknowledges_nothing_it_does_not_store(collector_factory):
    """Keep-alive senders keep posting through SIGTERM: every 200 is in the store."""
    col = collector_factory().start()
    senders = [Sender(col.url, per_batch=50, start_at=k * 10_000) for k in range(3)]
    for s in senders:
        s.start()
    time.sleep(1.5)
    col.proc.send_signal(signal.SIGTERM)
    rc = col.proc.wait(60)
    for s in senders:
        s.stop.set()
        s.join(15)
    acked = set().union(*(s.acked for s in senders))
    assert len(acked) > 300
    out = col.output()
    assert rc == 0 and "every acknowledged span is in the store" in out, out[-2000:]
    _exact(col.store, acked)


# --------------------------------------------------------------------- small edges

def test_event_timestamp_past_int64_and_bad_link_ids_reject_only_that_span(collector_factory):
    col = collector_factory().start()
    req = otlp_request(3, name="edge", service="dur")
    spans = req.resource_spans[0].scope_spans[0].spans
    ev = spans[1].events.add()
    ev.time_unix_nano, ev.name = 1 << 63, "overflow"
    ln = spans[2].links.add()
    ln.trace_id, ln.span_id = b"\x01" * 5, b"\x02" * 8
    r = requests.post(col.url + "/v1/traces", data=req.SerializeToString(), headers=PB, timeout=10)
    assert r.status_code == 200
    resp = trace_service_pb2.ExportTraceServiceResponse()
    resp.ParseFromString(r.content)
    assert resp.partial_success.rejected_spans == 2
    msg = resp.partial_success.error_message
    assert "spans[1].events[0].timeUnixNano" in msg and "spans[2].links[0]" in msg
    assert col.terminate() == 0
    assert [r["SpanId"] for r in ttftscope_sql(col.store, "SELECT SpanId FROM otel_traces")] == [format(1, "016x")]


def test_huge_span_name_is_capped(collector_factory):
    col = collector_factory().start()
    req = otlp_request(1, name="n" * (10 << 20), service="dur")
    r = requests.post(col.url + "/v1/traces", data=req.SerializeToString(), headers=PB, timeout=30)
    assert r.status_code == 200
    resp = trace_service_pb2.ExportTraceServiceResponse()
    resp.ParseFromString(r.content)
    assert "names truncated" in resp.partial_success.error_message
    assert col.terminate() == 0
    n = ttftscope_sql(col.store, "SELECT length(SpanName) AS n FROM otel_traces")
    assert 0 < int(n[0]["n"]) <= 4096


def test_bearer_scheme_is_case_insensitive_and_token_comes_from_a_file(collector_factory, tmp_path):
    tf = tmp_path / "token"
    tf.write_text("s3cret-from-file\n")
    col = collector_factory(extra=["--token-file", str(tf)]).start()
    cmdline = Path(f"/proc/{col.proc.pid}/cmdline").read_bytes()
    assert b"s3cret-from-file" not in cmdline
    body = _batch(1, 2)
    for scheme in ("Bearer", "bearer", "BEARER"):
        h = {**PB, "Authorization": f"{scheme} s3cret-from-file"}
        assert requests.post(col.url + "/v1/traces", data=body, headers=h, timeout=10).status_code == 200
    h = {**PB, "Authorization": "Basic s3cret-from-file"}
    assert requests.post(col.url + "/v1/traces", data=body, headers=h, timeout=10).status_code == 401
    assert col.terminate() == 0


def test_store_password_is_not_printed(tmp_path):
    port = free_port()
    p = subprocess.Popen([PY, "-m", "ttftscope", "collect", "--store",
                          f"clickhouse://default:hunter2pass@127.0.0.1:{free_port()}/db",
                          "--listen", f"127.0.0.1:{port}", "--spool", str(tmp_path / "sp")],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    from conftest import wait_http

    wait_http(f"http://127.0.0.1:{port}/healthz", p)
    time.sleep(1.0)  # the flusher's first (failing) connection attempt is logged
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert "listening on" in out and "***" in out
    assert "hunter2pass" not in out


def test_backslash_in_a_bound_parameter_is_found(collector_factory):
    col = collector_factory().start()
    req = otlp_request(1, name="bs", service="dur")
    kv = req.resource_spans[0].scope_spans[0].spans[0].attributes.add()
    kv.key, kv.value.string_value = "ttftscope.request.id", "cmpl-a\\b\\n"
    assert requests.post(col.url + "/v1/traces", data=req.SerializeToString(), headers=PB, timeout=10).status_code == 200
    assert col.terminate() == 0
    rows = ttftscope_sql(col.store, "SELECT count() AS n FROM otel_traces "
                                    "WHERE SpanAttributes['ttftscope.request.id'] = {rid:String}",
                         params={"rid": "cmpl-a\\b\\n"})
    assert int(rows[0]["n"]) == 1


def test_a_drain_while_the_listener_is_still_being_set_up(tmp_path, monkeypatch):
    """A SIGTERM right after start (the listener not set up yet) stops the collector cleanly: it
    crashed (exit 1, 'NoneType' has no attribute 'close') when the drain found no listener."""
    from ttftscope.collector import server as srv
    from ttftscope.collector.service import Collector

    real = srv._new_loop

    def slow_loop():
        loop = real()
        make = loop.create_server

        async def create_server(*a, **kw):  # the set-up takes a while (a loaded machine)
            await asyncio.sleep(0.5)
            return await make(*a, **kw)
        loop.create_server = create_server
        return loop

    monkeypatch.setattr(srv, "_new_loop", slow_loop)
    col = Collector(str(tmp_path / "store"), srv.ServerConfig(host="127.0.0.1", port=0), spool_dir=tmp_path / "spool")
    t = threading.Thread(target=col.server.serve_forever, daemon=True)
    t.start()
    time.sleep(0.1)  # the loop exists, its listener does not yet
    assert col.server.drain(timeout=5)
    t.join(5)
    assert not t.is_alive(), "the receiver's thread ended"
    with pytest.raises(OSError):
        socket.create_connection(col.server.server_address[:2], timeout=1).close()
    col.spool.close()


@pytest.mark.parametrize("window, commits", [("2", 1), ("0", 2)])
def test_the_commit_window_lets_spaced_requests_share_one_sync(collector_factory, window, commits):
    """``--commit-window``: with a third connection open and idle, two requests posted one after
    the other on two connections share one spool sync when the window is long (2 s: the second
    arrives inside it) and get one each when it is 0 (read from the collector's own
    ``ttftscope_collector_commit_requests`` histogram)."""
    col = collector_factory(extra=["--commit-window", window]).start()
    idle = socket.create_connection(("127.0.0.1", col.port))  # open, never posting: not everyone waits
    try:
        answers = []
        posts = [threading.Thread(target=lambda k=k: answers.append(
            requests.post(col.url + "/v1/traces", data=_batch(k, 5), headers=PB, timeout=30).status_code))
            for k in range(2)]
        for t in posts:
            t.start()
            time.sleep(0.2)  # spaced: the second is sent while the first waits for its commit
        for t in posts:
            t.join()
        assert answers == [200, 200]
        text = requests.get(col.url + "/metrics", timeout=10).text
        got = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
               if ln.startswith("ttftscope_collector_commit_requests_")}
        assert got["ttftscope_collector_commit_requests_sum"] == 2, got
        assert got["ttftscope_collector_commit_requests_count"] == commits, got
    finally:
        idle.close()
    assert col.terminate() == 0


_SIGNAL_WHILE_A_LOCK_IS_HELD = r'''
import os, signal, sys, threading
from ttftscope.collector.server import ServerConfig
from ttftscope.collector.service import Collector, serve

col = Collector(sys.argv[1], ServerConfig(port=0), spool_dir=sys.argv[2])
armed = threading.Event()
fired = []

def prof(frame, event, arg):
    # the main thread has just entered a lock's block (an Event's, a Condition's ...) in serve's wait loop:
    # SIGTERM now, so its handler runs at the next instruction, with that lock held
    if (event == "c_return" and not fired and armed.is_set()
            and getattr(arg, "__name__", "") == "__enter__"):
        fired.append(1)
        os.kill(os.getpid(), signal.SIGTERM)

threading.Timer(1.0, armed.set).start()
# a loop that takes no lock is still stopped, a little later
threading.Timer(4.0, lambda: fired or os.kill(os.getpid(), signal.SIGTERM)).start()
sys.setprofile(prof)
rc = serve(col, ready_message=False)
sys.setprofile(None)
print("fired" if fired else "not fired", rc, flush=True)
sys.exit(rc)
'''


def test_a_signal_that_lands_while_the_wait_loop_holds_a_lock_still_stops_the_collector(tmp_path):
    """SIGTERM delivered while the main thread held the lock of the Event it waited on: the
    handler's ``Event.set()`` took the same lock and the collector hung for good (seen in a
    truth test's teardown: stack ``Event.wait -> Condition.__enter__ -> _on_signal -> Event.set
    -> Condition.__enter__``). The handler must take no lock."""
    script = tmp_path / "serve.py"
    script.write_text(_SIGNAL_WHILE_A_LOCK_IS_HELD)
    p = subprocess.Popen([PY, str(script), str(tmp_path / 'store'), str(tmp_path / "spool")], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail("the collector did not stop on SIGTERM:\n" + out[-3000:])
    assert p.returncode == 0, out[-3000:]
