"""A scheduler of the user's own, for ``--scheduler-cls planted_scheduler.CountingScheduler``
(test-only, never shipped): vLLM's ``Scheduler`` with a ``schedule`` of its own that counts its
calls (one byte a call appended to the file ``PLANTED_SCHEDULE_COUNT`` names) and then does
what vLLM's does. The witness that the ttftscope plugin never skips a subclass's override
(its quiet-step rest binds vLLM's base methods on the instance): this count against vLLM's
own count of engine steps."""

from __future__ import annotations

import os

from vllm.v1.core.sched.scheduler import Scheduler


class CountingScheduler(Scheduler):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._planted_fd = os.open(os.environ["PLANTED_SCHEDULE_COUNT"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def schedule(self, *a, **kw):
        os.write(self._planted_fd, b".")
        return super().schedule(*a, **kw)
