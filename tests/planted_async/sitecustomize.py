"""Test-only: vLLM's engine with async scheduling, as it runs by default on a GPU host.

vLLM turns async scheduling on unless something rules it out (``VllmConfig``: the executor
supports it, no incompatible speculative method), so a GPU server runs the ``AsyncScheduler``
and the engine core's batch queue (the next step scheduled while the last one runs); its CPU
platform turns it off ("not required on CPU"), so a served test here would never see it. On
``PYTHONPATH`` (as ``sitecustomize``), this turns it back on after the CPU platform's
configuration, and notes in ``PLANTED_ASYNC_LOG`` each process that configured an engine so and
each ``AsyncScheduler`` built. Nothing else of vLLM is changed."""

import os
import sys


def _note(what: str) -> None:
    log = os.environ.get("PLANTED_ASYNC_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {what}\n")


try:
    if "ttftscope.collector.handoff" in getattr(sys, "orig_argv", ()):
        # the plugin's export sidecars: no vLLM engine there (importing vLLM's platform here
        # cost each one's start ~7 s of CPU, torch's import with it: measured twice)
        raise ImportError
    from vllm.platforms import cpu

    _orig = cpu.CpuPlatform.check_and_update_config.__func__

    @classmethod
    def check_and_update_config(cls, vllm_config):
        _orig(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True
        _note("async_scheduling")

    cpu.CpuPlatform.check_and_update_config = check_and_update_config

    from vllm.v1.core.sched import async_scheduler

    _init = async_scheduler.AsyncScheduler.__init__

    def __init__(self, *a, **kw):
        _init(self, *a, **kw)
        _note("AsyncScheduler")

    async_scheduler.AsyncScheduler.__init__ = __init__
except Exception:  # noqa: BLE001 - a process without vLLM (a helper) starts as usual
    pass
