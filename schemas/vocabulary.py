"""The one vocabulary of ttftscope: our span names and attribute keys (phases: ``phases.py``).

Everything else (plugin, analyzer, UI, dashboards, alerts) imports these names from here;
none of them spells a span name or an attribute key on its own. Bump ``VOCABULARY_VERSION``
when a name changes meaning, and record it on every span as ``ttftscope.schema_version``.
"""

from __future__ import annotations

from enum import Enum

VOCABULARY_VERSION = 2  # 2: TTFT as the client sees it (receive, intake, deliver; output -> deliver)


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
    #: engine steps not observed one by one: quiet decode between samples (TTFTSCOPE_QUIET_STEPS);
    #: it keeps the engine's timeline whole (no false idle gap where steps ran unwatched)
    UNOBSERVED = f"{PREFIX}.step.unobserved"
    LOAD = f"{PREFIX}.load"  # a loading sub-phase not covered by vLLM's spans
    PROCESS_START = f"{PREFIX}.process"  # process start -> ready (cold start)
    LOADTEST = f"{PREFIX}.loadtest"  # one `ttftscope run` / sweep point, with the benchmark's numbers


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
    #: of a merged run's steps taken while requests waited, those in which every seat
    #: (``MAX_NUM_SEQS``) was held by running requests
    STEP_FULL = f"{PREFIX}.step.full"
    CHUNK = f"{PREFIX}.prefill.chunk"  # chunk index within a request's prefill
    TOKENS_COMPUTED = f"{PREFIX}.tokens.computed"
    TOKENS_CACHED = f"{PREFIX}.tokens.cached"  # served from the prefix cache
    #: the first block's hash of the prompt (PREFIX_BLOCK_TOKENS tokens; first chunk only)
    PREFIX_HASH = f"{PREFIX}.prefix.hash"
    #: chained hashes of the prompt's whole blocks, comma-separated (first chunk
    #: only, up to PREFIX_MAX_BLOCKS): two prompts share their first k blocks when their k-th agree
    PREFIX_CHAIN = f"{PREFIX}.prefix.chain"
    #: tokens in each block of PREFIX_HASH / PREFIX_CHAIN: vLLM's hash block size where its own
    #: block hashes were taken (prefix caching on), PREFIX_BLOCK where the plugin hashed the token ids
    PREFIX_BLOCK_TOKENS = f"{PREFIX}.prefix.block_tokens"
    #: the engine's KV-cache block size in tokens (first chunk only): a prefix-cache hit covers
    #: whole blocks, never the prompt's last token
    KV_BLOCK_SIZE = f"{PREFIX}.kv.block_size"
    BATCH_SIZE = f"{PREFIX}.batch.size"
    STEP_PREFILL_TOKENS = f"{PREFIX}.step.prefill_tokens"
    STEP_DECODE_TOKENS = f"{PREFIX}.step.decode_tokens"
    #: on a prefill chunk: the first after vLLM preempted the request in its prefill (a running
    #: request needed KV-cache blocks and none were free: vLLM frees the newest running request's),
    #: so the wait since its previous chunk was the preemption's, not the chunks' (analyzer: kv_preemption)
    PREFILL_RESUMED = f"{PREFIX}.prefill.resumed"
    #: of a step's prefill tokens, those recomputed for requests past their first token that a
    #: preemption had taken the KV cache from (their prompt and the tokens they had generated,
    #: less what the prefix cache kept): prompt-shaped work, but no first token waits on it
    STEP_RECOMPUTE_TOKENS = f"{PREFIX}.step.recompute_tokens"
    # a step's anatomy (ns; summed over a merged run): engine-core host time in schedule() and
    # update_from_output(), the workers' execution in between (with async scheduling from when
    # the step before was back: a step waits in vLLM's batch queue while that one runs), and the
    # engine loop's idle time since the previous step closed
    STEP_SCHEDULE_NS = f"{PREFIX}.step.schedule_ns"
    STEP_EXECUTE_NS = f"{PREFIX}.step.execute_ns"
    STEP_UPDATE_NS = f"{PREFIX}.step.update_ns"
    STEP_IDLE_NS = f"{PREFIX}.step.idle_ns"
    # host time that ran while the workers executed a step, so not on their path (async
    # scheduling, vLLM's default on GPU: a step's schedule while the one before it runs, and that
    # one's update while this one runs); absent (0) without it
    STEP_HOST_HIDDEN_NS = f"{PREFIX}.step.host_hidden_ns"
    RUNNING = f"{PREFIX}.scheduler.running"
    WAITING = f"{PREFIX}.scheduler.waiting"
    MAX_NUM_SEQS = f"{PREFIX}.scheduler.max_num_seqs"  # the seats (vLLM's --max-num-seqs), on steps with waiting
    ENGINE = f"{PREFIX}.engine"  # which engine core a step, prefill or allreduce belongs to ("engine-<pid>")
    RANK = f"{PREFIX}.rank"
    TP_SIZE = f"{PREFIX}.tp_size"
    ALLREDUCE_COUNT = f"{PREFIX}.allreduce.count"
    ALLREDUCE_BYTES = f"{PREFIX}.allreduce.bytes"
    LOAD_STAGE = f"{PREFIX}.load.stage"
    #: a load-test result (``ttftscope run`` / sweep): ``ttftscope.loadtest.<metric>``,
    #: ``...priority.<class>.<metric>``, ``...setting.<name>``
    LOADTEST = f"{PREFIX}.loadtest"
    SAMPLED = f"{PREFIX}.sampled"
    COLLECTIVE = f"{PREFIX}.collective"  # the profiler's name for a sampled collective call
    # the client's window (ttftscope.http)
    HTTP_STREAMING = f"{PREFIX}.http.streaming"  # true: SSE, TTFT ends at the first token's chunk
    #: of an http span (streaming): ns from the first chunk that carried a token without text (a
    #: token that decodes to nothing yet, a chat role chunk) to the first chunk with text: the
    #: engine generating more tokens, inside deliver but not the delivery path
    HTTP_TEXT_WAIT_NS = f"{PREFIX}.http.text_wait_ns"
    #: of an http span (streaming): chunks with a token but no text before the first with text
    HTTP_TEXT_WAIT_TOKENS = f"{PREFIX}.http.text_wait_tokens"
    HTTP_ROUTE = "http.route"
    HTTP_STATUS = "http.response.status_code"
    #: of a deliver span: ns from the first token produced until vLLM's output processor had it
    #: (vLLM's own TTFT ends there); the rest of deliver is after vLLM's window
    DELIVER_HANDLED_NS = f"{PREFIX}.deliver.handled_ns"
    #: of an intake span: ns from the API server's handoff until the engine core's input thread
    #: had the request (IPC and decoding); the rest of intake is the engine core's: the input
    #: thread's preprocessing, then the wait for the engine loop (busy in a step) to add it
    INTAKE_IPC_NS = f"{PREFIX}.intake.ipc_ns"


#: the block of prompt tokens the prefix hashes are taken over, and how many blocks the chain reaches
PREFIX_BLOCK, PREFIX_MAX_BLOCKS = 64, 64

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
    # vLLM's own tracer resource (vllm.tracing.otel.init_otel_tracer)
    VLLM_PROCESS_ID = "vllm.process_id"
    VLLM_PROCESS_NAME = "vllm.process_name"
    VLLM_MODULE = "vllm.instrumenting_module_name"


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


def as_dict() -> dict:
    """The vocabulary as plain data (for docs, the UI and other languages)."""
    from .phases import PHASES, SPAN_PHASE

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
