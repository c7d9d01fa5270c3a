"""The one vocabulary of ttftscope: TTFT phases, our span names and attribute keys.

Everything else (plugin, analyzer, UI, dashboards, alerts) imports these names from here;
none of them spells a span name or an attribute key on its own. Bump ``VOCABULARY_VERSION``
when a name changes meaning, and record it on every span as ``ttftscope.schema_version``.
"""

from __future__ import annotations

from enum import Enum

VOCABULARY_VERSION = 2  # 2: TTFT as the client sees it (receive, intake, deliver; output -> deliver)


class Phase(str, Enum):
    """A phase of the time to first token (see DESIGN.md)."""

    LOAD = "load"  # weights to device, KV-cache allocation, warmup, graph capture
    RECEIVE = "receive"  # API server: HTTP receive, body parse, middleware, routing (before rendering)
    TOKENIZE = "tokenize"  # chat template + tokenizer in the API server
    INTAKE = "intake"  # API server -> engine core: IPC, then waiting for the busy engine loop
    QUEUE = "queue"  # engine core: queued -> first scheduled
    PREFILL = "prefill"  # forward passes over the prompt (one span per chunk)
    ALLREDUCE = "allreduce"  # tensor-parallel collectives inside prefill
    DELIVER = "deliver"  # first token produced -> output processing, detokenize, serialise, bytes written
    GAP = "gap"  # time inside TTFT no phase covers

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.value


PHASES: tuple[str, ...] = tuple(p.value for p in Phase)
#: Phases that a span can carry (``gap`` is derived, never emitted).
SPAN_PHASES: tuple[str, ...] = tuple(p.value for p in Phase if p is not Phase.GAP)

# --------------------------------------------------------------------------- span names
PREFIX = "ttftscope"


class SpanName:
    """Span names emitted by the ttftscope plugin and the synthetic generator."""

    REQUEST = "llm_request"  # vLLM's own per-request span (API server, kind SERVER)
    #: the client's TTFT window: request received -> first token bytes written (API server)
    HTTP = f"{PREFIX}.http"
    RECEIVE = f"{PREFIX}.receive"
    TOKENIZE = f"{PREFIX}.tokenize"
    INTAKE = f"{PREFIX}.intake"
    QUEUE = f"{PREFIX}.queue"
    PREFILL = f"{PREFIX}.prefill"  # one per chunk
    DELIVER = f"{PREFIX}.deliver"
    OUTPUT = f"{PREFIX}.output"  # vocabulary 1's deliver (ended when the output processor had the token)
    ALLREDUCE = f"{PREFIX}.allreduce"  # per worker rank and step (aggregated calls)
    ALLREDUCE_CALL = f"{PREFIX}.allreduce.call"  # one sampled collective
    STEP = f"{PREFIX}.step"  # one engine step (engine core / worker)
    LOAD = f"{PREFIX}.load"  # a loading sub-phase not covered by vLLM's spans
    PROCESS_START = f"{PREFIX}.process"  # process start -> ready (cold start)
    LOADTEST = f"{PREFIX}.loadtest"  # one `ttftscope run` / sweep point, with the benchmark's numbers


#: span name -> phase, for our own spans.
OWN_SPAN_PHASE: dict[str, str] = {
    SpanName.RECEIVE: Phase.RECEIVE.value,
    SpanName.TOKENIZE: Phase.TOKENIZE.value,
    SpanName.INTAKE: Phase.INTAKE.value,
    SpanName.QUEUE: Phase.QUEUE.value,
    SpanName.PREFILL: Phase.PREFILL.value,
    SpanName.DELIVER: Phase.DELIVER.value,
    SpanName.OUTPUT: Phase.DELIVER.value,
    SpanName.ALLREDUCE: Phase.ALLREDUCE.value,
    SpanName.ALLREDUCE_CALL: Phase.ALLREDUCE.value,
    SpanName.LOAD: Phase.LOAD.value,
}

#: vLLM's own start-up spans (``vllm.tracing.instrument``) -> phase.
VLLM_SPAN_PHASE: dict[str, str] = {
    name: Phase.LOAD.value
    for name in (
        "Load model",
        "Load weights",
        "Initialize model",
        "Loading (CPU)",
        "Loading (GPU)",
        "Allocate KV cache",
        "Prepare model",
        "Warmup (CPU)",
        "Warmup (GPU)",
        "Capture model",
        "Compile graph",
        "Worker init",
        "Executor init",
        "EngineCoreProc init",
        "API server setup",
    )
}

SPAN_PHASE: dict[str, str] = {**VLLM_SPAN_PHASE, **OWN_SPAN_PHASE}

# ----------------------------------------------------------------------- attribute keys


