"""The plugin's configuration, read once from the environment (``PluginConfig.from_env``).

ttftscope's own variables first, then the standard OpenTelemetry ones where they apply:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` for the endpoint,
``OTEL_TRACES_SAMPLER`` (+ ``_ARG``) for head sampling, ``OTEL_BSP_*`` for the export
queue, batch, interval and timeout.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_ENDPOINT = "http://127.0.0.1:4318/v1/traces"
#: the engine core's step-flush thread's period (seconds): it hands the steps the engine loop
#: logged to the export sidecar, which sorts them out (or, without one, sorts them out and folds
#: them itself) and takes the quiet-step sample. A thread's wake-up costs CPU whatever it
#: then does (60 us idle, 97 with another thread running Python, on this VM: a thread that only
#: sleeps and reads the clock), so four a second came to a third to a half of that thread's CPU at
#: 10 requests a second (computed from that and the thread's measured total). A step's spans wait
#: up to this long (and a run's ``RUN_IDLE_S`` more) before the export queue sees them
FOLD_EVERY_S = 1.0
_OFF = ("0", "false", "no", "off")


def _float(env: Mapping[str, str], key: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    try:
        v = float(env.get(key, default))
    except ValueError:
        return default
    if lo is not None:
        v = max(v, lo)
    if hi is not None:
        v = min(v, hi)
    return v


def _sample_ratio(env: Mapping[str, str]) -> tuple[float, str]:
    """(ratio, where it came from): TTFTSCOPE_SAMPLE_RATIO, else OTEL_TRACES_SAMPLER."""
    if "TTFTSCOPE_SAMPLE_RATIO" in env:
        return _float(env, "TTFTSCOPE_SAMPLE_RATIO", 1.0, 0.0, 1.0), "TTFTSCOPE_SAMPLE_RATIO"
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler in ("always_off", "parentbased_always_off"):
        return 0.0, f"OTEL_TRACES_SAMPLER={sampler}"
    if sampler in ("traceidratio", "parentbased_traceidratio"):
        return _float(env, "OTEL_TRACES_SAMPLER_ARG", 1.0, 0.0, 1.0), f"OTEL_TRACES_SAMPLER={sampler}"
    return 1.0, "default"


def _endpoint(env: Mapping[str, str]) -> str:
    if v := env.get("TTFTSCOPE_ENDPOINT"):
        return v
    if v := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return v
    if v := env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return v.rstrip("/") + "/v1/traces"
    return DEFAULT_ENDPOINT


#: the export threads' default interval (``OTEL_BSP_SCHEDULE_DELAY``, ms); see ``interval_s``
DEFAULT_INTERVAL_MS = 2000


@dataclass(frozen=True)
class PluginConfig:
    enabled: bool = True
    endpoint: str = DEFAULT_ENDPOINT
    #: head sampling of requests (a client's sampled traceparent flag wins)
    sample_ratio: float = 1.0
    sample_source: str = "default"
    run: str | None = None
    #: every N-th worker step under torch.profiler (0 = off): collectives in compiled code
    profile_every: int = 0
    #: TTFTSCOPE_SELF_TIMING: a directory for the plugin's own cost per process
    self_timing_dir: str | None = None
    #: OTEL_BSP_*: export queue (spans), batch, interval, timeout
    max_queue: int = 8192
    max_batch: int = 512
    #: an export thread wakes this often (or when ``max_batch`` spans wait): each wake-up costs
    #: ~1.3 ms of CPU in a serving process (a cold encode and a post; real vLLM through bench/overhead's
    #: harness, two interleaved rounds: export threads -36 to -52 % per request at 2 s against 0.5 s), and a span reaches the store
    #: within about this plus the collector's own 2-s flush. The OpenTelemetry SDK's default is 5 s.
    #: The API server's too (its event loop reads the clients' requests): the export thread gives
    #: the GIL away every ``otel_setup.YIELD_S`` of encoding, so a bigger batch does not hold it
    #: longer (README, "The vLLM plugin")
    interval_s: float = DEFAULT_INTERVAL_MS / 1000
    #: a loaded collector may take seconds to answer (it fsyncs before it acknowledges): only the
    #: export thread waits, and a batch that times out is counted failed, never sent twice
    export_timeout_s: float = 10.0
    #: TTFTSCOPE_EXPORT_PROCESS: hand the records to an export sidecar process that builds, encodes
    #: and posts them (``collector.handoff``), not the serving process's export thread
    export_process: bool = True
    #: TTFTSCOPE_EXPORT_LINGER_S: how long an export sidecar whose vLLM process has left keeps
    #: trying a collector that cannot take its spans (down, restarting) before it gives them up
    export_linger_s: float = 30.0
    #: TTFTSCOPE_STEPS_IN_SIDECAR: with an export sidecar, the engine core hands its logged steps
    #: over as they are and the sidecar sorts them out (``vllm_plugin.steps_handoff.StepSorter``); 0: its
    #: step-flush thread sorts them out in vLLM's process, as without a sidecar
    steps_in_sidecar: bool = True
    #: TTFTSCOPE_QUIET_STEPS: of the engine's quiet steps (decode only, nobody waiting, no prefill in
    #: progress: steps that cannot delay a first token), how many are observed one by one, in a
    #: row, once a second; between those samples the scheduler runs unwrapped (no Python of ours per
    #: step) and the stretch is one ``unobserved`` span. ``all``: every step observed (as always
    #: when the workers number their steps: an eager model with TP > 1, or profiler windows)
    quiet_steps: int | None = 8
    #: adapters switched off by name (TTFTSCOPE_DISABLE=a,b)
    disabled: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig:
        env = os.environ if env is None else env
        ratio, source = _sample_ratio(env)
        try:
            profile_every = max(int(env.get("TTFTSCOPE_PROFILE_EVERY", "0")), 0)
        except ValueError:
            profile_every = 0
        quiet = env.get("TTFTSCOPE_QUIET_STEPS", str(cls.quiet_steps)).strip().lower()
        try:
            quiet_steps = None if quiet == "all" else max(int(quiet), 0)
        except ValueError:
            quiet_steps = cls.quiet_steps
        return cls(
            enabled=env.get("TTFTSCOPE_ENABLED", "1").strip().lower() not in _OFF,
            endpoint=_endpoint(env),
            sample_ratio=ratio,
            sample_source=source,
            run=env.get("TTFTSCOPE_RUN") or None,
            profile_every=profile_every,
            quiet_steps=quiet_steps,
            self_timing_dir=env.get("TTFTSCOPE_SELF_TIMING") or None,
            max_queue=int(_float(env, "OTEL_BSP_MAX_QUEUE_SIZE", 8192, 64)),
            max_batch=int(_float(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512, 1)),
            interval_s=_float(env, "OTEL_BSP_SCHEDULE_DELAY", DEFAULT_INTERVAL_MS, 10) / 1000,
            export_timeout_s=_float(env, "OTEL_BSP_EXPORT_TIMEOUT", 10_000, 100) / 1000,
            export_process=env.get("TTFTSCOPE_EXPORT_PROCESS", "1").strip().lower() not in _OFF,
            export_linger_s=_float(env, "TTFTSCOPE_EXPORT_LINGER_S", cls.export_linger_s, 0, 3600),
            steps_in_sidecar=env.get("TTFTSCOPE_STEPS_IN_SIDECAR", "1").strip().lower() not in _OFF,
            disabled=frozenset(x.strip() for x in env.get("TTFTSCOPE_DISABLE", "").split(",") if x.strip()),
        )
