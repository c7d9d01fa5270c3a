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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ttftscope", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("collect", help="run the OTLP/HTTP collector service")
    _store_arg(c)
    c.add_argument("--listen", type=_listen, default=("127.0.0.1", 4318), metavar="HOST:PORT")
    c.add_argument("--token", default=os.environ.get("TTFTSCOPE_COLLECTOR_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (default: $TTFTSCOPE_COLLECTOR_TOKEN)")
    c.add_argument("--spool", default=None, metavar="DIR", help="on-disk spool (default: per store+listen)")
    c.add_argument("--max-spool", type=_size, default=1 << 30, metavar="SIZE",
                   help="refuse new spans (429/503) beyond this much spooled data (default 1G)")
    c.add_argument("--max-body", type=_size, default=16 << 20, metavar="SIZE", help="largest request (default 16M)")
    c.add_argument("--flush-interval", type=float, default=0.5, metavar="S", help="batch age before writing")
    c.add_argument("--retention-days", type=float, default=None, help="drop spans older than this")
    c.add_argument("--no-fsync", action="store_true", help="acknowledge before fsync (faster; a host crash may lose spans)")

    s = sub.add_parser("sql", help="run ClickHouse SQL over the store")
    _store_arg(s)
    s.add_argument("query", help="SQL, or - to read it from stdin")
    s.add_argument("--format", choices=["table", "csv", "json", "tsv"], default="table")
    s.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="bind {NAME:Type} in the query (repeatable)")

    d = sub.add_parser("demo", help="the main job on the embedded store (grows with each part)")
    _store_arg(d)
    d.add_argument("--requests", type=int, default=200, help="request traces to send (default 200)")
    d.add_argument("--quick", action="store_true", help="a short run")

    sc = sub.add_parser("schema", help="print the DDL or the vocabulary")
    sc.add_argument("what", choices=["ddl", "vocabulary"])
    sc.add_argument("--database", default="default")
    sc.add_argument("--cluster", default=None)
    sc.add_argument("--ttl-days", type=int, default=None)
    return ap


_FORMATS = {"table": "PrettyCompactMonoBlock", "csv": "CSVWithNames", "json": "JSON", "tsv": "TSVWithNames"}


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
    cfg = ServerConfig(host=a.listen[0], port=a.listen[1], max_body_bytes=a.max_body,
                       bearer_token=a.token or None, limits=Limits())
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


def cmd_demo(a) -> int:
    from ttftscope.demo import run_demo
    from ttftscope.schemas.store import StoreError, default_store_url

    try:
        return run_demo(a.store or default_store_url(), 50 if a.quick else a.requests)
    except StoreError as e:
        print(f"ttftscope demo: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"collect": cmd_collect, "sql": cmd_sql, "schema": cmd_schema, "demo": cmd_demo}[a.command](a)


if __name__ == "__main__":
    raise SystemExit(main())
