"""The web UI: Streamlit AppTest on every page, and a real headless Chromium on a running `ttftscope ui`."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests
from conftest import ROOT, free_port
from streamlit.testing.v1 import AppTest
from ttftscope.analyzer import Analyzer, Window, synth
from ttftscope.schemas.store import open_store

from support.browser import chrome, wait_rendered
from support.procs import wait_http, wakeups

APP = str(ROOT / "dashboards" / "ui" / "app.py")
PAGES = ["views/breakdown.py", "views/requests.py", "views/gaps.py", "views/compare.py", "views/coldstart.py",
         "views/alerts.py"]
ARTIFACTS = Path(os.environ.get("TTFTSCOPE_TEST_ARTIFACTS", tempfile.gettempdir())) / "ttftscope-ui-screenshots"


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ui") / "store")
    st = open_store(d)
    truth = synth.write(st, "regression", 3000, seed=8)
    return d, truth


def _app(store: str, monkeypatch) -> AppTest:
    monkeypatch.setenv("TTFTSCOPE_STORE", store)
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    return at


def _no_exception(at: AppTest, where: str) -> None:
    assert not at.exception, f"{where}: {[e.value for e in at.exception]}"


def test_every_page_renders_the_analyzer_answers(filled, monkeypatch):
    store, truth = filled
    report = Analyzer(open_store(store, create=False)).analyze(Window(truth["window"]["start_ns"], truth["window"]["end_ns"] + 10**9))
    at = _app(store, monkeypatch)
    _no_exception(at, "overview")
    assert at.metric[0].value == f"{truth['requests']:,}"
    assert any(report["findings"][0]["title"] in m.value for m in at.markdown), "top finding on the overview"
    for page in PAGES:
        at.switch_page(page).run()
        _no_exception(at, page)
        assert not at.error, f"{page}: {[e.value for e in at.error]}"
    at.switch_page("views/gaps.py").run()
    assert at.expander[0].label.endswith(report["findings"][0]["title"])
    at.switch_page("views/compare.py").run()
    assert any("prefill" in w.value for w in at.warning), "the regression's shifted phase is flagged"
    at.switch_page("views/requests.py").run()
    assert at.text_input[0].value, "the slowest request opens by default"
    at.switch_page("views/coldstart.py").run()
    assert any("worker-0" in m.value for m in at.markdown)
    at.switch_page("views/alerts.py").run()
    assert "alerts from this SLO" in at.subheader[0].value
    # the server fetches Prometheus from configuration only, never a URL a viewer types
    assert not [t for t in at.text_input if "prometheus" in (t.label or "").lower()]


def test_a_request_opens_by_request_id_and_bad_ids_get_a_message(filled, monkeypatch):
    store, _ = filled
    rid = open_store(store, create=False).query(
        "SELECT SpanAttributes['gen_ai.request.id'] FROM otel_traces WHERE SpanName = 'llm_request' LIMIT 1").item()
    at = _app(store, monkeypatch)
    at.switch_page("views/requests.py").run()
    at.text_input[0].set_value(rid).run()
    _no_exception(at, "requests by id")
    assert any("Trace `" in s.value for s in at.subheader)
    at.text_input[0].set_value("no-such-request' OR 1=1 --").run()
    _no_exception(at, "bad id")
    assert any("No request or trace matches" in e.value for e in at.error)


def test_a_request_vllm_preempted_says_what_its_gap_was(tmp_path, monkeypatch):
    """The planted cause (synth: prompts preempted after their first chunk, ~0.8 s waiting for
    KV-cache blocks) is the top finding on the gaps page, and the slowest request's page says
    what its red stretch was, not only that it was idle."""
    store = str(tmp_path / "store")
    synth.write(open_store(store), "kv-preemption", 1500, seed=3)
    at = _app(store, monkeypatch)
    at.switch_page("views/gaps.py").run()
    _no_exception(at, "gaps")
    assert "KV cache ran out" in at.expander[0].label, at.expander[0].label
    at.switch_page("views/requests.py").run()
    _no_exception(at, "requests")
    gaps = [c.value for c in at.caption if c.value.startswith("gap: ")]
    assert gaps and "preempted, waiting for KV-cache blocks" in gaps[0], [c.value for c in at.caption]


@pytest.mark.parametrize("evil", ["x' OR 1=1 --", "'); DROP TABLE otel_traces; --", "{model:String}"])
def test_filters_are_bound_parameters(filled, monkeypatch, evil):
    store, truth = filled
    at = _app(store, monkeypatch)
    at.sidebar.text_input(key="ov_model").set_value(evil).run()
    _no_exception(at, "overview with an injection string")
    assert any("No requests" in i.value for i in at.info)
    assert open_store(store, create=False).query("SELECT count() FROM otel_traces WHERE SpanName = 'llm_request'").item() == truth["requests"]


def test_empty_store_unreachable_store_and_malformed_slo(tmp_path, monkeypatch):
    empty = str(tmp_path / "empty")
    open_store(empty)
    at = _app(empty, monkeypatch)
    _no_exception(at, "empty store")
    assert any("holds no requests" in e.value for e in at.error)
    at = _app(f"clickhouse://default:@127.0.0.1:{free_port()}/x", monkeypatch)
    _no_exception(at, "unreachable store")
    assert any("Cannot open the store" in e.value for e in at.error)
    at = _app(str(tmp_path / "missing"), monkeypatch)
    assert any("no ttftscope store" in e.value for e in at.error)
    at.switch_page("views/alerts.py").run()
    at.text_area[0].set_value("version: 1\nttft:\n  targets_ms: {p42: 1}\n").run()
    _no_exception(at, "malformed SLO")
    assert any("SLO file:3:" in e.value and "p42" in e.value for e in at.error)


def test_malformed_sidebar_slo_is_a_message(filled, monkeypatch):
    store, _ = filled
    at = _app(store, monkeypatch)
    at.sidebar.text_input(key="ov_slo").set_value("p99=fast").run()
    _no_exception(at, "malformed SLO filter")
    assert any("invalid SLO item" in e.value for e in at.error)


@pytest.mark.slow
def test_every_page_in_a_real_headless_chromium(filled):
    from selenium.webdriver.common.by import By

    store, _ = filled
    port = free_port()
    env = {**os.environ, "TTFTSCOPE_STORE": store}
    proc = subprocess.Popen([os.sys.executable, "-m", "ttftscope", "ui", "--store", store, "--port", str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        driver = chrome()
        try:
            for path in ("overview", "breakdown", "requests", "gaps", "compare", "coldstart", "alerts", "runbook"):
                driver.get(f"http://127.0.0.1:{port}/{path}")
                wait_rendered(driver)
                shot = ARTIFACTS / f"{path}.png"
                driver.save_screenshot(str(shot))
                assert shot.stat().st_size > 10_000
                exc = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
                assert not exc, f"{path}: {[e.text for e in exc]}"
                errs = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stAlertContentError"]')
                assert not errs, f"{path}: {[e.text for e in errs]}"
                assert driver.find_elements(By.CSS_SELECTOR, "h1")
        finally:
            driver.quit()
    finally:
        import psutil

        kids = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(15)  # SIGTERM to `ttftscope ui` only: it must take Streamlit down with it
        proc.wait(30)
        gone, alive = psutil.wait_procs(kids, timeout=30)
        for k in alive:
            k.kill()
        assert not alive, "stopping `ttftscope ui` left its Streamlit child running"
    assert Path(ARTIFACTS / "overview.png").exists()


def test_a_moved_window_shows_the_last_answer_while_the_new_one_computes():
    """Stale-while-revalidate: only a slot's first view computes in front of the viewer."""
    import threading

    from ttftscope.dashboards.ui.refresh import StaleWhileRevalidate

    gate, calls = threading.Event(), []

    def analyse(since: int) -> str:
        calls.append(since)
        if len(calls) > 1:
            assert gate.wait(30), "the test never released the background refresh"
        return f"answer for {since}"

    swr = StaleWhileRevalidate(ttl_s=3600)
    assert swr.get("last hour", (1,), analyse).value == "answer for 1"
    assert swr.get("last hour", (1,), analyse).value == "answer for 1" and calls == [1], "a cache hit computes nothing"
    a = swr.get("last hour", (2,), analyse)  # the window moved: returns while analyse(2) is blocked
    assert a.value == "answer for 1" and a.refreshing
    assert swr.get("last hour", (3,), analyse).value == "answer for 1"
    gate.set()
    assert swr.wait_idle(30)
    assert calls == [1, 2], "one background refresh at a time per slot"
    b = swr.get("last hour", (2,), analyse)
    assert (b.value, b.refreshing, b.error) == ("answer for 2", False, None)
    assert swr.get("other filter", (2,), analyse).value == "answer for 2" and calls == [1, 2, 2], "slots are separate"


