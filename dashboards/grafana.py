"""Grafana dashboards and provisioning, built with grafana-foundation-sdk (Grafana 11.6 build).

(a) TTFT overview on Prometheus (vLLM's metrics + ttftscope's phase metrics, SLO lines,
model/instance variables); (b) TTFT breakdown on ClickHouse through
``grafana-clickhouse-datasource`` over ``otel_traces`` (phase percentiles over time, the
slowest requests, a traces panel for a chosen trace id); (c) cold start. Datasources are
dashboard variables, uids are stable, files import directly or through provisioning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm
from ttftscope.schemas import metrics as M
from ttftscope.schemas.phases import COLOURS, LOAD_SPANS, PHASES, phase_sql
from ttftscope.schemas.slo import DEFAULT_TARGETS_MS
from ttftscope.schemas.sql import in_list
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

CH_TYPE = "grafana-clickhouse-datasource"
PROM = dm.DataSourceRef(type_val="prometheus", uid="${prometheus}")
CH = dm.DataSourceRef(type_val=CH_TYPE, uid="${clickhouse}")


class _CHQuery(cogvariants.Dataquery):
    def __init__(self, sql: str, fmt: int, ref: str) -> None:
        self.sql, self.fmt, self.ref = sql, fmt, ref

    def to_json(self) -> dict:
        return {"refId": self.ref, "datasource": {"type": CH_TYPE, "uid": "${clickhouse}"}, "editorType": "sql",
                "rawSql": self.sql, "format": self.fmt, "queryType": "traces" if self.fmt == 3 else "table"}


class ClickHouseQuery(cogbuilder.Builder[cogvariants.Dataquery]):
    """The SDK has no ClickHouse query builder: this serialises the plugin's target."""

    def __init__(self, sql: str, fmt: int = 1) -> None:
        self._q = _CHQuery(sql, fmt, "A")

    def ref_id(self, ref: str) -> ClickHouseQuery:
        self._q.ref = ref
        return self

    def build(self) -> _CHQuery:
        return self._q


def _prom(expr: str, legend: str, ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(PROM)


def _thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps])


def _ds_var(name: str, plugin: str, label: str) -> db.DatasourceVariable:
    return db.DatasourceVariable(name).label(label).type(plugin)


def _encode(d: db.Dashboard) -> dict:
    return json.loads(JSONEncoder(sort_keys=True).encode(d.build()))


