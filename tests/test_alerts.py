"""Alerts and dashboards, checked by the real tools: promtool, amtool, Prometheus, Alertmanager."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import yaml
from conftest import PY, ROOT, CollectorProc, VllmServer, free_port
from ttftscope.analyzer import synth
from ttftscope.dashboards.grafana import expand_clickhouse_macros, panel_queries
from ttftscope.schemas.slo import SLOFileError, load_slo
from ttftscope.schemas.store import open_store

from ttftscope.tinymodel import prompt_of

EXAMPLE = ROOT / "alerts" / "slo.example.yaml"


def _tool(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("alerts")
    r = subprocess.run([PY, "-m", "ttftscope", "alerts", "generate", "--slo", str(EXAMPLE), "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return out


def test_promtool_checks_and_unit_tests_pass(generated):
    r = _tool("promtool", "check", "rules", str(generated / "ttftscope-rules.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    t = _tool("promtool", "test", "rules", "ttftscope-rules.test.yml", cwd=generated)
    assert t.returncode == 0, t.stdout + t.stderr
    rules = yaml.safe_load((generated / "ttftscope-rules.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    tests = yaml.safe_load((generated / "ttftscope-rules.test.yml").read_text())["tests"]
    for a in alerts:
        assert a["labels"]["severity"] in ("critical", "warning")
        assert {"summary", "description", "runbook_url", "dashboard"} <= set(a["annotations"])
        names = [tc["alert_rule_test"][0]["alertname"] for tc in tests]
        assert names.count(a["alert"]) == 2, f"{a['alert']}: one firing and one silent test"
    for needed in ("TTFTP99AboveTarget", "TTFTErrorBudgetBurnFast", "TTFTErrorBudgetBurnSlow", "TTFTQueueWaitShareHigh",
                   "PriorityQueueWaitHigh", "AllreduceLatencyHigh", "ColdStartSlow", "CollectorDroppingSpans",
                   "CollectorStoreDown", "TTFTTracksLoadScaleOut", "TTFTP99AboveTargetModel", "TTFTP99AboveTargetPriority"):
        assert needed in {a["alert"] for a in alerts}


def test_every_generated_link_resolves_to_a_page_and_section_the_ui_serves(generated, monkeypatch):
    """runbook_url -> the UI's Runbook page and the alert's own section; dashboard -> a UI page.
    The page list comes from the UI's app.py, the sections from rendering the Runbook page."""
    import re
    from urllib.parse import urlsplit

    from streamlit.testing.v1 import AppTest

    pages = set(re.findall(r'url_path="([^"]+)"', (ROOT / "dashboards" / "ui" / "app.py").read_text()))
    monkeypatch.setenv("TTFTSCOPE_SLO_FILE", str(EXAMPLE))
    at = AppTest.from_file(str(ROOT / "dashboards" / "ui" / "views" / "runbook.py"), default_timeout=60)
    at.run()
    assert not at.exception
    rendered = "\n".join(m.value for m in at.markdown)
    sections = {ln[3:].strip().lower() for ln in rendered.splitlines() if ln.startswith("## ")}
    assert sections == {ln[3:].strip().lower() for ln in (generated / "RUNBOOK.md").read_text().splitlines()
                        if ln.startswith("## ")}, "the UI serves the runbook that was generated"
    rules = yaml.safe_load((generated / "ttftscope-rules.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    for a in alerts:
        rb, dash = urlsplit(a["annotations"]["runbook_url"]), urlsplit(a["annotations"]["dashboard"])
        assert rb.path.strip("/") == "runbook" and rb.path.strip("/") in pages, a["annotations"]["runbook_url"]
        assert rb.fragment == a["alert"].lower() and rb.fragment in sections, (a["alert"], rb.fragment)
        assert dash.path.strip("/") in pages, (a["alert"], a["annotations"]["dashboard"])
    for link in re.findall(r"\]\((http[^)]+)\)", rendered):  # the runbook's own links
        assert urlsplit(link).path.strip("/") in pages, link


def test_unit_tests_catch_a_broken_rule(generated, tmp_path):
    """The generated tests can fail: make every threshold 1000x laxer and they must."""
    import re

    for f in ("ttftscope-rules.yml", "ttftscope-rules.test.yml"):
        shutil.copy(generated / f, tmp_path / f)
    rules = (tmp_path / "ttftscope-rules.yml").read_text()
    rules = re.sub(r"(expr: .*?histogram_quantile\(.*\) > )([0-9.]+)", lambda m: m.group(1) + str(float(m.group(2)) * 1000), rules)
    (tmp_path / "ttftscope-rules.yml").write_text(rules)
    t = _tool("promtool", "test", "rules", "ttftscope-rules.test.yml", cwd=tmp_path)
    assert t.returncode != 0 and "FAILED" in (t.stdout + t.stderr)


def test_alertmanager_config_and_routes(generated):
    am = str(generated / "alertmanager.yml")
    assert _tool("amtool", "check-config", am).returncode == 0
    crit = _tool("amtool", "config", "routes", "test", f"--config.file={am}", "severity=critical")
    warn = _tool("amtool", "config", "routes", "test", f"--config.file={am}", "severity=warning")
    assert crit.stdout.strip() == "ttftscope-critical" and warn.stdout.strip() == "ttftscope-webhook"
    cfg = yaml.safe_load(Path(am).read_text())
    inh = cfg["inhibit_rules"][0]
    assert inh["source_matchers"] == ['severity="critical"'] and inh["target_matchers"] == ['severity="warning"']


@pytest.mark.parametrize("text, line, msg", [
    ("version: 1\nttft:\n  targets_ms: {p50: 350, p97: 2}\n", 3, "unknown quantile 'p97'"),
    ("version: 1\nttft:\n  targets_ms:\n    p99: -5\n", 4, "must be > 0"),
    ("version: 1\nqueue_wait:\n  max_share: 1.5\n", 3, "between 0 and 1"),
    ("version: 1\nalerts:\n  for: five minutes\n", 3, "expected a duration"),
    ("version: 1\nnonsense: 1\n", 2, "unknown key 'nonsense'"),
    ("version: 2\n", 1, "only version 1"),
    ("version: 1\nttft: [1, 2]\n", 2, "expected a mapping"),
    ("version: 1\nttft:\n  targets_ms: {p50: 350\n", 4, "not valid YAML"),
    ("version: 1\nalerts:\n  webhook_url: ftp://x\n", 3, "http(s) URL"),
])
def test_malformed_slo_file_names_file_line_and_problem(tmp_path, text, line, msg):
    f = tmp_path / "slo.yaml"
    f.write_text(text)
    with pytest.raises(SLOFileError) as e:
        load_slo(f)
    assert str(e.value).startswith(f"{f}:{line}: ") and msg in str(e.value), str(e.value)
    r = subprocess.run([PY, "-m", "ttftscope", "alerts", "generate", "--slo", str(f), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and f"{f}:{line}:" in r.stderr and "Traceback" not in r.stderr


def test_phase_metrics_on_the_collector_match_the_spans_sent(collector_factory):
    """Spans of a synthetic workload sent over OTLP: /metrics counts exactly what was sent."""
    import pyarrow as pa
    import pyarrow.compute as pc
    tables, truth = synth.generate("allreduce-concurrency", 300, seed=4)
    t = pa.concat_tables(tables)
    col = collector_factory().start()
    # encode the generated spans as OTLP JSON, as any SDK would send them
    rows = t.select(["Timestamp", "TraceId", "SpanId", "SpanName", "Duration", "SpanAttributes", "ResourceAttributes"]).to_pylist()
    by_res: dict = {}
    for r in rows:
        key = tuple(sorted(r["ResourceAttributes"]))
        start = int(r["Timestamp"].timestamp() * 1e9) if hasattr(r["Timestamp"], "timestamp") else int(r["Timestamp"])
        by_res.setdefault(key, []).append({
            "traceId": r["TraceId"], "spanId": r["SpanId"], "name": r["SpanName"], "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(start + r["Duration"]),
            "attributes": [{"key": k, "value": {"stringValue": v}} for k, v in r["SpanAttributes"]]})
    for key, spans in by_res.items():
        for i in range(0, len(spans), 2000):
            doc = {"resourceSpans": [{"resource": {"attributes": [{"key": k, "value": {"stringValue": v}} for k, v in key]},
                                      "scopeSpans": [{"spans": spans[i:i + 2000]}]}]}
            assert requests.post(col.url + "/v1/traces", json=doc, timeout=30).status_code == 200
    # the phase metrics count a batch when it is decoded for the store (within --flush-interval)
    deadline = time.monotonic() + 30
    while (col.metric("ttftscope_collector_spans_written_total") < col.metric("ttftscope_collector_spans_accepted_total")
           and time.monotonic() < deadline):
        time.sleep(0.1)
    text = requests.get(col.url + "/metrics", timeout=10).text
    names = t.column("SpanName")

    def count(name):
        return int(pc.sum(pc.equal(names, name)).as_py())

    def metric(prefix, **labels):
        total = 0.0
        for line in text.splitlines():
            if line.startswith(prefix + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    assert metric("ttftscope_phase_duration_seconds_count", phase="queue") == count("ttftscope.queue")
    assert metric("ttftscope_phase_duration_seconds_count", phase="prefill") == count("ttftscope.prefill")
    assert metric("ttftscope_phase_duration_seconds_bucket", phase="queue", le="+Inf") == count("ttftscope.queue")
    assert metric("ttftscope_ttft_seconds_count") == truth["requests"]
    assert metric("ttftscope_allreduce_seconds_count", rank="1") == count("ttftscope.allreduce") / 2
    q_sum = float(pc.sum(t.filter(pc.equal(names, "ttftscope.queue")).column("Duration")).as_py()) / 1e9
    assert metric("ttftscope_phase_duration_seconds_sum", phase="queue") == pytest.approx(q_sum, rel=1e-9)
    assert metric("ttftscope_cold_start_seconds", instance="worker-0") == pytest.approx(truth["cold_start"]["worker-0"]["cold_start_s"])
    # buckets resolve the thresholds that matter
    les = {line.split('le="')[1].split('"')[0] for line in text.splitlines() if line.startswith("ttftscope_phase_duration_seconds_bucket")}
    assert {"0.1", "0.3", "0.5", "1.0"} <= les
    assert col.terminate() == 0


@pytest.fixture(scope="module")
def grafana_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("grafana")
    r = subprocess.run([PY, "-m", "ttftscope", "grafana", "generate", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return out


def test_grafana_dashboards_are_importable_files_with_stable_uids(grafana_out):
    docs = {p.name: json.loads(p.read_text()) for p in (grafana_out / "dashboards").glob("*.json")}
    assert {d["uid"] for d in docs.values()} == {"ttftscope-overview", "ttftscope-breakdown", "ttftscope-coldstart"}
    for d in docs.values():
        assert d["schemaVersion"] >= 41
        ds_vars = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
        assert ds_vars, "datasources are dashboard variables"
        for _, t in panel_queries(d):
            assert t["datasource"]["uid"] in ("${prometheus}", "${clickhouse}")
    prov = yaml.safe_load((grafana_out / "provisioning" / "dashboards" / "ttftscope.yaml").read_text())
    assert Path(prov["providers"][0]["options"]["path"]).is_dir()
    ds = yaml.safe_load((grafana_out / "provisioning" / "datasources" / "ttftscope.yaml").read_text())
    ch = next(x for x in ds["datasources"] if x["type"] == "grafana-clickhouse-datasource")
    assert ch["jsonData"]["traces"]["otelEnabled"] is True and ch["jsonData"]["traces"]["durationUnit"] == "nanoseconds"


def test_every_clickhouse_panel_query_returns_rows_on_a_synth_store(grafana_out, tmp_path):
    st = open_store(str(tmp_path / "s"))
    truth = synth.write(st, "allreduce-concurrency", 2000, seed=2)
    tid = st.query("SELECT TraceId FROM otel_traces WHERE SpanName = 'llm_request' LIMIT 1").item()
    lo, hi = truth["window"]["start_ns"] // 10**9 - 120, truth["window"]["end_ns"] // 10**9 + 60
    n = 0
    for f in (grafana_out / "dashboards").glob("*.json"):
        for title, t in panel_queries(json.loads(f.read_text())):
            if t["datasource"]["type"] != "grafana-clickhouse-datasource":
                continue
            sql = expand_clickhouse_macros(t["rawSql"], lo, hi, 10, {"trace_id": tid})
            if "Start-up" in title:  # cold start spans precede the requests
                sql = expand_clickhouse_macros(t["rawSql"], lo - 3600, hi, 10)
            rows = st.query(sql)
            if "Start-up" in title:  # each phase timed once: the planted nested "Worker init" not added to its own
                got = {(r["instance"], r["phase"]): r["seconds"] for r in rows.iter_rows(named=True)}
                for inst, cold in truth["cold_start"].items():
                    for phase, sec in cold["seconds"].items():
                        assert got[(inst, phase)] == pytest.approx(sec, abs=0.01), (inst, phase, got)
            assert rows.height > 0, f"{f.name}: {title!r} returned no rows"
            n += 1
    assert n >= 5


def test_every_promql_expression_is_valid_for_promtool(grafana_out, generated, tmp_path):
    exprs = []
    for f in (grafana_out / "dashboards").glob("*.json"):
        for _, t in panel_queries(json.loads(f.read_text())):
            if "expr" in t:
                exprs.append(t["expr"].replace("$__rate_interval", "5m").replace("$model_name", ".*").replace("$instance", ".*"))
    assert len(exprs) >= 10
    doc = {"groups": [{"name": "dashboard-exprs", "rules": [{"record": f"dash:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    p = tmp_path / "exprs.yml"
    p.write_text(yaml.safe_dump(doc))
    r = _tool("promtool", "check", "rules", str(p))
    assert r.returncode == 0, r.stdout + r.stderr


class _Webhook(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        _Webhook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.mark.slow
def test_end_to_end_prometheus_evaluates_rules_and_alertmanager_delivers(tmp_path):
    """Real Prometheus scrapes real vLLM + the collector; the TTFT alert reaches a webhook."""
    hook = ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    _Webhook.received = []
    slo = tmp_path / "slo.yaml"
    slo.write_text(f"""version: 1
ttft:
  targets_ms: {{p50: 0.5}}
alerts:
  for: 0s
  group_wait: 1s
  webhook_url: http://127.0.0.1:{hook.server_address[1]}/alerts
""")
    out = tmp_path / "rules"
    assert subprocess.run([PY, "-m", "ttftscope", "alerts", "generate", "--slo", str(slo), "--out", str(out)],
                          cwd=ROOT).returncode == 0
    col = CollectorProc(str(tmp_path / "store"), tmp_path / "spool").start()
    srv = VllmServer(tmp_path, col.url + "/v1/traces", run="e2e").start()
    am_port, prom_port = free_port(), free_port()
    procs = []
    try:
        procs.append(subprocess.Popen([shutil.which("alertmanager") or "prometheus-alertmanager", f"--config.file={out / 'alertmanager.yml'}",
                                       f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}",
                                       "--cluster.listen-address="], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        (tmp_path / "prom.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(out / "ttftscope-rules.yml")],
            "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{srv.port}"]}]},
                               {"job_name": "ttftscope", "static_configs": [{"targets": [f"127.0.0.1:{col.port}"]}]}],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]}}))
        procs.append(subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prom.yml'}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 150
        got = None
        i = 0
        while time.time() < deadline and got is None:
            srv.completion(prompt_of(30, i), 4)
            i += 1
            time.sleep(0.5)
            for msg in _Webhook.received:
                for a in msg.get("alerts", []):
                    if a["labels"].get("alertname") == "TTFTP50AboveTarget" and a["status"] == "firing":
                        got = a
        assert got is not None, f"no TTFT alert delivered; webhook got {_Webhook.received}"
        # on the client's TTFT (the collector's histogram of the API server's ttftscope.http spans),
        # labelled with the model as vLLM's own metrics name it
        assert got["labels"]["severity"] == "critical" and got["labels"]["model"] == srv.model, got["labels"]
        assert got["annotations"]["runbook_url"].endswith("#ttftp50abovetarget")
        # the phase metrics reached Prometheus from the collector too
        q = requests.get(f"http://127.0.0.1:{prom_port}/api/v1/query",
                         params={"query": "sum(ttftscope_phase_duration_seconds_count)"}, timeout=10).json()
        assert float(q["data"]["result"][0]["value"][1]) > 0
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        srv.stop()
        col.terminate()
        hook.shutdown()


def test_every_slo_flag_takes_a_file_or_targets_with_one_meaning(tmp_path):
    """One SLO model: the file's TTFT targets are what `analyze` judges a window by, the same
    as the same targets given inline, and a bad value is one clear error either way."""
    from ttftscope.schemas.slo import SLO

    f, f2 = tmp_path / "slo.yaml", tmp_path / "slo-queue.yml"
    f.write_text("version: 1\nttft:\n  targets_ms: {p50: 5, p99: 40}\n")
    f2.write_text(f.read_text() + "queue_wait: {priority_p99_ms: 7}\n")
    from_file, inline = SLO.from_arg(str(f)), SLO.from_arg("p50=5,p99=40")
    assert from_file.ttft_targets_ms == inline.ttft_targets_ms == {"p50": 5.0, "p95": 600.0, "p99": 40.0}
    assert SLO.from_arg(str(f2)).queue_priority_p99_ms == 7 and inline.queue_priority_p99_ms == SLO().queue_priority_p99_ms
    store = str(tmp_path / "store")
    subprocess.run([PY, "-m", "ttftscope", "synth", "--store", store, "--scenario", "baseline", "--requests", "200",
                    "--seed", "2"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    outs = []
    for arg in (str(f), "p50=5,p99=40"):
        r = subprocess.run([PY, "-m", "ttftscope", "analyze", "--store", store, "--last", "30d", "--json", "--quiet",
                            "--slo", arg], capture_output=True, text=True, cwd=ROOT, timeout=300)
        outs.append((r.returncode, json.loads(r.stdout)["slo"]))
    assert outs[0] == outs[1] and outs[0][0] == 1, outs  # synthetic TTFT is far above 5 ms at p50: violated
    for bad in ("p42=3", str(tmp_path / "missing.yaml")):
        r = subprocess.run([PY, "-m", "ttftscope", "analyze", "--store", store, "--slo", bad], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip(), r.stderr


def test_the_example_slo_file_documents_every_setting_with_its_default():
    """Every SLO field (declared once, with its place in the file) is in the example, and the
    example's values are the defaults it says they are."""
    import dataclasses

    import yaml
    from ttftscope.schemas.slo import SLO, load_slo

    doc = yaml.safe_load(EXAMPLE.read_text())
    text = EXAMPLE.read_text()
    loaded, default = load_slo(EXAMPLE), SLO()
    for f in dataclasses.fields(SLO):
        section, key = f.metadata["yaml"].split(".")
        assert section in doc, f.name
        assert key in (doc[section] or {}) or f"# {key}:" in text, f"{f.metadata['yaml']} is not in the example"
        if f.metadata["kind"] != "qmapmap":
            assert getattr(loaded, f.name) == getattr(default, f.name), f.name


def test_rule_templating_follows_the_slo():
    """Unit level: each target becomes its own threshold, overridden models are excluded from
    the fleet-wide rule (label values escaped for PromQL), and the burn rate counts errors at
    the bucket edge at or below the budget threshold (a histogram can only be cut at an edge)."""
    from ttftscope.alerts.rules import alert_defs
    from ttftscope.schemas.slo import SLO

    slo = SLO(ttft_targets_ms={"p50": 300.0, "p99": 900.0}, ttft_models={'we"ird': {"p99": 1200.0}},
              ttft_priorities={"0": {"p99": 400.0}}, budget_threshold_ms=700.0, budget_objective=0.995)
    defs = {d.name: d for d in alert_defs(slo)}
    fleet = defs["TTFTP99AboveTarget"].expr
    assert fleet.endswith("> 0.9") and 'model!~"we\\"ird"' in fleet and "histogram_quantile(0.99," in fleet
    assert defs["TTFTP50AboveTarget"].expr.endswith("> 0.3") and defs["TTFTP50AboveTarget"].severity == "critical"
    assert "TTFTP95AboveTarget" not in defs, "a quantile without a target has no rule"
    model = defs["TTFTP99AboveTargetModel"].expr
    assert 'model="we\\"ird"' in model and model.endswith("> 1.2")
    assert 'priority="0"' in defs["TTFTP99AboveTargetPriority"].expr
    burn = defs["TTFTErrorBudgetBurnFast"]
    assert "> 0.072 and" in burn.expr  # 14.4 x (1 - 0.995)
    assert "took longer than 600 ms" in burn.description  # 700 ms falls between the 600 and 750 ms edges
