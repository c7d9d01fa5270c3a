"""A test-only vLLM plugin that plants a cause of known size (never installed with ttftscope).

tests/conftest.py puts this directory (with a dist-info that registers the entry point
``vllm.general_plugins: planted``) on the vLLM server's PYTHONPATH. What it plants is chosen
by environment variables, read in the process where the cause belongs:

* ``PLANTED_DELIVER_STALL_MS``: the API server's event loop is blocked this long after every
  output batch it processes (as a slow detokenizer or a heavy middleware would), i.e. after
  vLLM's own TTFT clock stopped and before the bytes go out.
"""

from __future__ import annotations

import functools
import os
import sys
import time


def register() -> None:
    ms = float(os.environ.get("PLANTED_DELIVER_STALL_MS", "0") or 0)
    if ms <= 0 or "api_server" not in " ".join(sys.argv):
        return
    from vllm.v1.engine import output_processor as op

    orig = op.OutputProcessor.process_outputs
    if getattr(orig, "_planted", False):
        return

    @functools.wraps(orig)
    def process_outputs(self, *a, **kw):
        out = orig(self, *a, **kw)
        time.sleep(ms / 1000)  # blocks the event loop: every stream waits
        return out

    process_outputs._planted = True
    op.OutputProcessor.process_outputs = process_outputs
