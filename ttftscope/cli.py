"""The ``ttftscope`` command: it only wires the packages together."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="clickhouse://user:pass@host:8123/db or a local directory (embedded chDB store); "
        "default: $TTFTSCOPE_STORE, else ~/.local/share/ttftscope/store",
    )


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", value
    try:
        p = int(port)
        if not 0 <= p <= 65535:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid HOST:PORT {value!r}") from None
    return (host.strip("[]") or "127.0.0.1"), p


def _size(value: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    v = value.strip().lower().rstrip("ib").rstrip("b") if value[-1:].lower() == "b" else value.strip().lower()
    try:
        if v and v[-1] in units:
            return int(float(v[:-1]) * units[v[-1]])
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {value!r} (e.g. 512M, 2G)") from None


def _scenarios() -> list[str]:
    from ttftscope.analyzer.synth import SCENARIOS

    return list(SCENARIOS)


def _window_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--since", default=None, help="start (ISO 8601, epoch s, now-2h)")
    p.add_argument("--until", default=None, help="end (default now)")
    p.add_argument("--last", default=None, help="window length back from now, e.g. 15m (default 1h)")
    p.add_argument("--model", default=None)
    p.add_argument("--version", default=None, help="service.version")
    p.add_argument("--run", default=None, help="ttftscope.run label")


def _window(a):
    from ttftscope.analyzer.window import Window, parse_duration, parse_time

    if a.last and (a.since or a.until):
        raise ValueError("use either --last or --since/--until")
    until = parse_time(a.until) if a.until else None
    if a.last:
        import time

        now = time.time_ns()
        return Window(now - int(parse_duration(a.last) * 1e9), now + 10**9, a.model, a.version, a.run)
    if a.since:
        import time

        return Window(parse_time(a.since), until or time.time_ns() + 10**9, a.model, a.version, a.run)
    w = Window.last(3600, model=a.model, version=a.version, run=a.run)
    return Window(w.since_ns, until or w.until_ns, a.model, a.version, a.run) if until else w


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ttftscope", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("collect", help="run the OTLP/HTTP collector service")
    _store_arg(c)
    c.add_argument("--listen", type=_listen, default=("127.0.0.1", 4318), metavar="HOST:PORT")
    c.add_argument("--token", default=None,
                   help="require 'Authorization: Bearer TOKEN' (visible in the process list: prefer "
                        "--token-file or $TTFTSCOPE_COLLECTOR_TOKEN)")
    c.add_argument("--token-file", default=None, metavar="FILE", help="read the bearer token from FILE")
    c.add_argument("--spool", default=None, metavar="DIR", help="on-disk spool (default: per store+listen)")
    c.add_argument("--max-spool", type=_size, default=1 << 30, metavar="SIZE",
                   help="refuse new spans (429/503) beyond this much spooled data (default 1G)")
    c.add_argument("--max-body", type=_size, default=16 << 20, metavar="SIZE", help="largest request (default 16M)")
    c.add_argument("--commit-window", type=float, default=None, metavar="S",
                   help="group commit: the longest a request waits for others to share its spool sync and its "
                        "answer, when not every open connection is waiting (default 0.05 s)")
    c.add_argument("--flush-interval", type=float, default=2.0, metavar="S",
                   help="the longest an acknowledged batch waits before it is written to the store "
                        "(default 2 s; each write is one decoding query and one part, so rarer, bigger "
                        "writes cost less per span)")
    c.add_argument("--retention-days", type=float, default=None, help="drop spans older than this")
    c.add_argument("--no-fsync", action="store_true", help="acknowledge before fsync (faster; a host crash may lose spans)")
    c.add_argument("--max-memory", type=_size, default=1 << 30, metavar="SIZE",
                   help="memory all requests in flight may hold while read, decompressed and decoded; "
                        "past it 429 + Retry-After (default 1G)")
    c.add_argument("--read-timeout", type=float, default=15.0, metavar="S",
                   help="cut off a client silent this long (408 on a stalled body; default 15)")
    c.add_argument("--max-connections", type=int, default=4096, metavar="N",
                   help="open connections at most, one a fleet's exporting process; more get 503 (default "
                        "4096; the open-file limit is raised to fit, up to its hard limit)")

    dr = sub.add_parser("doctor", help="check vLLM, the plugin's adapters, the collector and the store before a "
                                       "deployment; exit 1 on a problem")
    _store_arg(dr)
    dr.add_argument("--no-collector", action="store_true", help="skip the collector reachability check")
    dr.add_argument("--json", action="store_true")

    st = sub.add_parser("store", help="look after the store")
    st_sub = st.add_subparsers(dest="store_command", required=True)
    chk = st_sub.add_parser("check", help="verify the store (manifest, every part read in full); exit 1 on a problem")
    _store_arg(chk)
    chk.add_argument("--repair", action="store_true",
                     help="rebuild a lost or corrupt manifest from the parts, quarantine unreadable parts")
    chk.add_argument("--json", action="store_true")

    s = sub.add_parser("sql", help="run ClickHouse SQL over the store")
    _store_arg(s)
    s.add_argument("query", help="SQL, or - to read it from stdin")
    s.add_argument("--format", choices=["table", "csv", "json", "tsv"], default="table")
    s.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="bind {NAME:Type} in the query (repeatable)")

    an = sub.add_parser("analyze", help="where TTFT goes in a window: decomposition, gaps, findings, advice")
    _store_arg(an)
    _window_args(an)
    an.add_argument("--slo", default=None, metavar="FILE|p50=..,p99=..", help="the SLO: a YAML file (every key: alerts/slo.example.yaml) or TTFT targets in ms, p50=350,p95=600,p99=800 (default)")
    g = an.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="the report as JSON (schema ttftscope.report/1)")
    g.add_argument("--markdown", action="store_true", help="the report as Markdown")
    an.add_argument("--quiet", action="store_true", help="no progress on stderr")

    cp = sub.add_parser("compare", help="compare two windows or versions phase by phase")
    _store_arg(cp)
    cp.add_argument("a", help="version=X, run=X, or a time range START..END (ISO or now-15m)")
    cp.add_argument("b", help="the same, for the other side")
    _window_args(cp)
    cp.add_argument("--json", action="store_true")

    ex = sub.add_parser("export", help="export requests for other tools")
    ex.add_argument("format", choices=["perfetto"])
    _store_arg(ex)
    ex.add_argument("--trace-id", action="append", default=[])
    ex.add_argument("--request-id", action="append", default=[])
    _window_args(ex)
    ex.add_argument("--limit", type=int, default=200, help="requests from the window (default 200)")
    ex.add_argument("-o", "--output", default="-", help="file (default stdout)")

    sy = sub.add_parser("synth", help="write a synthetic workload with a planted cause into the store")
    _store_arg(sy)
    sy.add_argument("--scenario", required=True, help="one of: " + ", ".join(_scenarios()))
    sy.add_argument("--requests", type=int, default=10_000)
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--truth", default=None, metavar="FILE", help="write the planted ground truth (JSON) here")

    al = sub.add_parser("alerts", help="Prometheus rules, promtool tests and Alertmanager config from an SLO file")
    al_sub = al.add_subparsers(dest="alerts_cmd", required=True)
    ag = al_sub.add_parser("generate")
    ag.add_argument("--slo", default=None, metavar="FILE|p50=..,p99=..", help="the SLO: a YAML file (every key: alerts/slo.example.yaml) or TTFT targets in ms, p50=350,p95=600,p99=800 (default)")
    ag.add_argument("--out", required=True, help="output directory")

    gr = sub.add_parser("grafana", help="Grafana dashboards and provisioning")
    gr_sub = gr.add_subparsers(dest="grafana_cmd", required=True)
    gg = gr_sub.add_parser("generate")
    gg.add_argument("--out", required=True)
    gg.add_argument("--slo", default=None, metavar="FILE|p50=..,p99=..", help="the SLO: a YAML file (every key: alerts/slo.example.yaml) or TTFT targets in ms, p50=350,p95=600,p99=800 (default)")
    gg.add_argument("--prometheus-url", default="http://localhost:9090")
    gg.add_argument("--clickhouse", default="localhost:8123/default", metavar="HOST:PORT/DB")

    ui = sub.add_parser("ui", help="the web UI (Streamlit)")
    _store_arg(ui)
    ui.add_argument("--port", type=int, default=8501)
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--prometheus", default=None, help="Prometheus URL for the Alerts page's firing state")

    d = sub.add_parser("demo", help="the main job: real vLLM + plugin + collector, load profiles, report, UI")
    _store_arg(d)
    d.add_argument("--quick", action="store_true", help="short profiles (CI)")
    d.add_argument("--no-ui", action="store_true", help="exit after the report instead of serving the UI")
    d.add_argument("--ui-port", type=int, default=8501)
    d.add_argument("--model", default=None, help="a real model directory (GPU machine); default: the tiny local model")
    d.add_argument("--no-tp2", action="store_true", help="skip the tensor-parallel-2 run")
    d.add_argument("--workdir", default=None, help="logs of its servers (default ~/.local/share/ttftscope); the tiny model lives in ~/.cache/ttftscope")

    rn = sub.add_parser("run", help="drive a running vLLM (with the plugin) with a load profile; CI gate")
    _store_arg(rn)
    rn.add_argument("--server", required=True, help="base URL of the vLLM OpenAI server")
    rn.add_argument("--model", default=None, help="model name (default: the server's first model)")
    rn.add_argument("--profile", default=None, help="YAML/JSON load profile (rate, burstiness, lengths, duration_s, ...)")
    rn.add_argument("--slo", default=None, metavar="FILE|p50=..,p99=..", help="the SLO: a YAML file (every key: alerts/slo.example.yaml) or TTFT targets in ms, p50=350,p95=600,p99=800 (default)")
    rn.add_argument("--settle-s", type=float, default=None, metavar="S",
                    help="before reporting, wait until the store holds every completed request's spans or their "
                         "count stands still this long (default: the plugin's export interval + its 1-s step fold + "
                         "the collector's default 2-s flush + 1.5 s); raise it for a collector with a longer --flush-interval")
    rn.add_argument("--json", action="store_true")

    sw = sub.add_parser("sweep", help="restart vLLM over a grid of engine settings, same profile each, recommend one")
    _store_arg(sw)
    sw.add_argument("--model", default=None, help="model directory (default: the tiny local model)")
    sw.add_argument("--profile", default=None)
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                    help="max_num_seqs, max_num_batched_tokens, chunked_prefill, prefix_caching, gpu_memory_utilization")
    sw.add_argument("--slo", default=None, metavar="FILE|p50=..,p99=..", help="the SLO: a YAML file (every key: alerts/slo.example.yaml) or TTFT targets in ms, p50=350,p95=600,p99=800 (default)")
    sw.add_argument("--workdir", default=None)

    sc = sub.add_parser("schema", help="print the DDL or the vocabulary")
    sc.add_argument("what", choices=["ddl", "vocabulary"])
    sc.add_argument("--database", default="default")
    sc.add_argument("--cluster", default=None)
    sc.add_argument("--ttl-days", type=int, default=None)
    return ap


_FORMATS = {"table": "PrettyCompactMonoBlock", "csv": "CSVWithNames", "json": "JSON", "tsv": "TSVWithNames"}


def _collector_allocator() -> None:
    """Arrow's buffers from the C library's allocator in a collector process, unless
    ``ARROW_DEFAULT_MEMORY_POOL`` names a pool. Arrow picks its C++ default pool once, when
    pyarrow is imported (``pyarrow.set_memory_pool`` does not reach the Parquet writer or the
    compute kernels), so ``main`` calls this before it builds its parser (which imports the
    analyzer, and pyarrow with it); once pyarrow is in, it does nothing. pyarrow's default,
    mimalloc, handed a flush's memory back to the kernel before the next flush, which faulted it
    in again as fresh 2 MiB pages, each zeroed by the kernel: 14-16 % of a fleet-fed collector's
    CPU in ``clear_page_erms`` (perf). bench/ingest's fleet case shows the difference."""
    if "pyarrow" not in sys.modules:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


