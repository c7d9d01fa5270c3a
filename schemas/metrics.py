"""Prometheus metric names and buckets, defined once (collector, alerts, dashboards, UI).

vLLM's own metric names are listed here too (counters are exported with ``_total``).
"""

from __future__ import annotations

# --- derived from spans by the ttftscope collector ------------------------------------
PHASE_DURATION = "ttftscope_phase_duration_seconds"  # histogram {phase, model, priority}
TTFT = "ttftscope_ttft_seconds"  # histogram {model, priority}, from llm_request spans
ALLREDUCE = "ttftscope_allreduce_seconds"  # histogram {rank}, per step and rank
COLD_START = "ttftscope_cold_start_seconds"  # gauge {instance, role}
# buckets resolve 0.1, 0.3, 0.5 and 1 s, and the default SLO targets 0.35 / 0.6 / 0.8 s
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.75, 0.8,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)



def le(seconds: float) -> str:
    """A bucket's ``le`` label as prometheus-client writes it (``1.0``, ``0.35``): the one
    spelling used by the collector's histograms, the rules that select a bucket, and the
    promtool tests' crafted series."""
    return repr(float(seconds))


# --- the collector's own health ---------------------------------------------------------
COLLECTOR = "ttftscope_collector"


class Collector:
    """The collector's own metrics, as registered (Prometheus exposes a counter as ``<name>_total``)."""

    REQUESTS = f"{COLLECTOR}_requests"  # counter {code}
    SPANS_RECEIVED = f"{COLLECTOR}_spans_received"
    SPANS_ACCEPTED = f"{COLLECTOR}_spans_accepted"
    SPANS_WRITTEN = f"{COLLECTOR}_spans_written"
    SPANS_REJECTED = f"{COLLECTOR}_spans_rejected"  # counter {reason}
    SPANS_DROPPED = f"{COLLECTOR}_spans_dropped"
    QUEUE_SPANS = f"{COLLECTOR}_queue_spans"  # gauge
    SPOOL_BYTES = f"{COLLECTOR}_spool_bytes"  # gauge
    REQUESTS_OVER_BUDGET = f"{COLLECTOR}_requests_over_budget"
    CONNECTIONS_REFUSED = f"{COLLECTOR}_connections_refused"
    PARTS_QUARANTINED = f"{COLLECTOR}_store_parts_quarantined"  # gauge
    STORE_UP = f"{COLLECTOR}_store_up"  # gauge
    STORE_ERRORS = f"{COLLECTOR}_store_errors"
    BATCH_WRITE_SECONDS = f"{COLLECTOR}_batch_write_seconds"  # histogram
    BATCH_SPANS = f"{COLLECTOR}_batch_spans"  # histogram
    COMMIT_REQUESTS = f"{COLLECTOR}_commit_requests"  # histogram: requests one spool sync acknowledged


# the series rules, dashboards and tools select
SPANS_DROPPED = f"{Collector.SPANS_DROPPED}_total"
SPANS_RECEIVED = f"{Collector.SPANS_RECEIVED}_total"
QUEUE_SPANS = Collector.QUEUE_SPANS
STORE_UP = Collector.STORE_UP

# --- vLLM's own (API server /metrics; labels model_name, engine) --------------------------
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_TPOT = "vllm:request_time_per_output_token_seconds"
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_QUEUE = "vllm:request_queue_time_seconds"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"
VLLM_SUCCESS = "vllm:request_success_total"
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