class Attr:
    """Span and resource attribute keys. ``gen_ai.*`` keys are vLLM's own."""

    # vLLM's llm_request span (values in seconds / counts)
    REQUEST_ID = "gen_ai.request.id"
    VLLM_TTFT = "gen_ai.latency.time_to_first_token"
    VLLM_E2E = "gen_ai.latency.e2e"
    VLLM_QUEUE = "gen_ai.latency.time_in_queue"
    VLLM_PREFILL = "gen_ai.latency.time_in_model_prefill"
    VLLM_DECODE = "gen_ai.latency.time_in_model_decode"
    VLLM_INFERENCE = "gen_ai.latency.time_in_model_inference"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    MODEL = "gen_ai.request.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"

    # ours
    PHASE = f"{PREFIX}.phase"
    SCHEMA_VERSION = f"{PREFIX}.schema_version"
    PRIORITY = f"{PREFIX}.priority"
    STEP = f"{PREFIX}.step"  # engine step number
    STEP_LAST = f"{PREFIX}.step.last"  # last step of a merged run of decode-only steps
    STEP_COUNT = f"{PREFIX}.step.count"  # steps in a merged run
    CHUNK = f"{PREFIX}.prefill.chunk"  # chunk index within a request's prefill
    TOKENS_COMPUTED = f"{PREFIX}.tokens.computed"
    TOKENS_CACHED = f"{PREFIX}.tokens.cached"  # served from the prefix cache
    PREFIX_HASH = f"{PREFIX}.prefix.hash"  # hash of the first 64 prompt tokens (first chunk only)
    BATCH_SIZE = f"{PREFIX}.batch.size"
    STEP_PREFILL_TOKENS = f"{PREFIX}.step.prefill_tokens"
    STEP_DECODE_TOKENS = f"{PREFIX}.step.decode_tokens"
    # a step's anatomy (ns; summed over a merged run): engine-core host time in schedule() and
    # update_from_output(), the workers' execution (and, with async scheduling, the wait for
    # it) in between, and the engine loop's idle time since the previous step closed
    STEP_SCHEDULE_NS = f"{PREFIX}.step.schedule_ns"
    STEP_EXECUTE_NS = f"{PREFIX}.step.execute_ns"
    STEP_UPDATE_NS = f"{PREFIX}.step.update_ns"
    STEP_IDLE_NS = f"{PREFIX}.step.idle_ns"
    RUNNING = f"{PREFIX}.scheduler.running"
    WAITING = f"{PREFIX}.scheduler.waiting"
    ENGINE = f"{PREFIX}.engine"  # which engine core a step, prefill or allreduce belongs to ("engine-<pid>")
    RANK = f"{PREFIX}.rank"
    TP_SIZE = f"{PREFIX}.tp_size"
    ALLREDUCE_COUNT = f"{PREFIX}.allreduce.count"
    ALLREDUCE_BYTES = f"{PREFIX}.allreduce.bytes"
    LOAD_STAGE = f"{PREFIX}.load.stage"
    SAMPLED = f"{PREFIX}.sampled"
    COLLECTIVE = f"{PREFIX}.collective"  # the profiler's name for a sampled collective call
    # the client's window (ttftscope.http)
    HTTP_STREAMING = f"{PREFIX}.http.streaming"  # true: SSE, TTFT ends at the first token's chunk
    HTTP_ROUTE = "http.route"
    HTTP_STATUS = "http.response.status_code"
    #: of a deliver span: ns from the first token produced until vLLM's output processor had it
    #: (vLLM's own TTFT ends there); the rest of deliver is after vLLM's window
    DELIVER_HANDLED_NS = f"{PREFIX}.deliver.handled_ns"


#: a trace header the plugin adds when the API server hands a request to the engine core
#: (wall-clock seconds): the start of ``intake``
HANDOFF_HEADER = f"{PREFIX}-handoff"


class ResourceAttr:
    """Resource attributes (process identity and run labels)."""

    SERVICE_NAME = "service.name"
    SERVICE_VERSION = "service.version"
    SERVICE_INSTANCE = "service.instance.id"
    HOST_NAME = "host.name"
    PROCESS_PID = "process.pid"
    ROLE = f"{PREFIX}.process.role"  # one of ProcessRole
    RUN = f"{PREFIX}.run"  # label of a demo / load-test run
    MODEL = f"{PREFIX}.model"


class ProcessRole(str, Enum):
    API_SERVER = "api_server"
    ENGINE_CORE = "engine_core"
    WORKER = "worker"
    OTHER = "other"


# ---------------------------------------------------------------- OTLP value spellings
#: SpanKind and StatusCode as the ClickHouse exporter writes them (new spelling).
SPAN_KINDS: tuple[str, ...] = ("Unspecified", "Internal", "Server", "Client", "Producer", "Consumer")
STATUS_CODES: tuple[str, ...] = ("Unset", "Ok", "Error")
#: Old spellings still accepted on read (older exporters wrote them).
LEGACY_SPAN_KIND = {f"SPAN_KIND_{k.upper()}": k for k in SPAN_KINDS}
LEGACY_STATUS_CODE = {f"STATUS_CODE_{s.upper()}": s for s in STATUS_CODES}


def phase_of(span_name: str) -> str | None:
    """Phase of a span name, or ``None`` for spans that are not a phase."""
    return SPAN_PHASE.get(span_name)


def phase_sql(span_name_col: str = "SpanName", attrs_col: str = "SpanAttributes") -> str:
    """ClickHouse expression mapping a span to its phase ('' when none).

    An explicit ``ttftscope.phase`` attribute wins over the name mapping, so other
    instrumentations can label their spans without ttftscope knowing their names.
    """
    by_phase: dict[str, list[str]] = {}
    for name, phase in SPAN_PHASE.items():
        by_phase.setdefault(phase, []).append(name)
    branches = []
    for phase, names in by_phase.items():
        quoted = ", ".join("'" + n.replace("'", "\\'") + "'" for n in sorted(names))
        branches.append(f"{span_name_col} IN ({quoted}), '{phase}'")
    return (
        f"multiIf({attrs_col}['{Attr.PHASE}'] != '', {attrs_col}['{Attr.PHASE}'], "
        + ", ".join(branches)
        + ", '')"
    )


def as_dict() -> dict:
    """The vocabulary as plain data (for docs, the UI and other languages)."""
    return {
        "version": VOCABULARY_VERSION,
        "phases": list(PHASES),
        "span_names": {k: v for k, v in vars(SpanName).items() if not k.startswith("_")},
        "span_phase": dict(SPAN_PHASE),
        "attributes": {k: v for k, v in vars(Attr).items() if not k.startswith("_")},
        "resource_attributes": {
            k: v for k, v in vars(ResourceAttr).items() if not k.startswith("_")
        },
        "process_roles": [r.value for r in ProcessRole],
    }
