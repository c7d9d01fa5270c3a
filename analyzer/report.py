"""The facade: one call runs every analysis over a window and returns a stable report.

Report JSON schema (``schema: "ttftscope.report/1"``), every time in milliseconds unless
the key says ``_s`` / ``_ns``:
  window{since, until, model?, version?, run?}, requests,
  ttft_ms{p50,p95,p99,mean}, phases{<phase>{p50_ms,p95_ms,p99_ms,share}}, coarse_requests,
  tail{quantile, threshold_ms, requests, share{phase|gap_*: share}, slowest[{request_id,trace_id,ttft}]},
  bands[{band, requests, ttft_ms, phases_ms}], critical_path[{band, requests, path_ms{phase: mean ms}}],
  gaps{request{class{...}}, engine{...}},
  steps{prefill_steps|decode_steps|all{steps, schedule_us_per_step, execute_us_per_step, update_us_per_step,
        idle_us_per_step, hidden_us_per_step, host_us_per_step, host_share}},
  cold_start[{instance, role, cold_start_s, phases_s, phases[{name, start_s, seconds, within}], idle_s, idle_share,
             largest_gap, ...}],
  findings[{kind, severity, size, unit, score, title, evidence, impact_ms{p50,p95,p99}|null, affected_requests?,
            impact_at?}] (impact: how much that TTFT percentile drops without the cause; analyzer/impact.py), advice[{because, change, expected_effect, ...}],
  slo{targets_ms, classes, violated[]}, change_points[...], versions[...]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import polars as pl

from . import bottlenecks as bn
from .advise import advise
from .coldstart import cold_start, phase_text
from .compare import change_points
from .decompose import by_percentile_band, decompose, phase_stats, tail_attribution
from .findings import Context, run_detectors
from .gaps import engine_bubbles, request_gaps
from .slo import SLO, attainment
from .window import Window

SCHEMA = "ttftscope.report/1"


def _stderr_progress(step: int, total: int, what: str) -> None:
    print(f"[{step}/{total}] {what}", file=sys.stderr, flush=True)


def analyze(store, window: Window, slo: SLO | None = None,
            progress: Callable[[int, int, str], None] | None = None) -> dict:
    slo = slo or SLO()
    prog = progress or (lambda *a: None)
    t0 = time.perf_counter()
    total = 5
    prog(1, total, "decomposing TTFT per request (ClickHouse SQL)")
    df = decompose(store, window)
    report: dict = {"schema": SCHEMA, "window": window.describe(), "requests": df.height}
    if df.height == 0:
        report.update({"findings": [], "advice": [], "slo": attainment(df, slo), "cold_start": [],
                       "message": "no requests with a measurable TTFT in this window"})
        return report
    prog(2, total, f"phase statistics and tail attribution over {df.height} requests (polars)")
    stats = phase_stats(df)
    tpot = df.filter(pl.col("completion_tokens") > 1).select(
        ((pl.col("e2e") - pl.col("ttft")) / (pl.col("completion_tokens").cast(pl.Int64) - 1)).quantile(0.99)).item()
    stats["tpot_ms_p99"] = tpot / 1e6 if tpot is not None and tpot > 0 else None
    report.update({k: v for k, v in stats.items()})
    report["tail"] = tail_attribution(df, 0.99)
    report["bands"] = by_percentile_band(df)
    from .critical_path import path_by_band, request_phase_spans, walk_back

    report["critical_path"] = path_by_band(walk_back(request_phase_spans(store, window)), df)
    prog(3, total, "gaps: request gaps, engine bubbles, cold start")
    ctx = Context(store, window, slo, df)
    ctx.bubbles = engine_bubbles(store, window, steps=ctx.step_gaps)
    report["gaps"] = {"request": request_gaps(df), "engine": ctx.bubbles}
    ctx.cold = report["cold_start"] = cold_start(store, window, slo.cold_start_max_s)
    from .steps import step_anatomy

    ctx.steps = report["steps"] = step_anatomy(store, window)
    prog(4, total, "bottlenecks: detectors and ranking")
    findings = bn.rank(run_detectors(ctx))
    from .impact import calibrate

    findings = calibrate(findings, df, slo)
    report["findings"] = findings
    prog(5, total, "SLO attainment, change points, advice")
    report["slo"] = attainment(df, slo)
    report["change_points"] = change_points(df)
    report["versions"] = sorted(v for v in df["version"].unique().to_list() if v)
    report["advice"] = advise(findings, stats, report["slo"])
    report["elapsed_s"] = time.perf_counter() - t0
    return report


# ---------------------------------------------------------------------------- rendering

def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def render_text(r: dict, markdown: bool = False) -> str:
    h = (lambda s: f"\n## {s}\n") if markdown else (lambda s: f"\n{s}\n{'-' * len(s)}")
    w = r["window"]
    lines = [("# " if markdown else "") + f"ttftscope report — {w['since']} .. {w['until']}"
             + "".join(f", {k}={w[k]}" for k in ("model", "version", "run") if k in w)]
    if not r.get("requests"):
        lines.append(r.get("message", "no data"))
        return "\n".join(lines) + "\n"
    t = r["ttft_ms"]
    lines.append(f"{r['requests']:,} requests; TTFT p50 {_ms(t['p50'])} ms, p95 {_ms(t['p95'])} ms, p99 {_ms(t['p99'])} ms"
                 + (f" ({r['coarse_requests']} from stock vLLM spans only)" if r.get("coarse_requests") else ""))
    lines.append(h("Where TTFT goes"))
    if markdown:
        lines += ["| phase | p50 ms | p95 ms | p99 ms | share | p99-tail share |", "|---|---:|---:|---:|---:|---:|"]
    else:
        lines.append(f"{'phase':<10} {'p50 ms':>9} {'p95 ms':>9} {'p99 ms':>9} {'share':>7} {'tail':>7}")
    for p, v in r["phases"].items():
        tail = r["tail"]["share"].get(p, 0)
        if markdown:
            lines.append(f"| {p} | {_ms(v['p50_ms'])} | {_ms(v['p95_ms'])} | {_ms(v['p99_ms'])} | {v['share']:.1%} | {tail:.1%} |")
        else:
            lines.append(f"{p:<10} {_ms(v['p50_ms']):>9} {_ms(v['p95_ms']):>9} {_ms(v['p99_ms']):>9} {v['share']:>7.1%} {tail:>7.1%}")
    lines.append(h("Findings"))
    if not r["findings"]:
        lines.append("no findings: nothing stands out")
    for i, f in enumerate(r["findings"], 1):
        ids = f["evidence"].get("request_ids") or f["evidence"].get("trace_ids") or []
        imp = f.get("impact_ms")
        cost = (f"  (costs {imp['p50']:,.1f} ms at p50, {imp['p99']:,.1f} ms at p99)" if imp else "")
        lines.append(f"{i}. [{f['severity'].upper()}] {f['title']}{cost}"
                     + (f"  e.g. {', '.join(map(str, ids[:3]))}" if ids else ""))
    if r.get("advice"):
        lines.append(h("What to change"))
        for a in r["advice"]:
            lines.append(f"- {a['change']}  (because {a['because']}; expected: {a['expected_effect']})")
    if (st := r.get("steps", {}).get("all")):
        lines.append(h("Engine steps"))
        lines.append(f"{st['steps']:,} steps; per step: schedule {st['schedule_us_per_step']:,.0f} us, execute "
                     f"{st['execute_us_per_step']:,.0f} us, update {st['update_us_per_step']:,.0f} us, idle "
                     f"{st['idle_us_per_step']:,.0f} us; engine-core host share {st['host_share']:.0%}")
    if r.get("cold_start"):
        lines.append(h("Cold start"))
        for c in r["cold_start"]:
            lines.append(f"- {c['instance']}: {c['cold_start_s']:.1f} s (target {c['target_s']:.0f} s), idle {c['idle_share']:.0%}; "
                         + phase_text(c))
    lines.append(h("SLO"))
    for cls, res in r["slo"]["classes"].items():
        parts = [f"{q} {v['measured_ms']:.0f}/{v['target_ms']:.0f} ms {'ok' if v['ok'] else 'VIOLATED'}" for q, v in res.items()]
        lines.append(f"- {cls}: " + ", ".join(parts))
    if r.get("change_points"):
        lines.append(h("Change points"))
        for c in r["change_points"]:
            lines.append(f"- at {c['at_ns']}: TTFT median {c['ttft_median_before_ms']:.1f} -> {c['ttft_median_after_ms']:.1f} ms")
    return "\n".join(lines) + "\n"
