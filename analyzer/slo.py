"""SLO attainment: TTFT targets per quantile, per priority class when requests carry one.
The SLO itself is ``schemas.slo.SLO`` (one model for the analyzer, alerts, dashboards, UI)."""

from __future__ import annotations

import polars as pl
from ttftscope.schemas.slo import QUANTILES, SLO

__all__ = ["SLO", "attainment"]

_Q = QUANTILES


def attainment(df: pl.DataFrame, slo: SLO) -> dict:
    """Per class (all, and each priority): measured quantile vs target, and the share of
    requests under each target. ``violated`` lists the broken targets."""
    out: dict = {"targets_ms": slo.ttft_targets_ms, "classes": {}, "violated": []}
    if df.height == 0:
        return out
    groups = [("all", df)]
    if "priority" in df.columns and df["priority"].n_unique() > 1:
        groups += [(f"priority={p}", df.filter(pl.col("priority") == p)) for p in sorted(df["priority"].unique().to_list()) if p]
    for name, g in groups:
        res = {}
        for q, target in slo.ttft_targets_ms.items():
            measured = float(g["ttft"].quantile(_Q[q], "linear")) / 1e6
            ok = measured <= target
            res[q] = {"target_ms": target, "measured_ms": measured, "ok": ok,
                      "attainment": float((g["ttft"] <= target * 1e6).mean())}
            if not ok:
                out["violated"].append(f"{name}: TTFT {q} {measured:.0f} ms > {target:.0f} ms")
        if name == "priority=0" and "queue" in g.columns:
            qp99 = float(g["queue"].quantile(0.99, "linear")) / 1e6
            res["queue_p99"] = {"target_ms": slo.queue_priority_p99_ms, "measured_ms": qp99, "ok": qp99 <= slo.queue_priority_p99_ms}
            if qp99 > slo.queue_priority_p99_ms:
                out["violated"].append(f"{name}: queue wait p99 {qp99:.0f} ms > {slo.queue_priority_p99_ms:.0f} ms")
        out["classes"][name] = res
    return out
