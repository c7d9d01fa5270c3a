"""Shared UI plumbing: the store and analyzer (cached), the sidebar window/filters, error
boxes instead of tracebacks, the phase colours. No analysis happens here."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import streamlit as st
from ttftscope.analyzer import Analyzer, Window
from ttftscope.dashboards.ui.refresh import StaleWhileRevalidate
from ttftscope.schemas.slo import SLO, default_spec
from ttftscope.schemas.store import StoreError, default_store_url, open_store

SEVERITY_ICON = {"high": "🔴", "medium": "🟠", "low": "🟡"}
WINDOWS = {"auto (last hour, else all data)": None, "last 15 min": 900, "last hour": 3600, "last 6 hours": 6 * 3600,
           "last 24 hours": 86400, "last 7 days": 7 * 86400, "all data": -1}


class UIError(Exception):
    """Shown to the user as a message box, never as a traceback."""


@contextmanager
def guard():
    try:
        yield
    except (StoreError, UIError, ValueError) as e:
        st.error(str(e))
        st.stop()


def store_url() -> str:
    return os.environ.get("TTFTSCOPE_STORE") or default_store_url()


@st.cache_resource(show_spinner=False)
def _analyzer(url: str) -> Analyzer:
    return Analyzer(open_store(url, create=False))


def analyzer() -> Analyzer:
    url = store_url()
    try:
        return _analyzer(url)
    except StoreError as e:
        raise UIError(f"Cannot open the store {url}: {e}") from None


def _data_range(url: str, tick: int) -> tuple[int, int] | None:
    from ttftscope.analyzer.requests import data_range as dr

    return dr(_analyzer(url).store)


def data_range(url: str, tick: int = 0) -> tuple[int, int] | None:
    """First and last request time in the store. Kept like the analyses (a store query here
    would queue behind a background refresh's queries on the shared chDB engine)."""
    return _answers().get(("range", url), (url, tick), _data_range).value


@st.cache_resource(show_spinner=False)
def _answers() -> StaleWhileRevalidate:
    """One per UI process: every session sees the same last answers (see refresh.py)."""
    return StaleWhileRevalidate(ttl_s=60, max_slots=32)


def _answer(kind: str, slot: str, args: tuple, fn, spinner: str):
    with st.spinner(spinner, show_time=True):
        a = _answers().get((kind, slot), args, fn)
    if a.args != args or a.refreshing:
        when = time.strftime("%H:%M:%S", time.localtime(a.computed_at))
        st.caption(f"⟳ showing the analysis from {when} ({a.age_s:.0f} s ago) while a fresh one runs in the "
                   "background; it appears on the next refresh")
    if a.error:
        st.caption(f"the last background refresh failed: {a.error}")
    return a.value


def _report(url: str, since: int, until: int, model: str | None, version: str | None, slo_spec: str | None,
            tick: int) -> dict:
    return _analyzer(url).analyze(Window(since, until, model, version), SLO.parse(slo_spec))


def _decompose(url: str, since: int, until: int, model: str | None, version: str | None, tick: int):
    return _analyzer(url).decompose(Window(since, until, model, version))


def report(w: UIWindow, slo_spec: str | None, tick: int = 0) -> dict:
    """The analyzer's report for the window (shared, never recomputed in front of a viewer
    once the slot has an answer). Treat it as read-only."""
    url = store_url()
    return _answer("report", f"{url}|{w.slot}|{slo_spec}", (url, w.since_ns, w.until_ns, w.model, w.version,
                                                             slo_spec, tick), _report, "analysing…")


def decomposition(w: UIWindow, tick: int = 0):
    """Per-request decomposition frame (1M rows at scale: shared read-only, not copied;
    polars operations never modify it in place)."""
    url = store_url()
    return _answer("decompose", f"{url}|{w.slot}", (url, w.since_ns, w.until_ns, w.model, w.version, tick),
                   _decompose, "decomposing…")


def _compare(url: str, a: tuple, b: tuple) -> dict:
    return _analyzer(url).compare(Window(*a), Window(*b))


def compare(slot: str, a: Window, b: Window) -> dict:
    """Compare two windows (shared answer per slot, refreshed in the background)."""
    url = store_url()
    return _answer("compare", f"{url}|{slot}", (url, (a.since_ns, a.until_ns, a.model, a.version),
                                                (b.since_ns, b.until_ns, b.model, b.version)), _compare, "comparing…")


@dataclass(frozen=True)
class UIWindow(Window):
    """A window plus its slot: what the viewer picked (\"last hour\", filters), which stays
    the same while the exact bounds move with the clock."""

    slot: str = ""


def sidebar_window(key: str = "win") -> UIWindow:
    """The window picker. Returns a Window; stops the page with a message when empty."""
    url = store_url()
    a = analyzer()  # raises UIError when the store cannot be opened
    st.sidebar.caption(f"store: `{url}`")
    choice = st.sidebar.selectbox("Window", list(WINDOWS), key=f"{key}_choice")
    seconds = WINDOWS[choice]
    rng = data_range(url, live_tick())
    if rng is None:
        raise UIError("The store holds no requests yet. Send traces to `ttftscope collect`, or fill it with "
                      "`ttftscope synth --scenario queue-surge`.")
    now = (time.time_ns() // (60 * 10**9) + 1) * 60 * 10**9  # snapped to the minute: reruns hit the cache
    if seconds == -1 or (seconds is None and rng[1] < now - 3600 * 10**9):
        w = Window(rng[0], rng[1] + 10**9)
    elif seconds is None:
        w = Window(now - 3600 * 10**9, now + 10**9)
    else:
        w = Window(now - seconds * 10**9, now + 10**9)
    model = st.sidebar.text_input("Model (exact)", key=f"{key}_model").strip() or None
    version = st.sidebar.text_input("Version (service.version)", key=f"{key}_version").strip() or None
    slo = st.sidebar.text_input("TTFT SLO (ms)", value=default_spec(), key=f"{key}_slo")
    SLO.parse(slo)  # ValueError -> message
    st.session_state["slo_spec"] = slo
    _ = a
    return UIWindow(w.since_ns, w.until_ns, model, version, slot=f"{choice}|{model}|{version}")


def live_tick() -> int:
    """A cache key that changes every 5 s while live refresh is on (else results live 60 s)."""
    return int(time.time() // 5) if st.session_state.get("live") else 0


def fmt_ms(v) -> str:
    return "–" if v is None else f"{v:,.1f} ms"


def table(data, **kw) -> None:
    """``st.dataframe`` with floats rounded for reading (1 decimal from 100 up, else 3)."""
    import polars as pl

    try:
        df = data if isinstance(data, pl.DataFrame) else pl.DataFrame(data)
        floats = [c for c, t in df.schema.items() if t in (pl.Float32, pl.Float64)]
        df = df.with_columns([pl.when(pl.col(c).abs() >= 100).then(pl.col(c).round(1)).otherwise(pl.col(c).round(3))
                              .alias(c) for c in floats])
    except Exception:  # noqa: BLE001 - mixed rows: show them as they are
        df = data
    st.dataframe(df, **kw)
