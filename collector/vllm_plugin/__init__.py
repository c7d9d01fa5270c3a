"""The ttftscope vLLM plugin (entry point group ``vllm.general_plugins``).

``register()`` runs once in every vLLM process (API server, engine core, each worker). It
reads its configuration once (``PluginConfig.from_env``), sets up OpenTelemetry for the
process (OTLP/HTTP to the collector through a bounded, never-blocking pipeline; vLLM's own
spans share it) and installs the adapters of that process's role. Every adapter declares
the vLLM internals it touches; each is checked before the adapter is installed, and one
that is missing disables that adapter with one warning (``ttftscope doctor`` shows the same
table without starting vLLM). A hook that fails at run time disables itself, never vLLM.

Layout: ``config`` (the environment), ``adapters`` (the registry and its self-check),
``runtime`` (state, span sink, guard), one module per process role (``frontend``,
``engine``, ``worker``), ``coldstart``, ``forks`` (a process vLLM forks registers too) and
``handover`` (at a shutdown, the engine processes hand their spans over before vLLM kills them).

Environment: ``TTFTSCOPE_ENABLED=0`` turns it off; ``TTFTSCOPE_ENDPOINT`` (else the
standard ``OTEL_EXPORTER_OTLP_*``); ``TTFTSCOPE_SAMPLE_RATIO`` (else ``OTEL_TRACES_SAMPLER``
and ``_ARG``); ``TTFTSCOPE_RUN`` labels the run; ``TTFTSCOPE_PROFILE_EVERY=N``;
``TTFTSCOPE_SELF_TIMING=DIR``; ``TTFTSCOPE_DISABLE=adapter,...``; ``OTEL_BSP_*``;
``TTFTSCOPE_EXPORT_PROCESS=0`` keeps the export in the process (else an export sidecar,
``collector.handoff``, builds, encodes and posts the spans).
"""

from __future__ import annotations

import multiprocessing
import sys
import time

from ttftscope.schemas.vocabulary import ProcessRole

from .adapters import ADAPTERS, install_for
from .config import PluginConfig
from .runtime import RT, log, setup_otel, start_self_timing

__all__ = ["register", "detect_role", "PluginConfig", "ADAPTERS", "RT"]


def detect_role() -> str:
    """This process's role, from its multiprocessing name (vLLM names the processes it starts:
    ``EngineCore...``, ``...Worker...``, and ``ApiServer_<i>`` for each of ``vllm serve
    --api-server-count N``'s API servers) or else the command line (the API server that is
    the main process)."""
    name = multiprocessing.current_process().name
    if "EngineCore" in name:
        return ProcessRole.ENGINE_CORE.value
    if "Worker" in name:
        return ProcessRole.WORKER.value
    if name.startswith("ApiServer"):
        return ProcessRole.API_SERVER.value
    argv = " ".join(sys.argv)
    if "api_server" in argv or " serve" in argv or "openai" in argv:
        return ProcessRole.API_SERVER.value
    return ProcessRole.OTHER.value


def register() -> None:
    """The entry point vLLM calls in every process. Idempotent, cheap, no CUDA."""
    if RT.registered or not RT.config.enabled:
        return
    RT.registered = True
    RT.registered_at = time.time()
    try:
        role = detect_role()
        RT.role = role
        setup_otel(role)
        adapters = install_for(role, RT.config.disabled)
        start_self_timing(role)
        active = [a.name for a in adapters if a.state == "active"]
        log.info("ttftscope plugin active (%s): %s", role, ", ".join(active) or "no adapter")
    except Exception:  # noqa: BLE001
        log.exception("ttftscope plugin could not start; vLLM continues without it")
