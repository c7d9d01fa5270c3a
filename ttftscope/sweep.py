"""`ttftscope run` (a CI performance gate against your deployment) and `ttftscope sweep`."""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import requests

from .loadgen import Profile

SWEEP_KEYS = {"max_num_seqs": int, "max_num_batched_tokens": int, "chunked_prefill": "bool", "prefix_caching": "bool",
              "gpu_memory_utilization": float}


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "on", "yes"):
        return True
    if v.lower() in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def parse_grid(items: list[str]) -> list[dict]:
    axes = {}
    for it in items:
        k, sep, vals = it.partition("=")
        if not sep or k not in SWEEP_KEYS:
            raise ValueError(f"--grid {it!r}: use KEY=V1,V2 with KEY one of {', '.join(SWEEP_KEYS)}")
        conv = _bool if SWEEP_KEYS[k] == "bool" else SWEEP_KEYS[k]
        try:
            axes[k] = [conv(v) for v in vals.split(",") if v]
        except ValueError as e:
            raise ValueError(f"--grid {it!r}: {e}") from None
    if not axes:
        raise ValueError("give at least one --grid KEY=V1,V2")
    combos = [dict(zip(axes, vs, strict=True)) for vs in itertools.product(*axes.values())]
    if len(combos) > 24:
        raise ValueError(f"{len(combos)} settings is too many for one sweep (max 24)")
    return combos


def record_loadtest(store, res: dict, labels: dict) -> None:
    """Keep the benchmark's own numbers next to the traces (one span per load test)."""
    from ttftscope.schemas.columns import spans_table
    from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

    lo, hi = res["window_ns"]
    key = Attr.LOADTEST
    attrs = {f"{key}.{k}": str(v) for k, v in res.items() if isinstance(v, (int, float, str)) and k != "report"}
    for cls, r in res.get("classes", {}).items():
        attrs.update({f"{key}.priority.{cls}.{k}": str(v) for k, v in r.items() if isinstance(v, (int, float))})
    attrs.update({f"{key}.setting.{k}": str(v) for k, v in labels.items()})
    tid = os.urandom(16).hex()
    store.insert_spans(spans_table([{
        "Timestamp": lo, "Duration": hi - lo, "TraceId": tid, "SpanId": os.urandom(8).hex(), "SpanName": SpanName.LOADTEST,
        "SpanKind": "Internal", "ServiceName": "ttftscope", "ScopeName": "ttftscope", "ScopeVersion": "0.1.0",
        "StatusCode": "Unset", "SpanAttributes": attrs,
        "ResourceAttributes": {ResourceAttr.SERVICE_NAME: "ttftscope", ResourceAttr.RUN: labels.get("run", "")}}]),
        f"loadtest-{tid}")


def run_quiet_s() -> float:
    """How long the stored count of requests may stand still before `ttftscope run` stops waiting
    for the rest: the plugin's export interval, the engine core's step-flush period and 1.5 s to
    spare (:func:`settle_quiet_s`) plus the collector's default flush interval (2 s), when a batch
    it received reaches the store."""
    from ttftscope.servers import settle_quiet_s

    return settle_quiet_s() + 2.0


