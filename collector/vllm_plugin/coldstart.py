"""A process's cold start: one ``ttftscope.process`` span from process start to ready, with
the interpreter start and imports (until vLLM loaded the plugin) as a ``load`` child; vLLM's
own loading spans ("Load model", "Allocate KV cache", ...) sit next to it in the same store."""

from __future__ import annotations

import time

from ttftscope.schemas.phases import Phase
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

from .runtime import RT, guard, span

_DONE = [False]


def forked() -> None:
    """A forked child's cold start is its own (``forks``)."""
    _DONE[0] = False


@guard("process_ready")
def emit_process_ready(role: str, rank: int | None = 0) -> None:
    if _DONE[0] or RT.tracer is None:
        return
    _DONE[0] = True
    try:
        import psutil

        start = psutil.Process().create_time()
    except Exception:  # noqa: BLE001
        start = time.time()
    from opentelemetry import trace as ot

    now = time.time()
    root = RT.tracer.start_span(SpanName.PROCESS_START, start_time=int(start * 1e9), attributes={
        Attr.PHASE: Phase.LOAD.value, Attr.RANK: rank if rank is not None else 0, ResourceAttr.ROLE: role})
    reg = RT.registered_at or now
    span(SpanName.LOAD, start, min(reg, now), {Attr.PHASE: Phase.LOAD.value, Attr.LOAD_STAGE: "process start and imports"},
         ot.set_span_in_context(root))
    root.end(end_time=int(now * 1e9))
