"""Test-only: vLLM forks its engine core (and workers) as it does by default on a GPU host.

vLLM's CPU platform always spawns them (it sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``), so a
served test here would never see a forked child. On ``PYTHONPATH`` (as ``sitecustomize``), this
makes vLLM's one source of multiprocessing contexts hand out ``fork`` before any vLLM module
takes it by name, and notes each time it did in ``PLANTED_FORK_LOG``. Nothing else of vLLM is
changed."""

import multiprocessing
import os

try:
    from vllm.utils import system_utils

    def get_mp_context():
        log = os.environ.get("PLANTED_FORK_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} fork\n")
        return multiprocessing.get_context("fork")

    system_utils.get_mp_context = get_mp_context
except Exception:  # noqa: BLE001 - a process without vLLM (a helper) starts as usual
    pass
