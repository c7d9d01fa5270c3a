"""Stores chosen by URL: ``clickhouse://user:pass@host:8123/db`` or a local path (embedded)."""

from __future__ import annotations

import os
from pathlib import Path

from .base import Store, StoreError, StoreUnavailable

ENV_STORE = "TTFTSCOPE_STORE"


def default_store_url() -> str:
    """``$TTFTSCOPE_STORE``, else a per-user data directory."""
    env = os.environ.get(ENV_STORE)
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "ttftscope" / "store")


def redact_url(url: str) -> str:
    """The store URL fit for a log line: a password becomes ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    if "://" not in url:
        return url
    u = urlsplit(url)
    if u.password is None:
        return url
    netloc = f"{u.username or ''}:***@{u.hostname or ''}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


def open_store(url: str | None = None, *, create: bool = True, **kwargs) -> Store:
    """Open the store a URL names (see the module docstring)."""
    url = url or default_store_url()
    if url.startswith(("clickhouse://", "clickhouses://", "http://", "https://")):
        from .clickhouse import ClickHouseStore

        return ClickHouseStore(url, **kwargs)
    if "://" in url and not url.startswith("file://"):
        scheme = url.split("://", 1)[0]
        raise StoreError(
            f"unknown store URL scheme {scheme!r}: use clickhouse://user:pass@host:8123/db "
            "or a local directory for the embedded store"
        )
    from .embedded import EmbeddedStore

    path = url[len("file://") :] if url.startswith("file://") else url
    return EmbeddedStore(path, create=create, **kwargs)


__all__ = ["Store", "StoreError", "StoreUnavailable", "open_store", "default_store_url", "redact_url", "ENV_STORE"]