def overview(targets_ms: dict[str, float] | None = None) -> dict:
    t = targets_ms or dict(DEFAULT_TARGETS_MS)
    sel = 'model_name=~"$model_name", instance=~"$instance"'
    # the client's TTFT (the collector's histogram of ttftscope.http spans), vLLM's own dashed
    ttft = timeseries.Panel().title("TTFT p50 / p95 / p99 as clients see it (SLO lines)").unit("s").height(9).span(16) \
        .datasource(PROM)
    for i, (q, v) in enumerate((("p50", 0.5), ("p95", 0.95), ("p99", 0.99))):
        ttft = ttft.with_target(_prom(
            f'histogram_quantile({v}, sum by (le) (rate({M.TTFT}_bucket{{model=~"$model_name"}}[$__rate_interval])))',
            q, "ABC"[i]))
    ttft = ttft.with_target(_prom(
        f"histogram_quantile(0.5, sum by (le) (rate({M.VLLM_TTFT}_bucket{{{sel}}}[$__rate_interval])))",
        "p50 inside vLLM", "D"))
    steps = [(None, "green")] + [(t[k] / 1000, c) for k, c in (("p50", "yellow"), ("p95", "orange"), ("p99", "red")) if k in t]
    ttft = ttft.thresholds(_thresholds(*steps)).thresholds_style(
        __import__("grafana_foundation_sdk.builders.common", fromlist=["x"]).GraphThresholdsStyleConfig().mode(
            __import__("grafana_foundation_sdk.models.common", fromlist=["x"]).GraphThresholdsStyleMode.LINE))
    rate = stat.Panel().title("Request rate").unit("reqps").height(9).span(8).datasource(PROM).with_target(
        _prom(f"sum(rate({M.VLLM_SUCCESS}{{{sel}}}[$__rate_interval]))", "req/s"))
    share = timeseries.Panel().title("Share of TTFT per phase (ttftscope)").unit("percentunit").height(8).span(12) \
        .datasource(PROM).with_target(_prom(
            f'sum by (phase) (rate({M.PHASE_DURATION}_sum{{phase!="allreduce", model=~"$model_name"}}[$__rate_interval])) '
            f'/ scalar(sum(rate({M.TTFT}_sum{{model=~"$model_name"}}[$__rate_interval])))', "{{phase}}"))
    phase_p99 = timeseries.Panel().title("Phase p99").unit("s").height(8).span(12).datasource(PROM).with_target(_prom(
        f'histogram_quantile(0.99, sum by (le, phase) (rate({M.PHASE_DURATION}_bucket{{model=~"$model_name"}}[$__rate_interval])))',
        "{{phase}}"))
    share, phase_p99 = _phase_colours(share), _phase_colours(phase_p99)
    prio = timeseries.Panel().title("Queue wait p99, priority class 0").unit("s").height(8).span(8).datasource(PROM) \
        .with_target(_prom(f'histogram_quantile(0.99, sum by (le) (rate({M.PHASE_DURATION}_bucket{{phase="queue", priority="0"}}[$__rate_interval])))',
                           "priority 0"))
    ar = timeseries.Panel().title("Allreduce per step p99, by rank").unit("s").height(8).span(8).datasource(PROM) \
        .with_target(_prom(f"histogram_quantile(0.99, sum by (le, rank) (rate({M.ALLREDUCE}_bucket[$__rate_interval])))", "rank {{rank}}"))
    load = timeseries.Panel().title("Running / waiting requests, KV cache, preemptions a minute").height(8).span(8) \
        .datasource(PROM) \
        .with_target(_prom(f"sum({M.VLLM_RUNNING}{{{sel}}})", "running", "A")) \
        .with_target(_prom(f"sum({M.VLLM_WAITING}{{{sel}}})", "waiting", "B")) \
        .with_target(_prom(f"avg({M.VLLM_KV_USAGE}{{{sel}}})", "kv cache usage", "C")) \
        .with_target(_prom(f"sum(rate({M.VLLM_PREEMPTIONS}{{{sel}}}[$__rate_interval])) * 60", "preemptions / min", "D"))
    itl = timeseries.Panel().title("ITL / TPOT p99").unit("s").height(8).span(12).datasource(PROM) \
        .with_target(_prom(f"histogram_quantile(0.99, sum by (le) (rate({M.VLLM_ITL}_bucket{{{sel}}}[$__rate_interval])))", "ITL", "A")) \
        .with_target(_prom(f"histogram_quantile(0.99, sum by (le) (rate({M.VLLM_TPOT}_bucket{{{sel}}}[$__rate_interval])))", "TPOT", "B"))
    col = timeseries.Panel().title("Collector: spans in / written / dropped per s, backlog").height(8).span(12).datasource(PROM) \
        .with_target(_prom(f"sum(rate({M.SPANS_RECEIVED}[$__rate_interval]))", "received", "A")) \
        .with_target(_prom(f"sum(rate({M.SPANS_DROPPED}[$__rate_interval]))", "dropped", "B")) \
        .with_target(_prom(f"sum({M.QUEUE_SPANS})", "backlog", "C"))
    d = (db.Dashboard("ttftscope — TTFT overview").uid("ttftscope-overview").tags(["ttftscope", "vllm", "ttft"])
         .refresh("10s").time("now-1h", "now")
         .with_variable(_ds_var("prometheus", "prometheus", "Prometheus"))
         .with_variable(db.QueryVariable("model_name").label("Model").datasource(PROM)
                        .query(f"label_values({M.VLLM_TTFT}_count, model_name)").include_all(True).multi(True))
         .with_variable(db.QueryVariable("instance").label("Instance").datasource(PROM)
                        .query(f"label_values({M.VLLM_TTFT}_count, instance)").include_all(True).multi(True)))
    for p in (ttft, rate, share, phase_p99, prio, ar, load, itl, col):
        d = d.with_panel(p)
    return _encode(d)


def _phase_colours(panel: timeseries.Panel) -> timeseries.Panel:
    """Each phase's series in the registry's colour (the UI uses the same ones)."""
    for name in PHASES:
        panel = panel.override_by_name(name, [dm.DynamicConfigValue(
            id_val="color", value={"mode": "fixed", "fixedColor": COLOURS[name]})])
    return panel


def _phase_expr() -> str:
    return phase_sql()


