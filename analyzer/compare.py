"""Compare: which phases shifted between two windows or deployments, and when TTFT changed.

Per phase: medians of both sides, relative shift, and a two-sided Mann-Whitney U test
(normal approximation, which is accurate at the sample sizes of a load test). Change points
over time: binary segmentation of per-interval TTFT medians with a Welch t-test.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from .decompose import PHASE_COLUMNS


def mann_whitney(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p-value of the Mann-Whitney U test (tie-corrected normal approximation)."""
    n1, n2 = len(a), len(b)
    if n1 < 3 or n2 < 3:
        return 1.0
    ranks = pl.Series(np.concatenate([a, b])).rank("average").to_numpy()
    r1 = ranks[:n1].sum()
    u = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    _, counts = np.unique(ranks, return_counts=True)
    tie = (counts**3 - counts).sum() / (n * (n - 1)) if n > 1 else 0.0
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie))
    if sigma == 0:
        return 1.0
    z = (u - n1 * n2 / 2) / sigma
    return math.erfc(abs(z) / math.sqrt(2))


def compare_frames(a: pl.DataFrame, b: pl.DataFrame, label_a: str = "A", label_b: str = "B") -> dict:
    out = {"a": {"label": label_a, "requests": a.height}, "b": {"label": label_b, "requests": b.height}, "phases": {}}
    if a.height == 0 or b.height == 0:
        out["error"] = "one side has no requests"
        return out
    for c in ["ttft", *PHASE_COLUMNS]:
        xa, xb = a[c].to_numpy(), b[c].to_numpy()
        ma, mb = float(np.median(xa)), float(np.median(xb))
        shift = (mb / ma - 1) if ma > 0 else (0.0 if mb == 0 else math.inf)
        out["phases"][c] = {"median_a_ms": ma / 1e6, "median_b_ms": mb / 1e6, "shift": shift,
                            "delta_ms": (mb - ma) / 1e6, "p_value": mann_whitney(xa, xb)}
    return out


def significant_shifts(cmp: dict, alpha: float = 1e-3, min_shift: float = 0.10, min_delta_ms: float = 0.5) -> list[dict]:
    return sorted(
        [{"phase": k, **v} for k, v in cmp.get("phases", {}).items()
         if k != "ttft" and v["p_value"] < alpha and abs(v["shift"]) >= min_shift and abs(v["delta_ms"]) >= min_delta_ms],
        key=lambda r: -abs(r["delta_ms"]))


def change_points(df: pl.DataFrame, bin_s: float | None = None, alpha: float = 1e-3, max_points: int = 3) -> list[dict]:
    """Times where the per-interval TTFT median shifted (binary segmentation + Welch t-test).

    ``bin_s`` defaults to a fortieth of the window (between 1 s and 5 min)."""
    if df.height == 0:
        return []
    if bin_s is None:
        span_s = (df["t0"].max() - df["t0"].min()) / 1e9
        bin_s = float(min(max(span_s / 40, 1.0), 300.0))
    s = (df.with_columns((pl.col("t0") // int(bin_s * 1e9)).alias("bin"))
         .group_by("bin").agg(pl.col("ttft").median().alias("m"), pl.len().alias("n")).sort("bin")
         .filter(pl.col("n") >= 5))
    if s.height < 8:
        return []
    x = s["m"].to_numpy().astype(float)
    bins = s["bin"].to_numpy()
    found: list[tuple[int, float, float, float]] = []

    def split(lo: int, hi: int, depth: int) -> None:
        if hi - lo < 8 or depth > max_points:
            return
        best, best_t = None, 0.0
        for k in range(lo + 3, hi - 3):
            a, b = x[lo:k], x[k:hi]
            va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
            if va + vb == 0:
                continue
            t = abs(a.mean() - b.mean()) / math.sqrt(va + vb)
            if t > best_t:
                best, best_t = k, t
        if best is None:
            return
        p = math.erfc(best_t / math.sqrt(2))
        if p < alpha:
            found.append((best, p, float(np.median(x[lo:best])), float(np.median(x[best:hi]))))
            split(lo, best, depth + 1)
            split(best, hi, depth + 1)

    split(0, len(x), 1)
    return [{"at_ns": int(bins[k] * bin_s * 1e9), "p_value": p, "ttft_median_before_ms": a / 1e6,
             "ttft_median_after_ms": b / 1e6} for k, p, a, b in sorted(found)][:max_points]
