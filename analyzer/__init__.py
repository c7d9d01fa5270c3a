"""Turning spans into answers: one module per analysis behind one small facade.

    from ttftscope.analyzer import Analyzer, Window
    report = Analyzer(store).analyze(Window.last(3600))

decompose (TTFT split per request, exact) · gaps · steps (engine step anatomy) · findings
(the Finding type, the DETECTORS registry, the shared Context) · bottlenecks, engine_host and
chunking (detectors) · impact (what each finding costs in ms, severity against the SLO) · coldstart
· critical_path · compare (Mann-Whitney per phase, change points) · advise · slo · export
(Perfetto) · requests (per-request views for the UI) · synth (synthetic workloads with
planted causes, for scale and unit tests).
"""

from __future__ import annotations

from .compare import compare_frames
from .decompose import decompose
from .export import export_perfetto
from .report import analyze, render_text
from .slo import SLO
from .window import Window


class Analyzer:
    """The facade: every analysis over one store."""

    def __init__(self, store) -> None:
        self.store = store

    def analyze(self, window: Window, slo: SLO | None = None, progress=None) -> dict:
        return analyze(self.store, window, slo, progress)

    def decompose(self, window: Window):
        return decompose(self.store, window)

    def compare(self, a: Window, b: Window) -> dict:
        return compare_frames(decompose(self.store, a), decompose(self.store, b),
                              a.version or "A", b.version or "B")

    def export_perfetto(self, **kw) -> dict:
        return export_perfetto(self.store, **kw)

    def cold_start(self, window: Window, target_s: float = 90.0) -> list[dict]:
        from .coldstart import cold_start

        return cold_start(self.store, window, target_s)

    def request_spans(self, trace_id: str):
        from .requests import request_spans

        return request_spans(self.store, trace_id)

    def find_trace(self, text: str) -> str | None:
        from .requests import find_trace

        return find_trace(self.store, text)


__all__ = ["Analyzer", "Window", "SLO", "analyze", "render_text", "decompose", "export_perfetto"]