def wait_for_request_spans(store, window: tuple[int, int], expect: int, quiet_s: float | None = None,
                           timeout: float = 60.0) -> int:
    """The number of request spans (``llm_request``) stored with a start in ``window`` (ns), once
    it reaches ``expect`` or has not moved for ``quiet_s`` (default :func:`run_quiet_s`), or at
    ``timeout``. Says on stderr how many of ``expect`` there are when some are missing."""
    from ttftscope.schemas.vocabulary import SpanName

    quiet_s = run_quiet_s() if quiet_s is None else quiet_s
    sql = (f"SELECT count() FROM otel_traces WHERE SpanName = '{SpanName.REQUEST}' AND "
           "Timestamp >= fromUnixTimestamp64Nano({lo:Int64}) AND Timestamp < fromUnixTimestamp64Nano({hi:Int64})")
    start = time.monotonic()
    deadline, last, since, told = start + timeout, -1, start, False
    while True:
        n = int(store.query(sql, {"lo": window[0], "hi": window[1]}).item())
        now = time.monotonic()
        if n >= expect:
            return n
        if n != last:
            last, since = n, now
        if (n > 0 and now - since >= quiet_s) or now >= deadline:
            hint = ("" if n else " (none at all: is the vLLM server started with the ttftscope plugin, exporting "
                               "to a collector that writes this store?)")
            print(f"ttftscope run: the store holds {n} of {expect} requests' spans; reporting on those{hint}",
                  file=sys.stderr, flush=True)
            return n
        if not told and now - start >= 2.0:
            print(f"waiting for the collector to store the requests' spans ({n} of {expect} so far)",
                  file=sys.stderr, flush=True)
            told = True
        time.sleep(0.5)


def run_command(a) -> int:
    import orjson

    from ttftscope.analyzer import SLO, Analyzer, Window, render_text
    from ttftscope.runner import LoadError, drive, load_profile
    from ttftscope.schemas.store import StoreError, default_store_url, open_store

    try:
        profile = load_profile(a.profile) if a.profile else Profile("steady", num_prompts=60, request_rate=10)
        slo = SLO.from_arg(a.slo)
        if a.settle_s is not None and not 0 < a.settle_s <= 3600:
            raise ValueError(f"--settle-s {a.settle_s:g}: give seconds above 0, at most 3600")
    except ValueError as e:
        print(f"ttftscope run: {e}", file=sys.stderr)
        return 2
    server = a.server.rstrip("/")
    try:
        model = a.model or requests.get(server + "/v1/models", timeout=10).json()["data"][0]["id"]
    except (requests.RequestException, KeyError, IndexError, ValueError) as e:
        print(f"ttftscope run: cannot reach the vLLM server at {server}: {e}", file=sys.stderr)
        return 2

    def alive() -> bool:
        """vLLM says it is healthy (a busy server that answers late counts as alive; one whose
        engine died answers 503)."""
        try:
            return requests.get(server + "/health", timeout=5).status_code == 200
        except requests.Timeout:
            return True
        except requests.RequestException:
            return False

    url = a.store or default_store_url()
    rc = 0
    t0 = time.time_ns()
    print(f"driving {server} ({model}) with profile {profile.name}: {profile.num_prompts} requests", file=sys.stderr)
    try:
        res = drive(server, model, profile, alive)
    except LoadError as e:
        print(f"ttftscope run: {e}", file=sys.stderr)
        res, rc = {"window_ns": (t0, time.time_ns()), "error": str(e)}, 3
    try:
        store = open_store(url)
        wait_for_request_spans(store, (res["window_ns"][0], res["window_ns"][1] + 10**9), res.get("completed", 0) or 1,
                               quiet_s=a.settle_s, timeout=max(60.0, 2 * (a.settle_s or 0)))
        record_loadtest(store, res, {"profile": profile.name, "server": server})
        report = Analyzer(store).analyze(Window(res["window_ns"][0], res["window_ns"][1] + 2 * 10**9), slo)
    except StoreError as e:
        print(f"ttftscope run: {e}", file=sys.stderr)
        return 2
    out = {"benchmark": {k: v for k, v in res.items() if k != "window_ns"}, "report": report}
    if a.json:
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
    else:
        if "error" not in res:
            print(f"benchmark: TTFT p50 {res['median_ttft_ms']:.1f} ms, p99 {res['p99_ttft_ms']:.1f} ms, "
                  f"{res['request_throughput']:.2f} req/s ({res['completed']} completed, {res.get('failed', 0)} failed)")
            for cls, r in sorted(res.get("classes", {}).items()):
                print(f"  priority {cls}: TTFT p50 {r['median_ttft_ms']:.1f} ms, p99 {r['p99_ttft_ms']:.1f} ms, "
                      f"{r['completed']} completed")
        sys.stdout.write(render_text(report))
    if rc:
        return rc
    return 1 if report.get("slo", {}).get("violated") else 0


