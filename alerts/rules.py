"""Prometheus rules, promtool unit tests and an Alertmanager config, generated from the SLO file.

Every alert carries a severity, a summary, a description and runbook + UI links; every alert
also gets a promtool test that makes it fire on a crafted bad series and stay silent on a
healthy one, so ``promtool test rules`` proves the rule, not just its syntax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from ttftscope.schemas import metrics as M
from ttftscope.schemas.slo import QUANTILES, SLO


@dataclass
class Hist:
    """A crafted histogram input: every observation at ``value`` seconds, ``rate`` per minute."""

    metric: str
    labels: dict
    value: float
    buckets: tuple = M.SECONDS_BUCKETS
    rate: int = 60


@dataclass
class Case:
    series: list  # Hist or (series string, values string)
    labels: dict  # expected labels of the firing alert (besides alertname/severity)


@dataclass
class AlertDef:
    name: str
    expr: str
    severity: str
    summary: str
    description: str
    group: str
    for_: str = "5m"
    bad: Case | None = None
    healthy: list = field(default_factory=list)
    eval_minutes: int = 30
    samples: int = 60
    value: float | None = None  # $value when the bad case fires (derived below when None)


def _promql_str(v: str) -> str:
    """``v`` escaped for a PromQL double-quoted label value."""
    return v.replace("\\", "\\\\").replace('"', '\\"')


def _quantile(metric: str, q: float, by: str, matcher: str = "", window: str = "5m") -> str:
    m = f"{{{matcher}}}" if matcher else ""
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{m}[{window}])))"


def _bucket_at_or_below(seconds: float) -> float:
    """The largest TTFT bucket boundary <= seconds (burn rates need a bucket edge)."""
    return max([b for b in M.SECONDS_BUCKETS if b <= seconds] or [M.SECONDS_BUCKETS[0]])


def _vllm_by_model(expr: str) -> str:
    """A vLLM series (label ``model_name``) relabelled ``model`` to join ttftscope's."""
    return f'label_replace({expr}, "model", "$1", "model_name", "(.*)")'


def _ttft(model: str, value: float) -> Hist:
    """A crafted client-TTFT histogram (the collector's, from ttftscope.http spans)."""
    return Hist(M.TTFT, {"model": model, "priority": "", "streaming": "true"}, value)


