"""A collector for bench/ingest's fleet anatomy: the real ``ttftscope collect`` whose arrival
check and spool are taken out, so that what it costs per request is its HTTP handling alone.

Every request is parsed, routed and answered by the real receiver (``collector/server.py``),
but the body is neither checked nor kept: the answer says nothing was accepted, at once. Next
to the whole collector and the floor server (bench/http_floor.py) under the same senders, it
says where a fleet's per-request CPU goes. For measurement only: it stores nothing.
Run: ``python bench/http_only.py collect ARGS...`` (the arguments of ``ttftscope collect``)."""

from __future__ import annotations

import sys

from ttftscope.collector import server
from ttftscope.collector.otlp import DecodeReport

from ttftscope.cli import main


def _nothing_kept(body: bytes, kind: str, limits) -> tuple:
    return "ok", body, DecodeReport(accepted=0), False


if __name__ == "__main__":
    server._check = _nothing_kept
    sys.exit(main(sys.argv[1:]))
