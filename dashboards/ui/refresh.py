"""Stale-while-revalidate for the UI's analyses, so no viewer waits for a re-analysis.

A page asks for an answer by *slot* (what it shows: store, window choice, filters) and the
exact arguments of the moment (the window snapped to now, the live tick). When the slot's
last answer was computed for other arguments, or is older than ``ttl_s``, the page gets
that last answer at once and one background thread computes the new one; the next rerun
(the live fragment, a click) shows it. Only the very first view of a slot computes in the
foreground. Failures in the background keep the last answer and are reported with it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any


@dataclass
class Answer:
    value: Any
    args: tuple
    computed_at: float  # time.time() when the computation finished
    refreshing: bool = False
    error: str | None = None  # the last background failure, if any

    @property
    def age_s(self) -> float:
        return time.time() - self.computed_at


class StaleWhileRevalidate:
    """Last answer per slot, refreshed on a background thread (LRU-bounded)."""

    def __init__(self, ttl_s: float = 60.0, max_slots: int = 32) -> None:
        self.ttl_s = ttl_s
        self.max_slots = max_slots
        self._slots: OrderedDict[Hashable, Answer] = OrderedDict()
        self._lock = threading.Lock()
        self._first: dict[Hashable, threading.Lock] = {}

    def get(self, slot: Hashable, args: tuple, fn: Callable[..., Any]) -> Answer:
        """The answer for ``slot``: current if computed for ``args`` within ttl, else the
        last one while a refresh runs. Computes in the caller only when the slot is new."""
        with self._lock:
            a = self._slots.get(slot)
            if a is not None:
                self._slots.move_to_end(slot)
                stale = a.args != args or a.age_s >= self.ttl_s
                if stale and not a.refreshing:
                    a.refreshing = True
                    threading.Thread(target=self._refresh, args=(slot, a, args, fn), daemon=True,
                                     name="ttftscope-ui-refresh").start()
                return a
            first = self._first.setdefault(slot, threading.Lock())
        with first:  # two viewers opening the same new slot compute it once
            with self._lock:
                a = self._slots.get(slot)
            if a is not None:
                return a
            try:
                value = fn(*args)  # errors reach the page (no answer to fall back on)
            finally:
                with self._lock:
                    self._first.pop(slot, None)
            a = Answer(value, args, time.time())
            with self._lock:
                self._store(slot, a)
            return a

    def _refresh(self, slot: Hashable, old: Answer, args: tuple, fn: Callable[..., Any]) -> None:
        try:  # below the viewers' threads: a page render should not wait for the CPU behind a refresh
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # Linux: per-thread nice
        except (AttributeError, OSError):
            pass
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - shown next to the last answer, retried next view
            old.error = f"{type(e).__name__}: {e}"
            old.refreshing = False
            return
        with self._lock:
            self._store(slot, Answer(value, args, time.time()))
        old.refreshing = False

    def _store(self, slot: Hashable, a: Answer) -> None:
        self._slots[slot] = a
        self._slots.move_to_end(slot)
        while len(self._slots) > self.max_slots:
            self._slots.popitem(last=False)

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Block until no refresh runs (tests and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not any(a.refreshing for a in self._slots.values()):
                    return True
            time.sleep(0.05)
        return False
