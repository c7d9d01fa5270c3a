"""``ttftscope doctor``: check an environment before a deployment, as a user would.

vLLM's version against the versions the plugin's adapters were written for, every adapter's
vLLM internals looked up in the installed vLLM (without starting it), the plugin's entry
point, the collector reachable at the configured endpoint, the store writable, and the
sampling / endpoint settings the plugin will use. One table; exit 1 on a problem.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit


@dataclass
class Check:
    what: str
    status: str  # ok | warn | problem | info
    detail: str


def _collector_health_url(endpoint: str) -> str:
    u = urlsplit(endpoint)
    return urlunsplit((u.scheme, u.netloc, "/healthz", "", ""))


def run_checks(store_url: str | None = None, *, check_collector: bool = True) -> list[Check]:
    from ttftscope.collector.vllm_plugin.adapters import (
        KNOWN_VLLM,
        check_all,
        version_known,
        vllm_version,
    )
    from ttftscope.collector.vllm_plugin.config import PluginConfig

    out: list[Check] = []
    v = vllm_version()
    if v == "not installed":
        out.append(Check("vLLM", "problem", "not installed in this environment"))
    elif version_known(v):
        out.append(Check("vLLM", "ok", f"{v} (adapters written for {', '.join(KNOWN_VLLM)})"))
    else:
        out.append(Check("vLLM", "warn", f"{v}: the adapters were written for {', '.join(KNOWN_VLLM)}; "
                                        "each is checked below, a missing internal disables only that adapter"))
    cfg = PluginConfig.from_env()
    if v != "not installed":
        for a in check_all():
            off = a.name in cfg.disabled
            status = "info" if off else ("ok" if a.state == "ok" else "problem")
            detail = "off (TTFTSCOPE_DISABLE)" if off else ("; ".join(a.problems) if a.problems else a.what)
            out.append(Check(f"adapter {a.name} [{'/'.join(sorted(a.roles - {'other'}))}]", status, detail))
    try:
        from importlib.metadata import entry_points

        eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ttftscope"]
        allowed = os.environ.get("VLLM_PLUGINS")
        if not eps:
            out.append(Check("plugin entry point", "problem", "ttftscope is not registered in vllm.general_plugins "
                                                               "(pip install ttftscope in vLLM's environment)"))
        elif allowed is not None and "ttftscope" not in [x.strip() for x in allowed.split(",")]:
            out.append(Check("plugin entry point", "problem", f"VLLM_PLUGINS={allowed!r} leaves ttftscope out"))
        else:
            out.append(Check("plugin entry point", "ok", eps[0].value))
    except Exception as e:  # noqa: BLE001
        out.append(Check("plugin entry point", "warn", f"cannot list entry points: {e}"))
    out.append(Check("plugin enabled", "ok" if cfg.enabled else "warn",
                     "yes" if cfg.enabled else "TTFTSCOPE_ENABLED turns it off"))
    out.append(Check("endpoint", "info", cfg.endpoint))
    ratio_status = "warn" if cfg.sample_ratio == 0 else "info"
    out.append(Check("sampling", ratio_status, f"{cfg.sample_ratio:g} of requests ({cfg.sample_source}); "
                                               "a client's sampled traceparent flag wins"))
    out.append(Check("export", "info", f"every {cfg.interval_s:g}s, batches of {cfg.max_batch}, queue {cfg.max_queue} "
                                       f"spans (dropped past it), timeout {cfg.export_timeout_s:g}s"))
    if not cfg.export_process:
        out.append(Check("export sidecar", "info", "off (TTFTSCOPE_EXPORT_PROCESS): spans are built, encoded and "
                                                   "posted by each vLLM process's export thread"))
    else:
        from ttftscope.collector.handoff import probe

        why = probe(cfg.endpoint)
        out.append(Check("export sidecar", "ok" if why is None else "warn",
                         "starts: spans are built, encoded and posted by a process of its own beside each vLLM process "
                         "(outside vLLM's process tree: it outlives a force-kill; it keeps trying a collector that "
                         f"is down for {cfg.export_linger_s:g}s after its vLLM process has left); the engine core's "
                         + ("steps sorted out there" if cfg.steps_in_sidecar else
                            "steps sorted out in vLLM's process (TTFTSCOPE_STEPS_IN_SIDECAR=0)")
                         if why is None else f"{why} (the plugin exports from vLLM's processes instead)"))
    if cfg.profile_every:
        out.append(Check("profiler windows", "info", f"every {cfg.profile_every}th worker step under torch.profiler"))
    out.append(Check("quiet steps", "info",
                     "every engine step watched (TTFTSCOPE_QUIET_STEPS=all)" if cfg.quiet_steps is None else
                     f"{cfg.quiet_steps} in a row a second watched while the engine only decodes and nothing waits; "
                     "every step around a request's arrival and prefill"))
    if check_collector:
        import requests

        url = _collector_health_url(cfg.endpoint)
        try:
            r = requests.get(url, timeout=3)
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            if r.status_code != 200:
                out.append(Check("collector", "problem", f"{url} answered {r.status_code}"))
            elif body and not body.get("store_healthy", True):
                out.append(Check("collector", "problem", f"{url}: reachable, but its store is down: "
                                                         f"{body.get('store_error')}"))
            elif body.get("max_connections", 0) < body.get("max_connections_asked", 0):
                out.append(Check("collector", "warn", f"{url} reachable, but it can hold only "
                                                      f"{body['max_connections']} connections of the "
                                                      f"{body['max_connections_asked']} asked (its open-file limit; "
                                                      "one a vLLM process exports from): raise it, ulimit -n"))
            else:
                conns = (f"; {body['connections']} of {body['max_connections']} connections open"
                         if "max_connections" in body else "")
                out.append(Check("collector", "ok", f"{url} reachable{conns}"))
        except requests.RequestException as e:
            out.append(Check("collector", "problem", f"{url} unreachable ({type(e).__name__}); start "
                                                     "`ttftscope collect` or set TTFTSCOPE_ENDPOINT"))
    out.append(_store_check(store_url))
    return out


def _store_check(store_url: str | None) -> Check:
    from pathlib import Path

    from ttftscope.schemas.store import StoreError, default_store_url, open_store, redact_url

    url = store_url or default_store_url()
    shown = redact_url(url)
    if "://" in url and not url.startswith("file://"):
        try:
            st = open_store(url)
            st.ping()
            st.close()
            return Check("store", "ok", f"{shown} reachable")
        except StoreError as e:
            return Check("store", "problem", f"{shown}: {e}")
    path = Path(url.removeprefix("file://")).expanduser()
    probe = path if path.exists() else next((p for p in path.parents if p.exists()), None)
    if probe is None or not os.access(probe, os.W_OK):
        return Check("store", "problem", f"{shown} is not writable by this user")
    if (path / "manifest.json").exists():
        try:
            s = open_store(str(path), create=False).stats()
            return Check("store", "ok", f"{shown} writable: {s['parts']} parts, {s['rows']} spans"
                                        + (f", {s['quarantined']} quarantined" if s.get("quarantined") else ""))
        except StoreError as e:
            return Check("store", "problem", f"{shown}: {e}")
    return Check("store", "ok", f"{shown} writable (created on first use)")


def render(checks: list[Check]) -> str:
    w = max(len(c.what) for c in checks)
    mark = {"ok": "ok", "warn": "WARN", "problem": "PROBLEM", "info": "--"}
    return "\n".join(f"{c.what:<{w}}  {mark[c.status]:<7}  {c.detail}" for c in checks)
