"""Forked children start afresh: vLLM starts its engine core and workers by ``fork`` where it
can (``VLLM_WORKER_MULTIPROC_METHOD``'s default, kept on a GPU host while CUDA is not yet
initialized in the parent; vLLM's CPU platform always spawns). A forked child inherits vLLM's
"plugins loaded" flag, so vLLM never calls ``register()`` there, and it inherits this process's
plugin state: the parent's role (an engine core that thought it was the API server installed
no engine adapter), an export processor whose thread did not survive the fork, the parent's
exit hooks, its cold start already reported. Here the state is reset in the child at the fork,
and ``register()`` runs when vLLM loads plugins in it (``EngineCore.__init__``,
``WorkerBase.__init__``), before vLLM's own loader, which does nothing there. Only this plugin
runs again: the other plugins' patches were inherited, and running them twice could wrap a
method twice."""

from __future__ import annotations

import functools
import os

from . import coldstart
from .adapters import ENGINE, FRONTEND, WORKER, Internal, adapter
from .runtime import RT, Runtime, reset_exit_hooks

_FOLLOWING = [False]  # inherited by a forked child: the fork handler and the loader's wrapper are, too


@adapter("fork", roles=FRONTEND | ENGINE | WORKER,
         what="a process vLLM forks (engine core, workers) registers as what it is, with its own export",
         internals=[Internal("vllm.plugins", "load_general_plugins")])
def _install_fork_follow() -> None:
    if _FOLLOWING[0]:
        return
    import vllm.plugins as plugins

    orig = plugins.load_general_plugins

    @functools.wraps(orig)
    def load_general_plugins(*a, **kw):
        if not RT.registered:  # a forked child (elsewhere vLLM's loader below calls register)
            from . import register

            register()
        return orig(*a, **kw)

    plugins.load_general_plugins = load_general_plugins
    os.register_at_fork(after_in_child=forked)
    _FOLLOWING[0] = True


def forked() -> None:
    """In a forked child: nothing of the parent's plugin state is this process's (its spans
    still queued there are the parent's to send). Configuration is kept (read once, the same
    environment)."""
    RT.__dict__.update(Runtime(RT.config).__dict__)
    reset_exit_hooks()
    coldstart.forked()
