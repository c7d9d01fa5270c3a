"""The runbook: one section per generated alert — what it means, how to confirm it in the
UI, what to change. Written next to the rules (``RUNBOOK.md``) and served by the UI's
Runbook page; every alert's ``runbook_url`` points at its section (``#<alertname>``, the
anchor Streamlit gives a ``##`` heading), every ``dashboard`` link at a page the UI has.
"""

from __future__ import annotations

import re

from ttftscope.schemas.slo import SLO

_LABEL = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")

#: the UI's pages (dashboards/ui/app.py url paths) an alert may link to
UI_PAGES = ("overview", "breakdown", "requests", "gaps", "compare", "coldstart", "alerts", "runbook")

#: alert name prefix -> (UI page to confirm on, how to confirm, what to change)
_GUIDE: dict[str, tuple[str, str, str]] = {
    "TTFTP": ("overview", "Overview: TTFT over time against the SLO lines; Breakdown: which phase grew in the "
              "slow percentile band; Gaps & bottlenecks: the ranked findings with their cost in ms.",
              "Follow the top finding's advice. Queueing: raise `--max-num-seqs` / "
              "`--max-num-batched-tokens` or add replicas; long prefills: chunked prefill with a smaller "
              "token budget; delivery or receive in the API server: more API-server processes "
              "(`--api-server-count`)."),
    "TTFTErrorBudgetBurn": ("overview", "Overview: attainment against the budget threshold; Breakdown for the "
                            "phase that grew.", "Same as the TTFT target alerts; a fast burn pages, a slow one is "
                            "a ticket."),
    "TTFTQueueWaitShareHigh": ("breakdown", "Breakdown: the queue share per percentile band; Requests: the "
                               "slowest requests' timelines show long queue spans.",
                               "The engine is saturated: raise `--max-num-seqs` (seats) or "
                               "`--max-num-batched-tokens`, or scale out."),
    "PriorityQueueWaitHigh": ("breakdown", "Breakdown filtered by priority class 0.",
                              "Check `--scheduling-policy priority` is set and that low-priority decodes do not "
                              "hold all seats (`--max-num-seqs`)."),
    "AllreduceLatencyHigh": ("gaps", "Gaps & bottlenecks: the allreduce finding (growth with concurrency); "
                             "Requests: a TP request's per-rank allreduce spans.",
                             "Check the interconnect (NVLink vs PCIe), custom all-reduce enabled, and that the "
                             "TP size matches the topology."),
    "TPOTP99AboveTarget": ("overview", "Overview: TPOT p99; decode steps crowd prefills when batches are big.",
                           "Lower `--max-num-seqs`, or separate prefill and decode (disaggregation)."),
    "ITLP99AboveTarget": ("overview", "Overview: ITL p99; long prefill chunks stall running decodes.",
                          "A smaller `--max-num-batched-tokens` keeps each step short."),
    "ColdStartSlow": ("coldstart", "Cold start: the process timeline with idle gaps between loading stages.",
                      "Load weights from local NVMe (safetensors), cache torch.compile artifacts, warm up "
                      "before taking traffic."),
    "CollectorDroppingSpans": ("alerts", "The collector's /metrics: ttftscope_collector_spans_dropped_total and "
                               "queue_spans; `ttftscope doctor`.", "The store is slow or down: check it, raise "
                               "`--max-spool`, or run more collectors."),
    "CollectorStoreDown": ("alerts", "The collector's /healthz (store_healthy, store_error); `ttftscope doctor`.",
                           "Bring the store back; acknowledged spans stay spooled and are delivered then. For "
                           "the embedded store: `ttftscope store check --repair`."),
    "CollectorBacklog": ("alerts", "The collector's /metrics: ttftscope_collector_queue_spans growing.",
                         "The store cannot keep up: give the collector a faster disk or a ClickHouse server."),
    "KVCachePreemptions": ("gaps", "Gaps & bottlenecks: the KV-cache preemption finding (requests preempted in "
                           "their prefill and their wait for blocks); Requests: a preempted request's timeline has "
                           "the wait before the chunk that resumed it.",
                           "Give the KV cache more memory (`--gpu-memory-utilization`, `--kv-cache-memory-bytes`), "
                           "run fewer requests at once (`--max-num-seqs`), cap long outputs (`max_tokens`), or add "
                           "replicas."),
    "TTFTTracksLoadScaleOut": ("overview", "Overview: TTFT and request rate move together; KV cache usage high.",
                               "Add replicas or autoscale on queue length / TTFT p90."),
}


def guide(alert_name: str) -> tuple[str, str, str]:
    for prefix in sorted(_GUIDE, key=len, reverse=True):
        if alert_name.startswith(prefix):
            return _GUIDE[prefix]
    return ("overview", "Overview and Gaps & bottlenecks.", "See the alert's description.")


def runbook_base(slo: SLO) -> str:
    return slo.runbook_url or f"{slo.ui_url.rstrip('/')}/runbook"


def dashboard_url(slo: SLO, alert_name: str) -> str:
    return f"{slo.ui_url.rstrip('/')}/{guide(alert_name)[0]}"


def runbook_markdown(slo: SLO) -> str:
    from .rules import alert_defs

    lines = ["# ttftscope runbook", "",
             "One section per alert ttftscope generates: what it means, how to confirm it in the UI, "
             "what to change.", ""]
    seen = set()
    for a in alert_defs(slo):
        if a.name in seen:
            continue
        seen.add(a.name)
        page, confirm, change = guide(a.name)
        means = _LABEL.sub(r"<\1>", a.summary)
        lines += [f"## {a.name}", "", f"**Severity** {a.severity}. **Means:** {means}",
                  "", f"`{a.expr}`", "",
                  f"**Confirm:** [{page}]({slo.ui_url.rstrip('/')}/{page}) — {confirm}", "",
                  f"**Change:** {change}", ""]
    return "\n".join(lines)