def test_a_failed_background_refresh_keeps_the_last_answer_and_says_why():
    from ttftscope.dashboards.ui.refresh import StaleWhileRevalidate

    def analyse(since: int) -> int:
        if since > 1:
            raise ConnectionError("store unreachable")
        return since

    swr = StaleWhileRevalidate(ttl_s=3600, max_slots=2)
    swr.get("s", (1,), analyse)
    swr.get("s", (2,), analyse)
    assert swr.wait_idle(30)
    a = swr.get("s", (1,), analyse)
    assert a.value == 1 and "store unreachable" in (a.error or "")
    with pytest.raises(ConnectionError):  # a new slot has nothing to fall back on: the page shows the error
        swr.get("new", (5,), analyse)
    swr.get("t", (1,), analyse)
    swr.get("u", (1,), analyse)
    assert len(swr._slots) == 2, "LRU-bounded"


def test_a_ui_nobody_looks_at_stays_asleep(tmp_path):
    """`ttftscope ui` with no viewer: streamlit's own command line polled each config.toml it
    knows every 0.2 s on threads of their own (~70 wake-ups a second here, ~6 ms of CPU),
    whatever `server.fileWatcherType` says; the UI takes its configuration from flags and
    leaves those pollers out. What may wake it is the web server's 0.1-s tick (uvicorn's), so
    at most ~25 wake-ups a second are allowed, counted by the kernel over 3 s."""
    import psutil

    port = free_port()
    proc = subprocess.Popen([os.sys.executable, "-m", "ttftscope", "ui", "--store", str(tmp_path / "store"),
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", proc, timeout=90)
        time.sleep(2)  # start-up settled
        (server,) = psutil.Process(proc.pid).children(recursive=True)
        before = wakeups(server.pid)
        time.sleep(3)
        woke = wakeups(server.pid) - before
        assert woke <= 75, f"an idle UI woke {woke} times in 3 s"
    finally:
        try:
            os.killpg(proc.pid, 15)
        except ProcessLookupError:  # it had gone already (the assertion above says why)
            pass
        proc.wait(30)