def alert_defs(slo: SLO) -> list[AlertDef]:
    A: list[AlertDef] = []
    f = slo.alert_for
    # --- TTFT quantiles: the client's TTFT (ttftscope.http spans, request received -> first
    # token bytes written), not vLLM's internal histogram, which misses the API server's
    # receive and delivery paths ------------------------------------------------------
    overridden = sorted(slo.ttft_models)
    for qname, target_ms in slo.ttft_targets_ms.items():
        q, t = QUANTILES[qname], target_ms / 1000
        sev = "critical" if qname == "p50" else "warning"
        excl = f'model!~"{"|".join(_promql_str(m) for m in overridden)}"' if overridden else ""
        A.append(AlertDef(
            f"TTFT{qname.upper()}AboveTarget", f"{_quantile(M.TTFT, q, 'model', excl)} > {t}", sev,
            f"TTFT {qname} above {target_ms:g} ms on {{{{ $labels.model }}}}",
            f"TTFT {qname} (as clients see it) is {{{{ $value | humanizeDuration }}}} (target {target_ms:g} ms) "
            "over the last 5m.",
            "ttftscope-ttft", f,
            bad=Case([_ttft("m", 2 * t + 0.05)], {"model": "m"}),
            healthy=[_ttft("m", t / 4)]))
    for model, targets in sorted(slo.ttft_models.items()):
        for qname, target_ms in targets.items():
            q, t = QUANTILES[qname], target_ms / 1000
            sel = 'model="' + _promql_str(model) + '"'
            A.append(AlertDef(
                f"TTFT{qname.upper()}AboveTargetModel", f"{_quantile(M.TTFT, q, 'model', sel)} > {t}",
                "critical" if qname == "p50" else "warning",
                f"TTFT {qname} above {target_ms:g} ms on {model}",
                f"TTFT {qname} is {{{{ $value | humanizeDuration }}}} (model target {target_ms:g} ms).", "ttftscope-ttft", f,
                bad=Case([_ttft(model, 2 * t + 0.05)], {"model": model}),
                healthy=[_ttft(model, t / 4)]))
    for prio, targets in sorted(slo.ttft_priorities.items()):
        for qname, target_ms in targets.items():
            q, t = QUANTILES[qname], target_ms / 1000
            sel = 'priority="' + _promql_str(prio) + '"'
            A.append(AlertDef(
                f"TTFT{qname.upper()}AboveTargetPriority",
                f"{_quantile(M.TTFT, q, 'priority', sel)} > {t}", "critical",
                f"TTFT {qname} above {target_ms:g} ms for priority class {prio}",
                f"TTFT {qname} of priority {prio} is {{{{ $value | humanizeDuration }}}} (target {target_ms:g} ms).",
                "ttftscope-ttft", f,
                bad=Case([Hist(M.TTFT, {"priority": prio, "model": "m"}, 2 * t + 0.05)], {"priority": prio}),
                healthy=[Hist(M.TTFT, {"priority": prio, "model": "m"}, t / 4)]))
    # --- multi-window burn rate on the TTFT error budget -----------------------------
    edge = _bucket_at_or_below(slo.budget_threshold_ms / 1000)
    budget = 1 - slo.budget_objective
    for name, long_w, short_w, factor, sev, for_ in (("Fast", "1h", "5m", 14.4, "critical", "2m"),
                                                      ("Slow", "6h", "30m", 6.0, "warning", "15m")):
        A.append(AlertDef(
            f"TTFTErrorBudgetBurn{name}",
            f"ttftscope:ttft_slo_errors:ratio_rate{long_w} > {factor * budget:.6g} and "
            f"ttftscope:ttft_slo_errors:ratio_rate{short_w} > {factor * budget:.6g}", sev,
            f"TTFT error budget burning {factor}x too fast on {{{{ $labels.model }}}}",
            f"{{{{ $value | humanizePercentage }}}} of requests over {long_w} took longer than {edge * 1000:g} ms "
            f"(objective {slo.budget_objective:.2%} within {slo.budget_threshold_ms:g} ms; bucket edge {edge:g} s).",
            "ttftscope-ttft-burn", for_,
            bad=Case([_ttft("m", edge * 4 + 0.1)], {"model": "m"}),
            healthy=[_ttft("m", edge / 4)],
            eval_minutes=400, samples=420))
    # --- phases (from ttftscope's span-derived metrics) ------------------------------
    A.append(AlertDef(
        "TTFTQueueWaitShareHigh",
        f'sum by (model) (rate({M.PHASE_DURATION}_sum{{phase="queue"}}[5m])) / sum by (model) (rate({M.TTFT}_sum[5m])) > {slo.queue_max_share}',
        "warning", "Queue wait is more than {} of TTFT on {{{{ $labels.model }}}}".format(f"{slo.queue_max_share:.0%}"),
        "Queueing takes {{ $value | humanizePercentage }} of TTFT: the engine is saturated (raise max_num_seqs / max_num_batched_tokens or scale out).",
        "ttftscope-phases", f,
        bad=Case([Hist(M.PHASE_DURATION, {"phase": "queue", "model": "m", "priority": "1"}, 0.9),
                  _ttft("m", 1.0)], {"model": "m"}),
        healthy=[Hist(M.PHASE_DURATION, {"phase": "queue", "model": "m", "priority": "1"}, 0.01),
                 _ttft("m", 1.0)]))
    t = slo.queue_priority_p99_ms / 1000
    sel = 'phase="queue",priority="0"'
    A.append(AlertDef(
        "PriorityQueueWaitHigh", f"{_quantile(M.PHASE_DURATION, 0.99, 'model', sel)} > {t}",
        "critical", f"Priority requests wait more than {slo.queue_priority_p99_ms:g} ms in the queue (p99)",
        "Queue wait p99 of priority class 0 is {{ $value | humanizeDuration }}.", "ttftscope-phases", f,
        bad=Case([Hist(M.PHASE_DURATION, {"phase": "queue", "model": "m", "priority": "0"}, 2 * t + 0.05)], {"model": "m"}),
        healthy=[Hist(M.PHASE_DURATION, {"phase": "queue", "model": "m", "priority": "0"}, t / 4)]))
    t = slo.allreduce_p99_ms / 1000
    A.append(AlertDef(
        "AllreduceLatencyHigh", f"{_quantile(M.ALLREDUCE, 0.99, 'rank')} > {t}", "warning",
        f"Tensor-parallel allreduce p99 above {slo.allreduce_p99_ms:g} ms on rank {{{{ $labels.rank }}}}",
        "Allreduce time per step p99 is {{ $value | humanizeDuration }}; check the interconnect / custom all-reduce.",
        "ttftscope-phases", f,
        bad=Case([Hist(M.ALLREDUCE, {"rank": "1"}, 2 * t + 0.05)], {"rank": "1"}),
        healthy=[Hist(M.ALLREDUCE, {"rank": "1"}, t / 4)]))
    for name, metric, tgt in (("TPOT", M.VLLM_TPOT, slo.tpot_p99_ms), ("ITL", M.VLLM_ITL, slo.itl_p99_ms)):
        t = tgt / 1000
        A.append(AlertDef(
            f"{name}P99AboveTarget", f"{_quantile(metric, 0.99, 'model_name')} > {t}", "warning",
            f"{name} p99 above {tgt:g} ms on {{{{ $labels.model_name }}}}", f"{name} p99 is {{{{ $value | humanizeDuration }}}}.",
            "ttftscope-decode", f,
            bad=Case([Hist(metric, {"model_name": "m"}, 2 * t + 0.05)], {"model_name": "m"}),
            healthy=[Hist(metric, {"model_name": "m"}, t / 4)]))
    # --- cold start, collector health, scale-out -------------------------------------
    A.append(AlertDef(
        "ColdStartSlow", f"max by (instance, role) ({M.COLD_START}) > {slo.cold_start_max_s:g}", "warning",
        f"Cold start of {{{{ $labels.instance }}}} above {slo.cold_start_max_s:g} s",
        "Process start to ready took {{ $value | humanizeDuration }}; see the Cold start page.", "ttftscope-coldstart", "0m",
        bad=Case([(f'{M.COLD_START}{{instance="w0",role="worker"}}', f"{2 * slo.cold_start_max_s:g}x60")], {"instance": "w0", "role": "worker"}),
        healthy=[(f'{M.COLD_START}{{instance="w0",role="worker"}}', f"{slo.cold_start_max_s / 2:g}x60")]))
    A.append(AlertDef(
        "CollectorDroppingSpans", f"sum by (instance) (increase({M.SPANS_DROPPED}[5m])) > 0", "warning",
        "The ttftscope collector refused spans (queue full)", "Spans were refused in the last 5m: the store is slow or down.",
        "ttftscope-collector", "1m",
        bad=Case([(f'{M.SPANS_DROPPED}{{instance="c"}}', "0+100x60")], {"instance": "c"}),
        healthy=[(f'{M.SPANS_DROPPED}{{instance="c"}}', "0x60")]))
    A.append(AlertDef(
        "CollectorStoreDown", f"max by (instance) ({M.STORE_UP}) == 0", "critical",
        "The ttftscope collector cannot write to its store", "Spans are spooled on local disk until the store is back.",
        "ttftscope-collector", "2m",
        bad=Case([(f'{M.STORE_UP}{{instance="c"}}', "0x60")], {"instance": "c"}),
        healthy=[(f'{M.STORE_UP}{{instance="c"}}', "1x60")]))
    A.append(AlertDef(
        "CollectorBacklog", f"max by (instance) ({M.QUEUE_SPANS}) > {slo.collector_max_queue_spans:g}", "warning",
        "The ttftscope collector has a backlog",
        f"More than {slo.collector_max_queue_spans:g} spans acknowledged but not yet in the store.",
        "ttftscope-collector", f,
        bad=Case([(f'{M.QUEUE_SPANS}{{instance="c"}}', f"{2 * slo.collector_max_queue_spans:g}x60")], {"instance": "c"}),
        healthy=[(f'{M.QUEUE_SPANS}{{instance="c"}}', "0x60")]))
    t95 = slo.ttft_targets_ms.get("p95", 600.0) / 1000
    A.append(AlertDef(
        "TTFTTracksLoadScaleOut",
        f"({_quantile(M.TTFT, 0.95, 'model')} > {t95}) and on (model) "
        f"({_vllm_by_model(f'sum by (model_name) ({M.VLLM_WAITING})')} > 0) and on (model) "
        f"({_vllm_by_model(f'max by (model_name) ({M.VLLM_KV_USAGE})')} > {slo.scale_out_kv_usage})", "warning",
        "TTFT tracks utilisation on {{ $labels.model }}: scale out",
        "TTFT p95 is {{ $value | humanizeDuration }} with requests waiting and the KV cache above "
        f"{slo.scale_out_kv_usage:.0%}: add replicas.", "ttftscope-capacity", f,
        bad=Case([_ttft("m", 2 * t95 + 0.05),
                  (f'{M.VLLM_WAITING}{{model_name="m"}}', "5x60"), (f'{M.VLLM_KV_USAGE}{{model_name="m"}}', "0.95x60")],
                 {"model": "m"}),
        healthy=[_ttft("m", 2 * t95 + 0.05),
                 (f'{M.VLLM_WAITING}{{model_name="m"}}', "0x60"), (f'{M.VLLM_KV_USAGE}{{model_name="m"}}', "0.3x60")]))
    p = slo.kv_max_preemptions_per_min
    A.append(AlertDef(
        "KVCachePreemptions", f"sum by (model_name) (rate({M.VLLM_PREEMPTIONS}[5m])) * 60 > {p:g}", "warning",
        "vLLM preempts requests on {{ $labels.model_name }}: its KV cache runs out",
        f"More than {p:g} requests a minute preempted (vLLM's own count): each waits for KV-cache blocks and computes "
        "its tokens again, in its prefill a wait its first token takes.", "ttftscope-capacity", f,
        bad=Case([(f'{M.VLLM_PREEMPTIONS}{{model_name="m"}}', f"0+{10 * p:g}x60")], {"model_name": "m"}),
        healthy=[(f'{M.VLLM_PREEMPTIONS}{{model_name="m"}}', f"0+{p / 4:g}x60")]))
    return A