def breakdown() -> dict:
    ph = _phase_expr()
    pct = timeseries.Panel().title("Phase p95 over time (from spans)").unit("ms").height(9).span(24).datasource(CH) \
        .with_target(ClickHouseQuery(
            f"SELECT $__timeInterval(Timestamp) AS time, {ph} AS phase, quantile(0.95)(Duration) / 1e6 AS p95_ms "
            "FROM otel_traces WHERE $__timeFilter(Timestamp) AND phase != '' "
            "GROUP BY time, phase ORDER BY time", fmt=0))
    ttft_q = timeseries.Panel().title("TTFT percentiles as clients see it (ttftscope.http)").unit("ms").height(8).span(12) \
        .datasource(CH).with_target(ClickHouseQuery(
            f"SELECT $__timeInterval(Timestamp) AS time, quantile(0.5)(Duration) / 1e6 AS p50, "
            f"quantile(0.99)(Duration) / 1e6 AS p99 "
            f"FROM otel_traces WHERE $__timeFilter(Timestamp) AND SpanName = '{SpanName.HTTP}' GROUP BY time ORDER BY time", fmt=0))
    slow = table.Panel().title("Slowest requests (TTFT as clients see it)").height(8).span(12).datasource(CH).with_target(ClickHouseQuery(
        f"SELECT Timestamp, TraceId, SpanAttributes['{Attr.REQUEST_ID}'] AS request_id, Duration / 1e6 AS ttft_ms, "
        f"SpanAttributes['{Attr.HTTP_STREAMING}'] AS streaming, "
        f"ResourceAttributes['{ResourceAttr.SERVICE_VERSION}'] AS version "
        f"FROM otel_traces WHERE $__timeFilter(Timestamp) AND SpanName = '{SpanName.HTTP}' ORDER BY ttft_ms DESC LIMIT 50"))
    trace = table.Panel().title("Trace ${trace_id}").height(12).span(24).datasource(CH).with_target(ClickHouseQuery(
        "SELECT TraceId AS traceID, SpanId AS spanID, ParentSpanId AS parentSpanID, ServiceName AS serviceName, "
        "SpanName AS operationName, toUnixTimestamp64Milli(Timestamp) AS startTime, Duration / 1e6 AS duration, "
        "arrayMap(key -> map('key', key, 'value', SpanAttributes[key]), mapKeys(SpanAttributes)) AS tags, "
        "arrayMap(key -> map('key', key, 'value', ResourceAttributes[key]), mapKeys(ResourceAttributes)) AS serviceTags, "
        "StatusCode AS statusCode, SpanKind AS kind, StatusMessage AS statusMessage, TraceState AS traceState "
        "FROM otel_traces WHERE TraceId = '${trace_id}' "
        "AND Timestamp >= (SELECT min(Start) FROM otel_traces_trace_id_ts WHERE TraceId = '${trace_id}') "
        "AND Timestamp <= (SELECT max(End) + 1 FROM otel_traces_trace_id_ts WHERE TraceId = '${trace_id}') "
        "ORDER BY startTime", fmt=3))
    trace._internal.type_val = "traces"
    d = (db.Dashboard("ttftscope — TTFT breakdown (traces)").uid("ttftscope-breakdown").tags(["ttftscope", "traces"])
         .refresh("30s").time("now-1h", "now")
         .with_variable(_ds_var("clickhouse", CH_TYPE, "ClickHouse"))
         .with_variable(db.TextBoxVariable("trace_id").label("Trace id")))
    for p in (pct, ttft_q, slow, trace):
        d = d.with_panel(p)
    return _encode(d)


def cold_start() -> dict:
    names = in_list([*LOAD_SPANS, SpanName.PROCESS_START])
    # a phase's seconds: the union of its spans (vLLM nests a "Worker init" in another, which a sum of
    # durations counted twice), as analyzer.coldstart times it
    tl = table.Panel().title("Start-up phases per process").height(10).span(16).datasource(CH).with_target(ClickHouseQuery(
        f"SELECT instance, phase, min(ts) AS start, round(sum(greatest(e - greatest(s, reach), 0)) / 1e9, 2) AS seconds "
        f"FROM (SELECT ResourceAttributes['{ResourceAttr.SERVICE_INSTANCE}'] AS instance, SpanName AS phase, "
        f"Timestamp AS ts, toUnixTimestamp64Nano(Timestamp) AS s, s + toInt64(Duration) AS e, "
        f"max(e) OVER (PARTITION BY instance, phase ORDER BY s ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach "
        f"FROM otel_traces WHERE $__timeFilter(Timestamp) AND SpanName IN ({names})) "
        f"GROUP BY instance, phase ORDER BY instance, start"))
    g = stat.Panel().title("Cold start (process start → ready)").unit("s").height(10).span(8).datasource(PROM) \
        .thresholds(_thresholds((None, "green"), (90, "red"))) \
        .with_target(_prom(f"max by (instance) ({M.COLD_START})", "{{instance}}"))
    d = (db.Dashboard("ttftscope — cold start").uid("ttftscope-coldstart").tags(["ttftscope", "coldstart"])
         .time("now-6h", "now")
         .with_variable(_ds_var("prometheus", "prometheus", "Prometheus"))
         .with_variable(_ds_var("clickhouse", CH_TYPE, "ClickHouse")))
    return _encode(d.with_panel(tl).with_panel(g))


