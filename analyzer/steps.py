"""Step anatomy: where each engine step's time goes (host overhead vs model time).

From the ``ttftscope.step`` spans (one per step; merged runs of decode-only steps carry the
sums of their steps): engine-core host time in ``schedule()`` and ``update_from_output()``,
the workers' execution between them, and the engine loop's idle time since the previous
step closed. The first split a vLLM performance engineer looks at: a host share of tens of
percent means the GPU (or here the CPU model) waits on Python. With async scheduling (vLLM's
default on GPU) the engine core schedules a step and processes the last one's output while the
workers run the step before: that host time (``host_hidden``) keeps no worker waiting and is
left out of the host share.
"""

from __future__ import annotations

import polars as pl
from ttftscope.schemas.vocabulary import Attr, SpanName

from .window import Window

_PARTS = {"schedule": Attr.STEP_SCHEDULE_NS, "execute": Attr.STEP_EXECUTE_NS, "update": Attr.STEP_UPDATE_NS,
          "idle": Attr.STEP_IDLE_NS}


def step_anatomy(store, window: Window) -> dict:
    """Totals and per-step means (µs) of schedule / execute / update / idle, split into
    steps that computed prompt tokens and decode-only steps; ``host`` is the host time the
    workers waited for, schedule + update - hidden (``hidden``: what ran while a step was in
    flight, async scheduling's; 0 without it), and ``host_share`` host / (host + execute)."""
    cols = ", ".join(f"sum(toUInt64OrZero(SpanAttributes['{k}'])) AS {p}"
                     for p, k in {**_PARTS, "hidden": Attr.STEP_HOST_HIDDEN_NS}.items())
    df = store.query(f"""
        SELECT toUInt64OrZero(SpanAttributes['{Attr.STEP_PREFILL_TOKENS}']) > 0 AS prefill,
               sum(greatest(toUInt64OrZero(SpanAttributes['{Attr.STEP_COUNT}']), 1)) AS steps, {cols}
        FROM otel_traces
        WHERE SpanName = '{SpanName.STEP}' AND {Window.time_filter()}
          AND mapContains(SpanAttributes, '{Attr.STEP_SCHEDULE_NS}')
        GROUP BY prefill""", window.params())
    out: dict = {}
    for row in df.iter_rows(named=True):
        kind = "prefill_steps" if row["prefill"] else "decode_steps"
        out[kind] = _per_step(row, int(row["steps"]))
    if out:
        steps = sum(v["steps"] for v in out.values())
        out["all"] = _per_step({p: sum(v[f"{p}_us_per_step"] * v["steps"] * 1e3 for v in out.values())
                                for p in (*_PARTS, "hidden")}, steps)
    return out


def _per_step(tot: dict, steps: int) -> dict:
    """From totals (ns) over ``steps`` steps: the per-step means (µs), the host time the workers
    waited for, and its share (see :func:`step_anatomy`)."""
    host = max(tot["schedule"] + tot["update"] - tot["hidden"], 0)
    busy = host + tot["execute"]
    return {"steps": steps, **{f"{p}_us_per_step": tot[p] / steps / 1e3 for p in (*_PARTS, "hidden")},
            "host_us_per_step": host / steps / 1e3, "host_share": host / busy if busy else 0.0}


def prefill_steps(store, window: Window) -> pl.DataFrame:
    """One row per engine step that computed prompt tokens: its duration (schedule start ->
    update end, ns), its execute time, and the prompt and decode tokens it computed (of the prompt
    tokens, ``recompute_tokens`` recomputed for requests a preemption had taken the KV cache from)."""
    a = lambda k: f"toUInt64OrZero(SpanAttributes['{k}'])"  # noqa: E731
    return store.query(f"""
        SELECT toInt64(Duration) AS dur_ns, toInt64({a(Attr.STEP_EXECUTE_NS)}) AS execute_ns,
               toInt64({a(Attr.STEP_PREFILL_TOKENS)}) AS prefill_tokens, toInt64({a(Attr.STEP_DECODE_TOKENS)}) AS decode_tokens,
               toInt64({a(Attr.STEP_RECOMPUTE_TOKENS)}) AS recompute_tokens
        FROM otel_traces
        WHERE SpanName = '{SpanName.STEP}' AND {Window.time_filter()} AND {a(Attr.STEP_PREFILL_TOKENS)} > 0""",
                       window.params())
