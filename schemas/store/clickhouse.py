"""The ClickHouse server store (one node or a cluster) through clickhouse-connect.

URL: ``clickhouse://user:password@host:8123/database?cluster=NAME&ttl_days=N&secure=1``
(``clickhouses://`` = HTTPS). Inserts go as Arrow with ``insert_deduplication_token``, so a
batch replayed after a collector crash is stored once; queries come back as Arrow/polars.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import pyarrow as pa

from ..columns import ARROW_SCHEMA, COLUMN_NAMES
from ..ddl import MIGRATIONS_TABLE, SCHEMA_VERSION, TRACES, DDLOptions, migrations, migrations_table
from .base import Store, StoreError, StoreUnavailable

_TRUE = {"1", "true", "yes", "on"}


def _redact(url: str) -> str:
    u = urlparse(url)
    if u.password:
        return url.replace(f":{u.password}@", ":***@", 1)
    return url


class ClickHouseStore(Store):
    def __init__(self, url: str, *, create: bool = True, connect_timeout: float = 5.0, **_ignored) -> None:
        u = urlparse(url)
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        self.url = _redact(url)
        secure = u.scheme in ("clickhouses", "https") or q.get("secure", "").lower() in _TRUE
        self.database = (u.path or "/").strip("/") or "default"
        try:
            self.options = DDLOptions(
                database=self.database,
                cluster=q.get("cluster") or None,
                ttl_days=int(q["ttl_days"]) if q.get("ttl_days") else None,
            )
        except ValueError as e:
            raise StoreError(f"invalid store URL {self.url}: {e}") from None
        self._conn = dict(
            host=u.hostname or "localhost",
            port=u.port or (8443 if secure else 8123),
            username=unquote(u.username) if u.username else "default",
            password=unquote(u.password) if u.password else "",
            secure=secure,
            compress=q.get("compress", "lz4") if q.get("compress", "lz4").lower() not in ("0", "false", "none") else False,
            connect_timeout=connect_timeout,
            send_receive_timeout=float(q.get("timeout", 300)),
        )
        self._client = None
        self._create = create
        if create:
            self.ensure_schema()

    # ------------------------------------------------------------- connection
    def _connect(self, database: str | None):
        import clickhouse_connect
        from clickhouse_connect.driver.exceptions import ClickHouseError

        try:
            return clickhouse_connect.get_client(database=database, **self._conn)
        except ClickHouseError as e:
            raise self._wrap(e) from None

    @property
    def client(self):
        if self._client is None:
            self._client = self._connect(self.database)
        return self._client

    def _wrap(self, e: Exception) -> StoreError:
        from clickhouse_connect.driver.exceptions import OperationalError

        msg = str(e).strip()
        if isinstance(e, OperationalError) or "Connection refused" in msg or "timed out" in msg:
            return StoreUnavailable(f"ClickHouse at {self.url} unreachable: {msg.splitlines()[0] if msg else e!r}")
        return StoreError(msg)

    def _call(self, fn, *args, **kwargs):
        from clickhouse_connect.driver.exceptions import ClickHouseError

        try:
            return fn(*args, **kwargs)
        except ClickHouseError as e:
            if isinstance(self._wrap(e), StoreUnavailable):
                self._client = None
            raise self._wrap(e) from None

    # ------------------------------------------------------------------ schema
    def ensure_schema(self) -> int:
        o = self.options
        boot = self._connect(None)
        try:
            self._call(boot.command, f"CREATE DATABASE IF NOT EXISTS {o.database}{o.on_cluster}")
            self._call(boot.command, migrations_table(o))
            applied = self._call(
                boot.query, f"SELECT max(version) FROM {o.database}.{MIGRATIONS_TABLE}"
            ).result_rows[0][0] or 0
            if applied > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.url} has schema version {applied}, newer than this ttftscope ({SCHEMA_VERSION})"
                )
            for m in migrations(o):
                if m.version <= applied:
                    continue
                for st in m.statements:
                    self._call(boot.command, st)
                self._call(
                    boot.insert,
                    f"{o.database}.{MIGRATIONS_TABLE}",
                    [[m.version, m.description]],
                    column_names=["version", "description"],
                )
        finally:
            boot.close()
        return SCHEMA_VERSION

    # ---------------------------------------------------------------- writes
    def insert_spans(self, table: pa.Table, token: str) -> bool:
        if table.schema != ARROW_SCHEMA:
            table = table.select(list(COLUMN_NAMES)).cast(ARROW_SCHEMA)
        if table.num_rows == 0:
            return True
        settings = {"insert_deduplication_token": token, "deduplicate_blocks_in_dependent_materialized_views": 1}
        if self.options.cluster:
            settings["insert_distributed_sync"] = 1  # the token reaches the shards
        self._call(self.client.insert_arrow, TRACES, table, settings=settings)
        return True

    def apply_retention(self, days: float) -> int:
        """Drop whole daily partitions older than ``days`` (TTL does it too when set)."""
        o = self.options
        t = o.local(TRACES)
        rows = self.query_arrow(
            "SELECT DISTINCT partition_id FROM system.parts WHERE database = {db:String} AND table = {t:String} "
            "AND active AND max_time < now() - toIntervalSecond({s:UInt64})",
            {"db": o.database, "t": t, "s": int(days * 86400)},
        ).column(0).to_pylist()
        for pid in rows:
            self._call(self.client.command, f"ALTER TABLE {o.database}.{t}{o.on_cluster} DROP PARTITION ID '{pid}'")
        return len(rows)

    # ----------------------------------------------------------------- reads
    def query_arrow(self, sql: str, parameters: dict[str, Any] | None = None) -> pa.Table:
        return self._call(self.client.query_arrow, sql, parameters=parameters or None)

    def query_text(self, sql: str, fmt: str = "PrettyCompact", parameters: dict[str, Any] | None = None) -> bytes:
        return self._call(self.client.raw_query, sql, parameters=parameters or None, fmt=fmt)

    def ping(self) -> None:
        if not self._call(self.client.ping):
            raise StoreUnavailable(f"ClickHouse at {self.url} does not answer /ping")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