def provisioning(dash_dir: str, prometheus_url: str, ch_host: str, ch_port: int, ch_db: str) -> tuple[dict, dict]:
    providers = {"apiVersion": 1, "providers": [{"name": "ttftscope", "folder": "ttftscope", "type": "file",
                                                  "disableDeletion": False, "options": {"path": dash_dir}}]}
    datasources = {"apiVersion": 1, "datasources": [
        {"name": "Prometheus", "type": "prometheus", "uid": "ttftscope-prometheus", "access": "proxy", "url": prometheus_url},
        {"name": "ClickHouse", "type": CH_TYPE, "uid": "ttftscope-clickhouse",
         "jsonData": {"host": ch_host, "port": ch_port, "protocol": "http", "username": "readonly", "defaultDatabase": ch_db,
                      "traces": {"defaultDatabase": ch_db, "defaultTable": "otel_traces", "otelEnabled": True,
                                 "otelVersion": "latest", "durationUnit": "nanoseconds"}},
         "secureJsonData": {"password": "$CLICKHOUSE_PASSWORD"}}]}
    return providers, datasources


def generate(out: str | Path, *, targets_ms: dict | None = None, prometheus_url: str = "http://localhost:9090",
             ch_host: str = "localhost", ch_port: int = 8123, ch_db: str = "default") -> list[Path]:
    out = Path(out)
    (out / "dashboards").mkdir(parents=True, exist_ok=True)
    (out / "provisioning" / "dashboards").mkdir(parents=True, exist_ok=True)
    (out / "provisioning" / "datasources").mkdir(parents=True, exist_ok=True)
    paths = []
    for name, doc in (("ttftscope-overview.json", overview(targets_ms)), ("ttftscope-breakdown.json", breakdown()),
                      ("ttftscope-coldstart.json", cold_start())):
        p = out / "dashboards" / name
        p.write_text(json.dumps(doc, indent=2, sort_keys=True))
        paths.append(p)
    prov, ds = provisioning(str((out / "dashboards").absolute()), prometheus_url, ch_host, ch_port, ch_db)
    for p, doc in ((out / "provisioning" / "dashboards" / "ttftscope.yaml", prov),
                   (out / "provisioning" / "datasources" / "ttftscope.yaml", ds)):
        p.write_text(yaml.safe_dump(doc, sort_keys=False))
        paths.append(p)
    return paths


# --------------------------------------------------------------- queries of a dashboard

def panel_queries(doc: dict) -> list[tuple[str, dict]]:
    """(panel title, target) for every target of every panel."""
    out = []
    for p in doc.get("panels", []):
        for t in p.get("targets", []) or []:
            out.append((p.get("title", ""), t))
    return out


def expand_clickhouse_macros(sql: str, from_s: int, to_s: int, interval_s: int = 60, variables: dict | None = None) -> str:
    """Expand the grafana-clickhouse-datasource macros (as the plugin does) for a time range."""
    for k, v in (variables or {}).items():
        sql = sql.replace("${" + k + "}", v).replace("$" + k, v)
    sql = re.sub(r"\$__timeFilter\(([^)]+)\)",
                 lambda m: f"{m.group(1)} >= toDateTime({from_s}) AND {m.group(1)} <= toDateTime({to_s})", sql)
    sql = re.sub(r"\$__timeInterval\(([^)]+)\)",
                 lambda m: f"toStartOfInterval(toDateTime({m.group(1)}), INTERVAL {interval_s} second)", sql)
    sql = sql.replace("$__interval_s", str(interval_s)).replace("$__fromTime", f"toDateTime({from_s})") \
        .replace("$__toTime", f"toDateTime({to_s})")
    return sql


__all__ = ["generate", "overview", "breakdown", "cold_start", "panel_queries", "expand_clickhouse_macros", "PHASES"]
