"""The one store interface: insert Arrow span batches, run ClickHouse SQL, get polars back."""

from __future__ import annotations

import abc
from typing import Any

import polars as pl
import pyarrow as pa


class StoreError(RuntimeError):
    """A query or insert failed for a reason the caller should show (bad SQL, ...)."""


class StoreUnavailable(StoreError):
    """The store cannot be reached right now; retrying later may succeed."""


class Store(abc.ABC):
    """Spans in ``otel_traces``; the same ClickHouse SQL on every backend.

    Parameters bind with ClickHouse's own syntax, ``{name:Type}``, on both backends, so a
    value from a user never becomes SQL text.
    """

    url: str

    @abc.abstractmethod
    def ensure_schema(self) -> int:
        """Create or migrate the tables (idempotent). Returns the schema version."""

    @abc.abstractmethod
    def insert_spans(self, table: pa.Table, token: str) -> bool:
        """Insert a span batch in ``otel_traces`` layout.

        ``token`` makes the insert idempotent: a batch inserted twice with the same token is
        stored once. Returns False when the token was already applied.
        """

    @abc.abstractmethod
    def query_arrow(self, sql: str, parameters: dict[str, Any] | None = None) -> pa.Table:
        """Run one SELECT and return its result as Arrow."""

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> pl.DataFrame:
        """Run one SELECT and return its result as a polars frame."""
        return pl.from_arrow(self.query_arrow(sql, parameters))  # type: ignore[return-value]

    @abc.abstractmethod
    def query_text(self, sql: str, fmt: str = "PrettyCompact", parameters: dict[str, Any] | None = None) -> bytes:
        """Run one statement and return ClickHouse's own rendering in ``fmt``."""

    def apply_retention(self, days: float) -> int:  # noqa: B027 - optional
        """Drop data older than ``days`` days; returns parts/rows dropped where known."""
        return 0

    def maintain(self) -> None:  # noqa: B027 - optional
        """Background upkeep (merging small parts, cleaning up); cheap when idle."""

    def ping(self) -> None:
        """Raise :class:`StoreUnavailable` when the store cannot be reached."""
        self.query_arrow("SELECT 1")

    def close(self) -> None:  # noqa: B027 - optional
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
