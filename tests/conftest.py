"""Shared fixtures: real collector processes, the ClickHouse-HTTP fixture, CLI helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.procs import (  # noqa: F401 - the tests import these from here
    PY,
    ROOT,
    ClickHouseFixture,
    CollectorProc,
    VllmServer,
    free_port,
    still_running,
    ttftscope_sql,
    wait_http,
)


@pytest.fixture
def collector_factory(tmp_path):
    procs: list[CollectorProc] = []

    def make(store: str | None = None, spool: Path | None = None, **kw) -> CollectorProc:
        c = CollectorProc(store or str(tmp_path / "store"), spool or (tmp_path / "spool"), **kw)
        procs.append(c)
        return c

    yield make
    for c in procs:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait(10)


@pytest.fixture
def clickhouse(tmp_path):
    ch = ClickHouseFixture(tmp_path / "clickhouse").start()
    yield ch
    ch.stop()


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path, monkeypatch):
    """Never touch the user's real store or spool."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.delenv("TTFTSCOPE_STORE", raising=False)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("OTEL_SDK_DISABLED", "false")


