"""bench/plugin_profile: the plugin's CPU in vLLM's processes by sampling, a witness for its own
accounting that does not come from the plugin.

The plugin's accounting (TTFTSCOPE_SELF_TIMING, bench/overhead's ``accounted`` mode) times its hook
bodies and its threads from inside. What runs around the hook bodies it does not time: each
wrapper's own layer (the call into vLLM's original, the clock reads), the ASGI middleware's
pass-through of every request and response, the render timer's coroutine, and vLLM's own tracing,
which the plugin turns on (``OutputProcessor.do_tracing``: the trace context parsed, the attributes
of ``llm_request`` built, once a request). Here a server runs the plugin as users run it (no
accounting) under bench/overhead's load, and py-spy samples its API server and its engine core
(one py-spy each, ``--gil``: at each tick the thread holding the GIL, the only one that can run
Python; ``--nonblocking``: the process is never paused). Each sample goes to an owner: walking out
from the innermost frame, the first frame of ttftscope's own code makes it **the plugin's**; one
of vLLM's tracing (``vllm/tracing``, ``do_tracing``) **vLLM's tracing, on because of the plugin**;
any other of vLLM's, or of the web stack that serves vLLM's app (starlette, fastapi, uvicorn,
pydantic ...) **vLLM's**; frames of the standard library and of other packages (asyncio,
threading, pickle, OpenTelemetry) are passed over to the next one out.

* The plugin's code in **vLLM's threads** (hooks, their wrappers, the middleware): its samples over
  the sampling rate — Python runs only while its thread holds the GIL, so that is the time it ran.
  (The samples over the rate agree with the sampled threads' CPU from /proc to within a few % in
  the API server; in the engine core they come to about half of it: vLLM's queue readers spin in
  ``sched_yield`` without the GIL.)
* The plugin's **own threads** (``ttftscope-*``: export, step-flush): their whole CPU from /proc,
  wake-ups and system calls included, which samples of the GIL would miss.

In the same run, rounds interleaved, bench/overhead's ``accounted`` mode gives the plugin's own
figures for the same two parts (hooks net of the timing's cost; the same threads' CPU as it reads
it). The export sidecars are the plugin's processes, not vLLM's: their whole CPU is shown apart.
Each sample is 1/rate of a second: the sampled figures move in steps of 1e6 / (rate x requests) µs
a request, so the requests are many (1,200: two minutes a mode at 10 req/s) rather than the rate
high — at 2,000 samples a second two py-spy processes fell behind on this VM's two cores (the API
server's samples over the rate 0.75 of its CPU, against 0.91-0.99 at 1,000 and 200).

Needs py-spy (``pip install py-spy``, or the ``bench`` extra). Usage:
python bench/plugin_profile.py [--rounds 2] [--num-prompts 1200] [--rate 10] [--spy-rate 1000]
[--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import overhead  # noqa: E402 - bench/overhead: the same load, server and accounted mode
import ttftscope.analyzer  # noqa: E402
import ttftscope.collector  # noqa: E402
import ttftscope.schemas  # noqa: E402
from ttftscope.collector.handoff import sidecars_of  # noqa: E402

import ttftscope  # noqa: E402
from support.procs import VllmServer  # noqa: E402
from ttftscope.loadgen import Profile  # noqa: E402

PLUGIN, TRACING, VLLM, OTHER = "plugin", "vllm tracing", "vllm", "other"
#: where ttftscope's code is, as installed (an editable install maps its packages onto the repository's folders)
_OURS = tuple(sorted({str(Path(m.__file__).resolve().parent) + os.sep
                      for m in (ttftscope, ttftscope.collector, ttftscope.schemas, ttftscope.analyzer)}))
_BENCH = str(BENCH) + os.sep
#: the API server's web stack: code that serves vLLM's app (parsing, validating, routing, writing
#: responses), vLLM's work whoever's frame is further out (the plugin's middleware wraps the app)
_WEB = tuple(f"{os.sep}{p}{os.sep}" for p in ("starlette", "fastapi", "uvicorn", "anyio", "pydantic", "h11",
                                              "httptools", "prometheus_fastapi_instrumentator", "sse_starlette"))


def _short(path: str) -> str:
    """A path of ttftscope's code from its package's folder (collector/vllm_plugin/http.py)."""
    p = Path(path)
    for base in _OURS:
        if path.startswith(base):
            return str(Path(Path(base).name) / p.relative_to(base))
    return p.name


def owner(frames: list[str]) -> tuple[str, str]:
    """(owner, the frame that decided it) of one sampled stack, innermost frame last. A frame is
    ``func (path:line)``; the web stack that serves vLLM's app (``_WEB``) counts as vLLM's; the
    bench's own vLLM plugin (bench/vllm_waits) is neither ours nor vLLM's: "other"."""
    for f in reversed(frames):
        i = f.rfind(" (")
        func, path = f[:i], f[i + 2:f.rfind(":")]
        if path.startswith(_OURS):
            return PLUGIN, f"{func} ({_short(path)})"
        if path.startswith(_BENCH):
            return OTHER, func
        if "/vllm/" in path or any(w in path for w in _WEB):
            if "/vllm/tracing/" in path or path.endswith("/vllm/tracing.py") or func.endswith("do_tracing"):
                return TRACING, func
            return VLLM, func
    return OTHER, ""


def parse(raw: Path) -> dict[int, dict]:
    """py-spy's raw output of one process (``thread (TID): name;frame;...;frame COUNT``) -> per
    thread: samples by owner, and the plugin's samples by the frame that decided them."""
    out: dict[int, dict] = {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack.startswith("thread (") or not n.isdigit():
            continue
        parts = stack.split(";")
        tid = int(parts[0][8:parts[0].index(")")])
        who, where = owner(parts[1:])
        t = out.setdefault(tid, {"by": Counter(), "plugin_at": Counter()})
        t["by"][who] += int(n)
        if who == PLUGIN:
            t["plugin_at"][where] += int(n)
    return out


def _threads_cpu(pid: int) -> dict[int, float]:
    """tid -> CPU seconds so far (/proc, user + system)."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def _comm(pid: int, tid: int) -> str:
    """A thread's native name (the plugin names its threads ``ttftscope-*``)."""
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def _roles(pid: int) -> dict[str, list[int]]:
    """role -> pids of vLLM's process tree (roles as bench/overhead names them)."""
    root = psutil.Process(pid)
    out: dict[str, list[int]] = {}
    tree = [root, *root.children(recursive=True)]
    for p in tree + sidecars_of(p.pid for p in tree):  # (the sidecars are not in vLLM's tree)
        out.setdefault(overhead._role_of(p), []).append(p.pid)
    return out


#: the processes sampled (the worker of a compiled TP=1 model runs nothing of the plugin's per
#: request: its accounted cost is ~2 µs a request)
SAMPLED = ("api_server", "engine_core")


class Spy:
    """Held over bench/overhead's measured load (``one(..., around=Spy(...))``): py-spy on the
    server's API server and engine core (one each, ``--gil``: the thread holding the GIL at each
    tick), and their threads' CPU (/proc) and names read at both ends."""

    def __init__(self, tmp: Path, spy: str, rate: int) -> None:
        self.tmp, self.spy, self.rate = tmp, spy, rate

    def __call__(self, srv: VllmServer) -> Spy:
        self.pid = srv.proc.pid
        return self

    def __enter__(self) -> Spy:
        roles = _roles(self.pid)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.procs = {}
        for role in SAMPLED:
            pid, raw = roles[role][0], self.tmp / f"spy-{role}.txt"
            self.procs[role] = (pid, subprocess.Popen(
                [self.spy, "record", "--pid", str(pid), "--gil", "--nonblocking", "--threads", "--full-filenames",
                 "--format", "raw", "--rate", str(self.rate), "-o", str(raw)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), raw)
        time.sleep(1.0)  # py-spy attached
        self.cpu0 = {role: _threads_cpu(pid) for role, (pid, _, _) in self.procs.items()}
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.cpu1 = {role: _threads_cpu(pid) for role, (pid, _, _) in self.procs.items()}
            self.names = {role: {tid: _comm(pid, tid) for tid in self.cpu1[role]}
                          for role, (pid, _, _) in self.procs.items()}
            for role, (_, proc, raw) in self.procs.items():
                proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
                err = proc.communicate(timeout=60)[1].decode(errors="replace")
                if exc[0] is None and not raw.exists():
                    raise RuntimeError(f"py-spy wrote nothing for the {role}: {err[-2000:]}")
        finally:
            for _, proc, _ in self.procs.values():
                if proc.poll() is None:
                    proc.kill()

    def figures(self, requests: int) -> dict[str, dict]:
        """Per sampled role, µs of CPU a request: ``direct_us`` by owner, its samples over the
        sampling rate (Python runs only while its thread holds the GIL: the time it ran);
        ``in_vllm_threads_us``, the plugin's of them in vLLM's threads; ``own_threads_us``, the
        plugin's threads' whole CPU (/proc); ``agreement``, samples over the rate, over the CPU of
        the threads sampled (1.0: every CPU-second held the GIL and was sampled; less: CPU spent
        without it, or ticks missed)."""
        n, out = max(requests, 1), {}
        for role, (_, _, raw) in self.procs.items():
            threads = parse(raw)
            r = out[role] = {"cpu_us": 0.0, "direct_us": Counter(), "plugin_at_us": Counter(), "samples": 0,
                             "sampled_cpu_s": 0.0, "own_threads_us": 0.0, "in_vllm_threads_us": 0.0}
            for tid, c1 in self.cpu1[role].items():
                cpu = c1 - self.cpu0[role].get(tid, 0.0)
                r["cpu_us"] += cpu / n * 1e6
                t = threads.get(tid)
                if self.names[role][tid].startswith("ttftscope"):  # the plugin's own threads: all their CPU
                    r["own_threads_us"] += cpu / n * 1e6
                elif t is not None:  # vLLM's threads: the plugin's code in them, by its samples
                    r["in_vllm_threads_us"] += t["by"][PLUGIN] / self.rate / n * 1e6
                if t is None:
                    continue
                r["samples"] += sum(t["by"].values())
                r["sampled_cpu_s"] += cpu
                for who, k in t["by"].items():
                    r["direct_us"][who] += k / self.rate / n * 1e6
                for where, k in t["plugin_at"].items():
                    r["plugin_at_us"][where] += k / self.rate / n * 1e6
            r["agreement"] = r["samples"] / self.rate / max(r["sampled_cpu_s"], 1e-9)
        return out


def sampled(tmp: Path, profile: Profile, collector_dir: Path, spy: str, rate: int) -> dict:
    """bench/overhead's ``plugin`` mode (the plugin as users run it: no accounting) with its load
    sampled (:class:`Spy`); the export sidecars' CPU from that mode's own /proc reading."""
    s = Spy(tmp / "spy", spy, rate)
    res = overhead.one("plugin", tmp, profile, collector_dir, around=s)
    roles = s.figures(res["completed"])
    roles["export_sidecar"] = {"cpu_us": res["vllm_cpu_s"].get("export_sidecar", 0.0) / max(res["completed"], 1) * 1e6}
    return {"completed": res["completed"], "ttft_p50": res["ttft_p50"], "roles": roles}


def accounted(own: dict, completed: int) -> tuple[float, float]:
    """bench/overhead's accounted figures for one role, µs a request: (hooks net of the timing's
    own cost: the plugin's code in vLLM's threads; its export and step-flush threads)."""
    return (overhead.net_hooks(own, completed)[1],
            own.get("export_us_per_req", 0.0) + own.get("background_us_per_req", 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=1200)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--spy-rate", type=int, default=1000, help="py-spy samples a second, per process")
    ap.add_argument("--collector-dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="keep py-spy's samples (spy-ROLE.txt, one folder a round) and the servers' logs in DIR")
    a = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("bench/plugin_profile needs py-spy: pip install py-spy")
    profile = Profile(num_prompts=a.num_prompts, request_rate=a.rate, input_len=256, output_len=a.output_len,
                      range_ratio=0.5)
    spied, acc = [], []
    with tempfile.TemporaryDirectory() as d:
        d = str(a.keep) if a.keep else d
        for r in range(a.rounds):
            s = sampled(Path(d) / f"sampled-{r}", profile, a.collector_dir, spy, a.spy_rate)
            spied.append(s)
            agree = ", ".join(f"{k} {v['agreement']:.2f}" for k, v in s["roles"].items() if "agreement" in v)
            print(f"round {r + 1} sampled   TTFT p50 {s['ttft_p50']:7.2f} ms, {s['completed']} requests; samples / "
                  f"rate over the sampled threads' CPU: {agree}", flush=True)
            x = overhead.one("accounted", Path(d) / f"accounted-{r}", profile, a.collector_dir)
            acc.append(x)
            print(f"round {r + 1} accounted TTFT p50 {x['ttft_p50']:7.2f} ms, {x['completed']} requests", flush=True)
    print("\nµs of CPU a request, median over rounds. sampled: the plugin's code in vLLM's threads (hooks, their wrappers,\n"
          "the middleware) and vLLM's tracing, py-spy's samples of each over its rate; the plugin's own threads (export,\n"
          "step-flush), their CPU from /proc. accounted: the plugin's own accounting, hooks net of the timing's cost,\n"
          "and the same threads' CPU as they read it")
    print(f"{'':<14}{'':>8}{'--- in vLLM threads ---':>26}{'-- own threads --':>20}{'---- all ----':>18}")
    print(f"{'process':<14}{'CPU':>8}{'sampled':>9}{'accounted':>11}{'tracing':>8}{'sampled':>9}{'accounted':>11}"
          f"{'sampled':>9}{'accounted':>10}{'samples':>9}")
    for role in SAMPLED:
        runs = [s["roles"][role] for s in spied]
        own = [accounted(x["own"][role], x["completed"]) for x in acc if role in x.get("own", {})]
        hooks = statistics.median(h for h, _ in own) if own else float("nan")
        threads = statistics.median(b for _, b in own) if own else float("nan")
        inv = statistics.median(x["in_vllm_threads_us"] for x in runs)
        mine = statistics.median(x["own_threads_us"] for x in runs)
        print(f"{role:<14}{statistics.median(x['cpu_us'] for x in runs):8.0f}{inv:9.1f}{hooks:11.1f}"
              f"{statistics.median(x['direct_us'][TRACING] for x in runs):8.1f}{mine:9.1f}{threads:11.1f}"
              f"{inv + mine:9.1f}{hooks + threads:10.1f}{statistics.median(x['samples'] for x in runs):9.0f}")
    print(f"{'export sidecars':<16}{statistics.median(s['roles']['export_sidecar']['cpu_us'] for s in spied):9.0f}"
          "  (the plugin's own processes, not vLLM's: all of it)")
    print("\nwhere the plugin's samples are (the innermost frame of ttftscope's code), µs a request, mean over rounds:")
    for role in SAMPLED:
        at: dict[str, float] = {}
        for s in spied:
            for where, us in s["roles"][role]["plugin_at_us"].items():
                at[where] = at.get(where, 0.0) + us / len(spied)
        print(f"  {role}:")
        for where, us in sorted(at.items(), key=lambda kv: -kv[1])[:10]:
            print(f"    {us:7.1f}  {where}")


if __name__ == "__main__":
    main()
