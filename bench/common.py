"""Shared helpers for the benchmarks: realistic OTLP requests shaped like the plugin's spans."""

from __future__ import annotations

import os
import random
import time

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName


def otlp_request(n_spans: int, seed: int, t0: int | None = None) -> bytes:
    """One ExportTraceServiceRequest: request trees of 6 spans with plugin-like attributes."""
    rng = random.Random(seed)
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for k, v in ((ResourceAttr.SERVICE_NAME, "vllm-api"), (ResourceAttr.SERVICE_VERSION, "0.32.0"),
                 (ResourceAttr.HOST_NAME, "node-1"), (ResourceAttr.ROLE, "api_server"),
                 (ResourceAttr.RUN, "bench"), ("telemetry.sdk.language", "python")):
        kv = rs.resource.attributes.add()
        kv.key, kv.value.string_value = k, v
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "ttftscope", "0.1.0"
    t = t0 or time.time_ns()
    names = [SpanName.REQUEST, SpanName.TOKENIZE, SpanName.QUEUE, SpanName.PREFILL, SpanName.PREFILL, SpanName.OUTPUT]
    trace_id = root = b""
    for i in range(n_spans):
        if i % 6 == 0:
            trace_id, root = os.urandom(16), os.urandom(8)
        sp = ss.spans.add()
        sp.trace_id = trace_id
        sp.span_id = root if i % 6 == 0 else os.urandom(8)
        if i % 6:
            sp.parent_span_id = root
        sp.name = names[i % 6]
        sp.kind = 2 if i % 6 == 0 else 1
        sp.start_time_unix_nano = t + i * 1000
        sp.end_time_unix_nano = t + i * 1000 + rng.randint(10_000, 50_000_000)
        for k, v in ((Attr.REQUEST_ID, f"cmpl-{seed}-{i // 6}"), (Attr.STEP, rng.randint(1, 10**6)),
                     (Attr.TOKENS_COMPUTED, rng.randint(1, 4096)), (Attr.TOKENS_CACHED, rng.randint(0, 512)),
                     (Attr.BATCH_SIZE, rng.randint(1, 64)), (Attr.PHASE, "prefill")):
            kv = sp.attributes.add()
            kv.key = k
            if isinstance(v, int):
                kv.value.int_value = v
            else:
                kv.value.string_value = v
        sp.status.code = 1
    return req.SerializeToString()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