def sweep_command(a) -> int:
    from ttftscope.analyzer import SLO, Analyzer, Window
    from ttftscope.runner import LoadError, drive, load_profile
    from ttftscope.schemas.store import StoreError, default_store_url, open_store
    from ttftscope.servers import collector, settle, vllm
    from ttftscope.tinymodel import shared_tiny_model

    try:
        combos = parse_grid(a.grid)
        profile = load_profile(a.profile) if a.profile else Profile("steady", num_prompts=40, request_rate=10)
        slo = SLO.from_arg(a.slo)
    except ValueError as e:
        print(f"ttftscope sweep: {e}", file=sys.stderr)
        return 2
    url = a.store or default_store_url()
    base = Path(a.workdir) if a.workdir else Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "ttftscope"
    label = time.strftime("sweep-%Y%m%d-%H%M%S")
    work = base / "runs" / label
    model = a.model or str(shared_tiny_model())
    results = []
    col = None
    try:
        col, col_url = collector(url, work)
        for i, s in enumerate(combos, 1):
            run = f"{label}-{i}"
            print(f"[{i}/{len(combos)}] {s}: restarting vLLM", file=sys.stderr, flush=True)
            srv = None
            try:
                srv, srv_url = vllm(model, col_url + "/v1/traces", run, work, dummy=a.model is None, **s)
                res = drive(srv_url, model, profile, srv.alive)
                results.append((s, run, res, ""))
            except (LoadError, RuntimeError, TimeoutError) as e:
                results.append((s, run, None, str(e).splitlines()[0]))
            finally:
                if srv:
                    try:
                        if srv.alive():
                            settle(col_url)
                    finally:  # (a Ctrl-C during the settle must not leave the server running)
                        srv.stop()
        col.stop(grace=60)
        col = None
        store = open_store(url, create=False)
        an = Analyzer(store)
        rows = []
        for s, run, res, err in results:
            if res is None:
                rows.append({"setting": s, "error": err})
                continue
            record_loadtest(store, res, {**{k: v for k, v in s.items()}, "run": run})
            r = an.analyze(Window(res["window_ns"][0], res["window_ns"][1] + 2 * 10**9, run=run), slo)
            rows.append({"setting": s, "run": run, "p50": r.get("ttft_ms", {}).get("p50"), "p99": r.get("ttft_ms", {}).get("p99"),
                         "throughput": res["request_throughput"], "findings": [f["title"] for f in r.get("findings", [])[:2]],
                         "violated": bool(r.get("slo", {}).get("violated"))})
    except StoreError as e:
        print(f"ttftscope sweep: {e}", file=sys.stderr)
        return 2
    finally:
        if col:
            col.stop()
    ok = [r for r in rows if "error" not in r and r["p99"] is not None]
    print(f"\n{'setting':<50}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s':>8}  notes")
    for r in rows:
        if "error" in r:
            print(f"{str(r['setting']):<50}{'-':>10}{'-':>10}{'-':>8}  failed: {r['error']}")
        else:
            print(f"{str(r['setting']):<50}{r['p50']:>9.1f}m{r['p99']:>9.1f}m{r['throughput']:>8.2f}  "
                  + ("; ".join(r["findings"]) or "no findings"))
    if not ok:
        print("no setting completed")
        return 1
    best_tp = max(r["throughput"] for r in ok)
    eligible = [r for r in ok if r["throughput"] >= 0.95 * best_tp]
    best = min(eligible, key=lambda r: r["p99"])
    worst = max(ok, key=lambda r: r["p99"])
    why = (f"lowest TTFT p99 ({best['p99']:.1f} ms) among settings within 5% of the best throughput "
           f"({best_tp:.2f} req/s)")
    if worst is not best and worst["findings"]:
        why += f"; the slowest setting {worst['setting']} shows: {worst['findings'][0]}"
    print(f"\nrecommended: {best['setting']} — {why}")
    return 0