def cmd_collect(a) -> int:
    from ttftscope.collector.otlp import Limits
    from ttftscope.collector.server import ServerConfig
    from ttftscope.collector.service import Collector, serve
    from ttftscope.collector.spool import SpoolError
    from ttftscope.schemas.store import StoreError, default_store_url, open_store

    url = a.store or default_store_url()
    try:  # fail fast on a bad URL or path; an unreachable server is retried instead
        if "://" not in url or url.startswith("file://"):
            open_store(url).close()
    except StoreError as e:
        print(f"ttftscope collect: {e}", file=sys.stderr)
        return 2
    token = a.token or os.environ.get("TTFTSCOPE_COLLECTOR_TOKEN") or None
    if a.token_file:
        try:
            with open(a.token_file) as f:
                token = f.read().strip()
        except OSError as e:
            print(f"ttftscope collect: cannot read --token-file: {e}", file=sys.stderr)
            return 2
        if not token:
            print(f"ttftscope collect: --token-file {a.token_file} is empty", file=sys.stderr)
            return 2
    cfg = ServerConfig(host=a.listen[0], port=a.listen[1], max_body_bytes=a.max_body, bearer_token=token,
                       limits=Limits(), max_memory_bytes=a.max_memory, read_timeout_s=a.read_timeout,
                       max_connections=max(a.max_connections, 1),
                       **({} if a.commit_window is None else {"commit_window_s": max(a.commit_window, 0.0)}))
    try:
        col = Collector(url, cfg, spool_dir=a.spool, fsync=not a.no_fsync, max_spool_bytes=a.max_spool,
                        segment_age_s=a.flush_interval, retention_days=a.retention_days)
    except SpoolError as e:
        print(f"ttftscope collect: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"ttftscope collect: cannot listen on {a.listen[0]}:{a.listen[1]}: {e.strerror}", file=sys.stderr)
        return 2
    return serve(col)


def cmd_doctor(a) -> int:
    import json
    from dataclasses import asdict

    from ttftscope.doctor import render, run_checks

    checks = run_checks(a.store, check_collector=not a.no_collector)
    print(json.dumps([asdict(c) for c in checks], indent=2) if a.json else render(checks))
    return 1 if any(c.status == "problem" for c in checks) else 0


def cmd_store(a) -> int:
    import json

    from ttftscope.schemas.store import StoreError, default_store_url
    from ttftscope.schemas.store.embedded import EmbeddedStore

    url = a.store or default_store_url()
    if "://" in url and not url.startswith("file://"):
        print("ttftscope store check: only the embedded store has files to check; a ClickHouse server "
              "checks its own parts (CHECK TABLE otel_traces)", file=sys.stderr)
        return 2
    path = url.removeprefix("file://")
    try:
        report = EmbeddedStore.for_check(path).check(repair=a.repair)
    except StoreError as e:
        print(f"ttftscope store check: {e}", file=sys.stderr)
        return 2
    ok = not report["problems"] or (a.repair and report["repaired"])
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"store {report['store']}: {report['parts']} readable parts, {report['rows']} rows; "
              f"manifest: {report['manifest']}")
        for p in report["problems"]:
            print(f"  problem: {p}")
        for r in report["repaired"]:
            print(f"  repaired: {r}")
        if report["orphans"]:
            print(f"  {len(report['orphans'])} part file(s) no manifest lists (left by interrupted writes; "
                  "removed after an hour)")
        if report["quarantined_before"]:
            print(f"  {report['quarantined_before']} part(s) quarantined earlier, in {path}/quarantine")
        if report["problems"] and not a.repair:
            print("  run again with --repair to rebuild the manifest / quarantine bad parts")
    return 0 if ok else 1


