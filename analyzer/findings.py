"""Findings and the detectors that produce them: one type, one registry, one shared context.

A detector is a function from the :class:`Context` (the window, the SLO and everything the
report computed once: the per-request decomposition, cold starts, engine bubbles, step
anatomy) to zero or more :class:`Finding`. Each detector module registers its functions
with :func:`detector`; :func:`run_detectors` runs them all, so no detector re-queries what
another computed and adding one is one decorated function. ``impact.calibrate`` then gives
every finding its impact in milliseconds and its severity against the SLO.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypedDict

import polars as pl

from .slo import SLO
from .window import Window


class Finding(TypedDict, total=False):
    """What a detector reports (a plain dict, JSON as it is: CLI, UI, exports).

    ``size`` is the number the title states, in ``unit``; ``score`` ranks findings whose
    impact cannot be computed; ``evidence`` holds the numbers and the request/trace ids
    behind it. ``impact_ms`` ({p50, p95, p99}: how much TTFT would drop without the cause),
    ``affected_requests`` and ``impact_at`` are added by ``impact.calibrate``."""

    kind: str
    severity: str
    size: float
    unit: str
    score: float
    title: str
    evidence: dict
    impact_ms: dict | None
    affected_requests: int
    impact_at: str


def finding(kind: str, severity: str | None, size: float, unit: str, score: float, title: str,
            **evidence) -> Finding | None:
    """A finding, or None when the detector's verdict is ``None`` (nothing to report)."""
    if severity is None:
        return None
    return Finding(kind=kind, severity=severity, size=float(size), unit=unit, score=float(score), title=title,
                   evidence=evidence)


@dataclass
class Context:
    """Computed once per report and handed to every detector."""

    store: Any
    window: Window
    slo: SLO
    df: pl.DataFrame  # decompose(): one row per request
    cold: list[dict] = field(default_factory=list)  # coldstart.cold_start()
    bubbles: dict = field(default_factory=dict)  # gaps.engine_bubbles()
    steps: dict = field(default_factory=dict)  # steps.step_anatomy()

    @cached_property
    def step_gaps(self) -> pl.DataFrame:
        """gaps.step_gaps(): every engine step with the end of the one before it (queried on first use)."""
        from .gaps import step_gaps

        return step_gaps(self.store, self.window)

    @cached_property
    def prefill_steps(self) -> pl.DataFrame:
        """steps.prefill_steps(): the steps that computed prompt tokens (queried on first use)."""
        from .steps import prefill_steps

        return prefill_steps(self.store, self.window)

    @cached_property
    def chunk_cost(self):
        """chunking.chunk_cost(): what a prefill chunk costs in this window (fitted on first use)."""
        from .chunking import chunk_cost

        return chunk_cost(self.store, self.window, self.prefill_steps)

    @cached_property
    def total_ttft_ms(self) -> float | None:
        return float(self.df["ttft"].sum()) / 1e6 if self.df.height else None


Detector = Callable[[Context], list[Finding]]
DETECTORS: dict[str, Detector] = {}


def detector(name: str) -> Callable[[Detector], Detector]:
    """Register ``fn(ctx) -> [Finding]`` under ``name`` (at import of its module)."""
    def deco(fn: Detector) -> Detector:
        DETECTORS[name] = fn
        return fn
    return deco


def run_detectors(ctx: Context, only: list[str] | None = None) -> list[Finding]:
    """Every registered detector (or ``only`` those) over ``ctx``; findings unranked."""
    from . import bottlenecks, chunking, engine_host  # noqa: F401 - detector modules register themselves

    out: list[Finding] = []
    for name, fn in DETECTORS.items():
        if only is None or name in only:
            out += [f for f in fn(ctx) if f]
    return out
