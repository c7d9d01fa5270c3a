"""SLO: attainment of TTFT targets (per quantile, per priority class when requests carry one)."""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

DEFAULT_TARGETS_MS = {"p50": 350.0, "p95": 600.0, "p99": 800.0}
_Q = {"p50": 0.5, "p90": 0.9, "p95": 0.95, "p99": 0.99, "p999": 0.999}


@dataclass(frozen=True)
class SLO:
    ttft_ms: dict = field(default_factory=lambda: dict(DEFAULT_TARGETS_MS))
    priority_queue_ms: float = 200.0  # queue-wait ceiling (p99) for priority class "0"
    cold_start_s: float = 90.0

    def __post_init__(self) -> None:
        for k, v in self.ttft_ms.items():
            if k not in _Q:
                raise ValueError(f"unknown SLO quantile {k!r}: use one of {', '.join(_Q)}")
            if not v > 0:
                raise ValueError(f"SLO target for {k} must be > 0 ms, got {v!r}")

    @classmethod
    def parse(cls, spec: str | None) -> SLO:
        """'p50=350,p95=600,p99=800' (ms)."""
        if not spec:
            return cls()
        t = {}
        for part in spec.split(","):
            k, sep, v = part.partition("=")
            try:
                t[k.strip()] = float(v)
            except ValueError:
                raise ValueError(f"invalid SLO item {part!r}: use p99=800 (ms)") from None
            if not sep:
                raise ValueError(f"invalid SLO item {part!r}: use p99=800 (ms)")
        return cls(ttft_ms=t)


def attainment(df: pl.DataFrame, slo: SLO) -> dict:
    """Per class (all, and each priority): measured quantile vs target, and the share of
    requests under each target. ``violated`` lists the broken targets."""
    out: dict = {"targets_ms": slo.ttft_ms, "classes": {}, "violated": []}
    if df.height == 0:
        return out
    groups = [("all", df)]
    if "priority" in df.columns and df["priority"].n_unique() > 1:
        groups += [(f"priority={p}", df.filter(pl.col("priority") == p)) for p in sorted(df["priority"].unique().to_list()) if p]
    for name, g in groups:
        res = {}
        for q, target in slo.ttft_ms.items():
            measured = float(g["ttft"].quantile(_Q[q], "linear")) / 1e6
            ok = measured <= target
            res[q] = {"target_ms": target, "measured_ms": measured, "ok": ok,
                      "attainment": float((g["ttft"] <= target * 1e6).mean())}
            if not ok:
                out["violated"].append(f"{name}: TTFT {q} {measured:.0f} ms > {target:.0f} ms")
        if name == "priority=0" and "queue" in g.columns:
            qp99 = float(g["queue"].quantile(0.99, "linear")) / 1e6
            res["queue_p99"] = {"target_ms": slo.priority_queue_ms, "measured_ms": qp99, "ok": qp99 <= slo.priority_queue_ms}
            if qp99 > slo.priority_queue_ms:
                out["violated"].append(f"{name}: queue wait p99 {qp99:.0f} ms > {slo.priority_queue_ms:.0f} ms")
        out["classes"][name] = res
    return out