def recording_rules(slo: SLO) -> list[dict]:
    edge = _bucket_at_or_below(slo.budget_threshold_ms / 1000)
    out = []
    for w in ("5m", "30m", "1h", "6h"):
        out.append({"record": f"ttftscope:ttft_slo_errors:ratio_rate{w}",
                    "expr": f'1 - (sum by (model) (rate({M.TTFT}_bucket{{le="{M.le(edge)}"}}[{w}])) / '
                            f"sum by (model) (rate({M.TTFT}_count[{w}])))"})
    return out


from .runbook import dashboard_url, runbook_base, runbook_markdown  # noqa: E402 - the runbook imports alert_defs


def rule_groups(slo: SLO) -> dict:
    groups: dict[str, list] = {"ttftscope-ttft-burn": list(recording_rules(slo))}
    for a in alert_defs(slo):
        rule = {"alert": a.name, "expr": a.expr, "for": a.for_, "labels": {"severity": a.severity},
                "annotations": {"summary": a.summary, "description": a.description,
                                "runbook_url": f"{runbook_base(slo)}#{a.name.lower()}",
                                "dashboard": dashboard_url(slo, a.name)}}
        groups.setdefault(a.group, []).append(rule)
    return {"groups": [{"name": n, "rules": r} for n, r in groups.items()]}


