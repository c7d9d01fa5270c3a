"""The phase registry: every TTFT phase defined once, with everything derived from it.

A phase has a name (the value in spans, columns and metric labels), a label and a colour for
people, the span names that carry it (ours and vLLM's), its priority where phase spans
overlap in the per-request sweep, where a gap next to it belongs, whether its share of the
tail is a finding, and its healthy cost (the floor of its impact baseline). The
decomposition, the critical path, the collector's phase metrics, the findings and their
impact, Grafana and the UI all read this table; adding a phase is one :class:`PhaseSpec` here
(plus the plugin hook that emits its span).

A span's phase is its ``ttftscope.phase`` attribute when set (other instrumentations can
label their spans without ttftscope knowing their names), else the phase its name maps to.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .sql import in_list, quote
from .vocabulary import Attr, SpanName


@dataclass(frozen=True)
class PhaseSpec:
    name: str
    label: str
    colour: str
    doc: str
    #: priority in the sweep where a request's phase spans overlap (lower wins); None: the phase
    #: is not swept (allreduce is carved out of prefill; gap is what no span covers)
    sweep: int | None = None
    spans: tuple[str, ...] = ()  # our span names
    vllm_spans: tuple[str, ...] = ()  # vLLM's own span names
    #: a gap next to this phase is on the host before the engine has the request
    host_side: bool = False
    #: a large share of the tail's TTFT in this phase is a finding (``<name>_dominates``; not
    #: for compute: prefill and allreduce have their own detectors)
    dominance: bool = False
    #: what the phase costs on a healthy server whatever the load (an IPC hop, a JSON parse, one
    #: event-loop turn), the floor of the impact baseline; None: the window's 10th percentile
    healthy_ns: int | None = None


#: vLLM's start-up spans (``vllm.tracing.instrument`` in 0.32) that are loading work
_VLLM_LOAD = ("Load model", "Load weights", "Initialize model", "Loading (CPU)", "Loading (GPU)", "Allocate KV cache",
              "Prepare model", "Warmup (CPU)", "Warmup (GPU)", "Capture model", "Compile graph", "Worker init",
              "Executor init", "EngineCoreProc init", "API server setup")

#: In report order (the order of the decomposition's columns, legends and stacked bars).
REGISTRY: tuple[PhaseSpec, ...] = (
    PhaseSpec("load", "model loading", "#8c564b", "weights to device, KV-cache allocation, warm-up, graph capture",
              sweep=2, spans=(SpanName.LOAD,), vllm_spans=_VLLM_LOAD, dominance=True),
    PhaseSpec("receive", "receiving and parsing requests (API server)", "#bcbd22",
              "API server: bytes waiting for the event loop to accept and read them, body parse, middleware, routing",
              sweep=7, spans=(SpanName.RECEIVE,), host_side=True, dominance=True, healthy_ns=1_000_000),
    PhaseSpec("tokenize", "tokenization", "#17becf", "chat template and tokenizer in the API server",
              sweep=3, spans=(SpanName.TOKENIZE,), host_side=True, dominance=True, healthy_ns=1_000_000),
    PhaseSpec("intake", "waiting for the engine loop (intake)", "#e377c2",
              "API server -> engine core: IPC, then waiting for the busy engine loop",
              sweep=6, spans=(SpanName.INTAKE,), host_side=True, dominance=True, healthy_ns=1_000_000),
    PhaseSpec("queue", "queue wait", "#ff7f0e", "engine core: queued -> first scheduled", sweep=5,
              spans=(SpanName.QUEUE,), dominance=True, healthy_ns=0),
    PhaseSpec("prefill", "prefill", "#1f77b4", "forward passes over the prompt (one span per chunk)",
              sweep=1, spans=(SpanName.PREFILL,)),
    PhaseSpec("allreduce", "tensor-parallel collectives (allreduce)", "#9467bd",
              "tensor-parallel collectives inside prefill",
              spans=(SpanName.ALLREDUCE, SpanName.ALLREDUCE_CALL), dominance=True, healthy_ns=0),
    PhaseSpec("deliver", "delivery after the first token (API server)", "#2ca02c",
              "first token produced -> output processing, detokenize, serialise, bytes written",
              sweep=4, spans=(SpanName.DELIVER, SpanName.OUTPUT), dominance=True, healthy_ns=2_000_000),
    PhaseSpec("gap", "gap", "#d3d3d3", "time inside TTFT no phase covers"),
)
SPECS: dict[str, PhaseSpec] = {p.name: p for p in REGISTRY}
assert len({p.sweep for p in REGISTRY if p.sweep is not None}) == sum(p.sweep is not None for p in REGISTRY)

Phase = Enum("Phase", [(p.name.upper(), p.name) for p in REGISTRY], type=str, module=__name__)
Phase.__doc__ = "A phase of the time to first token (values: the registry's names)."
Phase.__str__ = lambda self: self.value  # type: ignore[method-assign]

PHASES: tuple[str, ...] = tuple(p.name for p in REGISTRY)
#: Phases that a span can carry (``gap`` is derived, never emitted).
SPAN_PHASES: tuple[str, ...] = tuple(p.name for p in REGISTRY if p.spans or p.vllm_spans)
#: Phases swept per request, by priority (lower wins where spans overlap).
SWEPT: tuple[PhaseSpec, ...] = tuple(sorted((p for p in REGISTRY if p.sweep is not None), key=lambda p: p.sweep))
GAP_SWEEP = 99  # the sweep priority of time no phase span covers
COLOURS: dict[str, str] = {p.name: p.colour for p in REGISTRY} | {"": "#7f7f7f"}
LABELS: dict[str, str] = {p.name: p.label for p in REGISTRY}
#: phases whose share of the tail is a finding of its own, and their healthy floors
DOMINANCE: tuple[str, ...] = tuple(p.name for p in REGISTRY if p.dominance)
HEALTHY_NS: dict[str, int] = {p.name: p.healthy_ns for p in REGISTRY if p.healthy_ns is not None}

OWN_SPAN_PHASE: dict[str, str] = {s: p.name for p in REGISTRY for s in p.spans}
VLLM_SPAN_PHASE: dict[str, str] = {s: p.name for p in REGISTRY for s in p.vllm_spans}
SPAN_PHASE: dict[str, str] = {**VLLM_SPAN_PHASE, **OWN_SPAN_PHASE}
LOAD_SPANS: tuple[str, ...] = tuple(s for s, ph in SPAN_PHASE.items() if ph == "load")


def phase_of(span_name: str, phase_attr: str = "") -> str | None:
    """Phase of a span (its ``ttftscope.phase`` attribute wins), ``None`` when it has none."""
    return phase_attr or SPAN_PHASE.get(span_name)


def phase_sql(span_name_col: str = "SpanName", attrs_col: str = "SpanAttributes") -> str:
    """ClickHouse expression of a span's phase ('' when none), as :func:`phase_of`."""
    by_phase: dict[str, list[str]] = {}
    for name, phase in SPAN_PHASE.items():
        by_phase.setdefault(phase, []).append(name)
    branches = [f"{span_name_col} IN ({in_list(names)}), {quote(ph)}" for ph, names in by_phase.items()]
    attr = f"{attrs_col}[{quote(Attr.PHASE)}]"
    return f"multiIf({attr} != '', {attr}, " + ", ".join(branches) + ", '')"


def sweep_sql(span_name_col: str = "SpanName", attrs_col: str = "SpanAttributes") -> str:
    """ClickHouse expression of a span's sweep priority (:data:`GAP_SWEEP` when not swept)."""
    ph = phase_sql(span_name_col, attrs_col)
    return f"transform({ph}, [{in_list(p.name for p in SWEPT)}], " \
           f"[{', '.join(str(p.sweep) for p in sorted(SWEPT, key=lambda p: p.name))}], {GAP_SWEEP})"


def is_phase_span_sql(span_name_col: str = "SpanName", attrs_col: str = "SpanAttributes",
                      phases: tuple[str, ...] | None = None) -> str:
    """ClickHouse condition: the span carries one of ``phases`` (default: every swept phase),
    by name or by its ``ttftscope.phase`` attribute. Cheap on the name index first."""
    phases = phases or tuple(p.name for p in SWEPT)
    names = [s for s, ph in SPAN_PHASE.items() if ph in phases]
    return (f"({span_name_col} IN ({in_list(names)}) OR "
            f"{attrs_col}[{quote(Attr.PHASE)}] IN ({in_list(phases)}))")