def cmd_sql(a) -> int:
    from ttftscope.schemas.store import StoreError, open_store

    q = sys.stdin.read() if a.query == "-" else a.query
    params = {}
    for p in a.param:
        k, sep, v = p.partition("=")
        if not sep:
            print(f"ttftscope sql: --param needs NAME=VALUE, got {p!r}", file=sys.stderr)
            return 2
        params[k] = v
    try:
        store = open_store(a.store, create=False)
        out = store.query_text(q, _FORMATS[a.format], params or None)
    except StoreError as e:
        print(f"ttftscope sql: {e}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    return 0


def cmd_schema(a) -> int:
    import orjson

    from ttftscope.schemas import ddl, vocabulary

    if a.what == "vocabulary":
        sys.stdout.write(orjson.dumps(vocabulary.as_dict(), option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    try:
        o = ddl.DDLOptions(database=a.database, cluster=a.cluster, ttl_days=a.ttl_days)
    except ValueError as e:
        print(f"ttftscope schema: {e}", file=sys.stderr)
        return 2
    for st in ddl.all_statements(o):
        print(st + ";\n")
    return 0


def _store_or_fail(url, cmd: str):
    from ttftscope.schemas.store import StoreError, open_store

    try:
        return open_store(url, create=False)
    except StoreError as e:
        print(f"ttftscope {cmd}: {e}", file=sys.stderr)
        return None


def cmd_analyze(a) -> int:
    import orjson

    from ttftscope.analyzer import SLO, Analyzer, render_text
    from ttftscope.analyzer.report import _stderr_progress
    from ttftscope.schemas.store import StoreError

    try:
        w, slo = _window(a), SLO.from_arg(a.slo)
    except ValueError as e:
        print(f"ttftscope analyze: {e}", file=sys.stderr)
        return 2
    store = _store_or_fail(a.store, "analyze")
    if store is None:
        return 2
    try:
        r = Analyzer(store).analyze(w, slo, None if a.quiet or a.json else _stderr_progress)
    except StoreError as e:
        print(f"ttftscope analyze: {e}", file=sys.stderr)
        return 2
    if a.json:
        sys.stdout.write(orjson.dumps(r, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
    else:
        sys.stdout.write(render_text(r, markdown=a.markdown))
    return 1 if r.get("slo", {}).get("violated") else 0


def _side(spec: str, a):
    from ttftscope.analyzer.window import Window, parse_time

    base = _window(a)
    k, sep, v = spec.partition("=")
    if sep and k in ("version", "run", "model"):
        return Window(base.since_ns, base.until_ns, **{**{"model": a.model, "version": a.version, "run": a.run}, k: v})
    lo, sep, hi = spec.partition("..")
    if sep:
        return Window(parse_time(lo), parse_time(hi), a.model, a.version, a.run)
    raise ValueError(f"cannot read {spec!r}: use version=X, run=X or START..END")


def cmd_compare(a) -> int:
    import orjson

    from ttftscope.analyzer import Analyzer
    from ttftscope.analyzer.compare import significant_shifts

    try:
        wa, wb = _side(a.a, a), _side(a.b, a)
    except ValueError as e:
        print(f"ttftscope compare: {e}", file=sys.stderr)
        return 2
    store = _store_or_fail(a.store, "compare")
    if store is None:
        return 2
    r = Analyzer(store).compare(wa, wb)
    r["a"]["label"], r["b"]["label"] = a.a, a.b
    r["significant"] = significant_shifts(r)
    if a.json:
        sys.stdout.write(orjson.dumps(r, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    if "error" in r:
        print(f"ttftscope compare: {r['error']} (A: {r['a']['requests']}, B: {r['b']['requests']})", file=sys.stderr)
        return 1
    print(f"A = {a.a} ({r['a']['requests']} requests)   B = {a.b} ({r['b']['requests']} requests)")
    print(f"{'phase':<10} {'median A ms':>12} {'median B ms':>12} {'shift':>8} {'p-value':>9}")
    for k, v in r["phases"].items():
        mark = " *" if any(s["phase"] == k for s in r["significant"]) else ""
        print(f"{k:<10} {v['median_a_ms']:>12.2f} {v['median_b_ms']:>12.2f} {v['shift']:>+8.1%} {v['p_value']:>9.2g}{mark}")
    print("* significant (p < 0.001, shift >= 10%)")
    return 0


def cmd_export(a) -> int:
    import orjson

    from ttftscope.analyzer import export_perfetto

    store = _store_or_fail(a.store, "export")
    if store is None:
        return 2
    try:
        kw = {"trace_ids": a.trace_id} if a.trace_id else {"request_ids": a.request_id} if a.request_id else {
            "window": _window(a), "limit": a.limit}
        doc = export_perfetto(store, **kw)
    except ValueError as e:
        print(f"ttftscope export: {e}", file=sys.stderr)
        return 2
    data = orjson.dumps(doc)
    if a.output == "-":
        sys.stdout.buffer.write(data + b"\n")
    else:
        with open(a.output, "wb") as f:
            f.write(data)
        n = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X")
        print(f"wrote {n} spans to {a.output} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    return 0 if doc["traceEvents"] else 1


def cmd_synth(a) -> int:
    import orjson

    from ttftscope.analyzer import synth
    from ttftscope.schemas.store import StoreError, default_store_url, open_store

    if a.scenario not in synth.SCENARIOS:
        print(f"ttftscope synth: unknown scenario {a.scenario!r}; choose from {', '.join(synth.SCENARIOS)}", file=sys.stderr)
        return 2
    if a.requests < 1:
        print("ttftscope synth: --requests must be >= 1", file=sys.stderr)
        return 2
    try:
        store = open_store(a.store or default_store_url())
    except StoreError as e:
        print(f"ttftscope synth: {e}", file=sys.stderr)
        return 2

    def progress(done: int, total: int) -> None:
        print(f"  {done:,}/{total:,} requests written", file=sys.stderr, flush=True)

    truth = synth.write(store, a.scenario, a.requests, seed=a.seed, progress=progress)
    sc = synth.SCENARIOS[a.scenario]
    print(f"wrote scenario {a.scenario!r} ({sc.description}): {a.requests:,} requests, run label {truth['run']}")
    if a.truth:
        with open(a.truth, "wb") as f:
            f.write(orjson.dumps(truth, option=orjson.OPT_INDENT_2))
    return 0


def _load_slo_or_fail(value, cmd: str):
    from ttftscope.schemas.slo import SLO

    try:
        return SLO.from_arg(value)
    except ValueError as e:  # SLOFileError too
        print(f"ttftscope {cmd}: {e}", file=sys.stderr)
        return None


def cmd_alerts(a) -> int:
    from ttftscope.alerts.rules import generate

    slo = _load_slo_or_fail(a.slo, "alerts")
    if slo is None:
        return 2
    for p in generate(slo, a.out):
        print(f"wrote {p}")
    print(f"check with: promtool check rules {a.out}/ttftscope-rules.yml && promtool test rules {a.out}/ttftscope-rules.test.yml "
          f"&& amtool check-config {a.out}/alertmanager.yml")
    return 0


def cmd_grafana(a) -> int:
    from ttftscope.dashboards.grafana import generate

    slo = _load_slo_or_fail(a.slo, "grafana")
    if slo is None:
        return 2
    hostport, _, dbname = a.clickhouse.partition("/")
    host, _, port = hostport.partition(":")
    try:
        paths = generate(a.out, targets_ms=slo.ttft_targets_ms, prometheus_url=a.prometheus_url, ch_host=host or "localhost",
                         ch_port=int(port or 8123), ch_db=dbname or "default")
    except ValueError as e:
        print(f"ttftscope grafana: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


def cmd_ui(a) -> int:
    import subprocess

    from ttftscope.schemas.store import default_store_url
    from ttftscope.servers import ui_command

    url = a.store or default_store_url()
    cmd, env = ui_command(url, a.port, a.host)
    if a.prometheus:
        env["TTFTSCOPE_PROMETHEUS"] = a.prometheus
    from ttftscope.schemas.store import redact_url

    print(f"ttftscope UI on http://{a.host}:{a.port} (store {redact_url(url)}); Ctrl-C stops it", flush=True)
    import signal

    child = subprocess.Popen(cmd, env=env)

    def _stop(signum, _frame) -> None:  # SIGTERM/SIGINT stop Streamlit too, not just us
        child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        rc = child.wait()
    except KeyboardInterrupt:
        child.terminate()
        rc = child.wait(30)
    return 0 if rc in (0, -signal.SIGTERM) else rc


def cmd_demo(a) -> int:
    from ttftscope.demo import run_demo
    from ttftscope.schemas.store import StoreError, default_store_url

    try:
        return run_demo(a.store or default_store_url(), quick=a.quick, ui=not a.no_ui, ui_port=a.ui_port, model=a.model,
                        tp2=False if a.no_tp2 else None, workdir=a.workdir)
    except StoreError as e:
        print(f"ttftscope demo: {e}", file=sys.stderr)
        return 1


def cmd_run(a) -> int:
    from ttftscope.sweep import run_command

    return run_command(a)


def cmd_sweep(a) -> int:
    from ttftscope.sweep import sweep_command

    return sweep_command(a)


def main(argv: list[str] | None = None) -> int:
    words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
    if words[:1] == ["collect"]:
        _collector_allocator()
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.command in ("demo", "run", "sweep"):
        # they start a collector and vLLM servers in sessions of their own: a SIGTERM (a CI
        # job's timeout, systemd, ``kill``) must stop them as Ctrl-C does, not leave them behind;
        # and SIGINT even where it came in ignored (a job started in the background by a shell
        # without job control: Python then keeps ignoring it, and ``kill -INT`` did nothing)
        import signal

        from .servers import INTERRUPTED, interrupt

        INTERRUPTED.clear()
        signal.signal(signal.SIGTERM, interrupt)
        signal.signal(signal.SIGINT, interrupt)
    return {"collect": cmd_collect, "sql": cmd_sql, "schema": cmd_schema, "demo": cmd_demo, "analyze": cmd_analyze,
            "compare": cmd_compare, "export": cmd_export, "synth": cmd_synth, "alerts": cmd_alerts,
            "grafana": cmd_grafana, "ui": cmd_ui, "store": cmd_store, "doctor": cmd_doctor, "run": cmd_run, "sweep": cmd_sweep}[a.command](a)


if __name__ == "__main__":
    raise SystemExit(main())