# ------------------------------------------------------------------------------ tests

def _hq(q: float, value: float, buckets) -> float:
    """histogram_quantile of a histogram whose observations all equal ``value``."""
    edges = list(buckets)
    hi_i = next(i for i, e in enumerate(edges) if value <= e)
    lo = edges[hi_i - 1] if hi_i > 0 else 0.0
    return lo + (edges[hi_i] - lo) * q


def _bad_value(a: AlertDef) -> float | None:
    if a.value is not None:
        return a.value
    first = a.bad.series[0]
    m = __import__("re").match(r"histogram_quantile\(([0-9.]+),", a.expr.lstrip("("))
    if m and isinstance(first, Hist):
        return _hq(float(m.group(1)), first.value, first.buckets)
    if a.name == "TTFTQueueWaitShareHigh":
        return a.bad.series[0].value / a.bad.series[1].value
    if a.name.startswith("TTFTErrorBudgetBurn"):
        return 1.0
    if isinstance(first, tuple):
        return float(first[1].split("x")[0].split("+")[0])
    return None


def _go_g4(v: float) -> str:
    """Go's %.4g (what Prometheus' humanize functions print)."""
    return f"{v:.4g}"


def humanize_duration(v: float) -> str:
    """Prometheus' humanizeDuration template function."""
    if v == 0:
        return "0s"
    if abs(v) >= 1:
        sign = "-" if v < 0 else ""
        v = abs(v)
        d = int(v)
        sec, mins, hours, days = d % 60, (d // 60) % 60, (d // 3600) % 24, d // 86400
        if days:
            return f"{sign}{days}d {hours}h {mins}m {sec}s"
        if hours:
            return f"{sign}{hours}h {mins}m {sec}s"
        if mins:
            return f"{sign}{mins}m {sec}s"
        return f"{sign}{_go_g4(v)}s"
    prefix = ""
    for p in ("m", "u", "n", "p"):
        if abs(v) >= 1:
            break
        prefix, v = p, v * 1000
    return f"{_go_g4(v)}{prefix}s"


def render(template: str, labels: dict, value: float | None) -> str:
    """Expand the template subset the rules use ($labels.x, $value | humanize*)."""
    import re

    def sub(m: re.Match) -> str:
        expr = m.group(1).strip()
        if expr.startswith("$labels."):
            return str(labels.get(expr[len("$labels."):], ""))
        if expr == "$value | humanizeDuration":
            return humanize_duration(value)
        if expr == "$value | humanizePercentage":
            return _go_g4(value * 100) + "%"
        raise ValueError(f"template {expr!r} not supported in generated tests")
    return re.sub(r"\{\{(.*?)\}\}", sub, template)


def _series(item, samples: int) -> list[dict]:
    if isinstance(item, tuple):
        s, values = item
        return [{"series": s, "values": values}]
    h: Hist = item
    labels = ",".join(f'{k}="{_promql_str(v)}"' for k, v in sorted(h.labels.items()))
    out = []
    for le in (*h.buckets, float("inf")):
        inside = h.value <= le
        le_s = "+Inf" if le == float("inf") else M.le(le)
        out.append({"series": f'{h.metric}_bucket{{{labels},le="{le_s}"}}',
                    "values": f"0+{h.rate}x{samples}" if inside else f"0x{samples}"})
    out.append({"series": f"{h.metric}_count{{{labels}}}", "values": f"0+{h.rate}x{samples}"})
    out.append({"series": f"{h.metric}_sum{{{labels}}}", "values": f"0+{h.rate * h.value:g}x{samples}"})
    return out


def promtool_tests(slo: SLO, rules_file: str = "ttftscope-rules.yml") -> dict:
    tests = []
    annotations = {r["alert"]: r["annotations"] for g in rule_groups(slo)["groups"] for r in g["rules"] if "alert" in r}
    for a in alert_defs(slo):
        if a.bad is None:
            continue
        bad = [s for it in a.bad.series for s in _series(it, a.samples)]
        value = _bad_value(a)
        exp_ann = {k: render(v, a.bad.labels, value) for k, v in annotations[a.name].items()}
        tests.append({"interval": "1m", "name": f"{a.name} fires on a bad series", "input_series": bad,
                      "alert_rule_test": [{"eval_time": f"{a.eval_minutes}m", "alertname": a.name,
                                           "exp_alerts": [{"exp_labels": {**a.bad.labels, "severity": a.severity},
                                                           "exp_annotations": exp_ann}]}]})
        good = [s for it in a.healthy for s in _series(it, a.samples)]
        tests.append({"interval": "1m", "name": f"{a.name} stays silent when healthy", "input_series": good,
                      "alert_rule_test": [{"eval_time": f"{a.eval_minutes}m", "alertname": a.name, "exp_alerts": []}]})
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def alertmanager_config(slo: SLO) -> dict:
    return {
        "route": {"receiver": "ttftscope-webhook", "group_by": ["alertname", "model_name"],
                  "group_wait": slo.group_wait, "group_interval": "1m", "repeat_interval": "4h",
                  "routes": [{"matchers": ['severity="critical"'], "receiver": "ttftscope-critical", "group_wait": slo.group_wait,
                              "continue": False},
                             {"matchers": ['severity="warning"'], "receiver": "ttftscope-webhook"}]},
        "receivers": [{"name": "ttftscope-webhook", "webhook_configs": [{"url": slo.webhook_url, "send_resolved": True}]},
                      {"name": "ttftscope-critical", "webhook_configs": [{"url": slo.webhook_url, "send_resolved": True}]}],
        # a critical alert silences the warnings of the same alert family and model
        "inhibit_rules": [{"source_matchers": ['severity="critical"'], "target_matchers": ['severity="warning"'],
                           "equal": ["model_name"]}],
    }


def generate(slo: SLO, out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "ttftscope-rules.yml": rule_groups(slo),
        "ttftscope-rules.test.yml": promtool_tests(slo),
        "alertmanager.yml": alertmanager_config(slo),
    }
    paths = []
    for name, doc in files.items():
        p = out / name
        p.write_text("# generated by `ttftscope alerts generate`; edit the SLO file, not this\n"
                     + yaml.safe_dump(doc, sort_keys=False, width=200))
        paths.append(p)
    rb = out / "RUNBOOK.md"
    rb.write_text(runbook_markdown(slo))
    paths.append(rb)
    return paths
