"""Child processes the demo, `run` and `sweep` manage: the collector and a vLLM OpenAI server.

Each child gets its own process group, so stopping it (SIGTERM, then SIGKILL after a grace
period) takes every process it spawned (vLLM's engine core and workers) with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from ttftscope.schemas import metrics as M


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to a bind of port 0 (``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free now, for a process started later to listen on: picked below the kernel's
    ephemeral range, so that nothing binding port 0 meanwhile (vLLM's own listeners, torch's
    and ZMQ's) can be handed it. Seen in a CI run when it was the kernel's own pick: a collector
    started after vLLM found its port taken, and vLLM's spans went to whatever held it. The
    kernel's pick where none below the range is free."""
    import random

    low = _ephemeral_low()
    first = max(1024, low - 16384)
    pick = random.SystemRandom()  # (not the ``random`` a test may have seeded)
    for _ in range(64 if first < low else 0):  # (an ephemeral range from 1024 down: the kernel's pick)
        port = pick.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spans_received(collector_url: str) -> float:
    """The collector's count of spans received so far (its /metrics)."""
    text = requests.get(collector_url + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(M.SPANS_RECEIVED))


def settle_quiet_s(env: dict | None = None) -> float:
    """How long no span may arrive before the plugin's exporters count as drained: longer than
    their export interval (``OTEL_BSP_SCHEDULE_DELAY`` in ``env``, default: this process's
    environment, which the vLLM servers it starts inherit) and the engine core's step-flush
    period together (a decode run closing ends up to that much later), with 1.5 s to spare
    for a loaded collector answering."""
    from ttftscope.collector.vllm_plugin.config import FOLD_EVERY_S, PluginConfig

    cfg = PluginConfig.from_env(env)
    return cfg.interval_s + FOLD_EVERY_S + 1.5


def wait_spans_settled(collector_url: str, quiet_s: float | None = None, timeout: float = 60) -> float:
    """Until no span has reached the collector for ``quiet_s`` (default :func:`settle_quiet_s`):
    the plugin's exporters have drained. Call it before stopping vLLM, which may kill its
    engine core without letting it flush."""
    if quiet_s is None:
        quiet_s = settle_quiet_s()
    deadline = time.monotonic() + timeout
    last, since = spans_received(collector_url), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        n = spans_received(collector_url)
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return n
    raise TimeoutError(f"spans still arriving at {collector_url} after {timeout:.0f}s")


def settle(collector_url: str) -> None:
    """wait_spans_settled for the demo, `run` and `sweep`: best effort, never fails them."""
    try:
        wait_spans_settled(collector_url, timeout=30)
    except (TimeoutError, requests.RequestException):
        pass


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: the stop signals that arrived while a command ran (its handler: :func:`interrupt`). Python
#: drops a ``KeyboardInterrupt`` raised inside a finalizer or ``__del__`` ("Exception ignored
#: in"): seen once in CI, where ``kill -INT`` landed in a weakref finalizer while the demo waited
#: for vLLM, and the demo ran on to its end; :func:`check_interrupted` raises it again
INTERRUPTED: list[int] = []


def interrupt(signum: int, _frame) -> None:
    """The demo's, ``run``'s and ``sweep``'s SIGINT and SIGTERM: Ctrl-C's ``KeyboardInterrupt``, remembered."""
    INTERRUPTED.append(signum)
    raise KeyboardInterrupt


def check_interrupted() -> None:
    """At a command's next step or poll: a stop signal came whose ``KeyboardInterrupt`` was dropped."""
    if INTERRUPTED:
        raise KeyboardInterrupt


@contextmanager
def signals_deferred(forward: bool = True) -> Iterator[None]:
    """SIGINT and SIGTERM held back while children are being stopped, then (``forward``) handed to
    the handlers that were there before (Ctrl-C's ``KeyboardInterrupt``; an outer
    ``signals_deferred``, which holds it in turn), or dropped (the last clean-up before leaving).
    A second Ctrl-C in the middle of the clean-up stopped it there and left the children not yet
    stopped running, each in a session of its own. Outside the main thread, where handlers cannot
    be set, nothing is held back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    before = {n: signal.signal(n, lambda signum, _frame: got.append(signum)) for n in _STOP_SIGNALS}
    try:
        yield
    finally:
        for n, h in before.items():
            signal.signal(n, h)
        if got and forward:
            h = before[got[0]]
            if callable(h):
                h(got[0], None)
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), got[0])


def stop_all(children: Iterable[Child], grace: float = 30.0, forward: bool = True) -> None:
    """Stop every child, the last started first, whatever signal comes meanwhile (handed on after
    it, or with ``forward=False`` dropped: the clean-up on the way out)."""
    with signals_deferred(forward):
        for c in reversed(list(children)):
            c.stop(grace=grace)


class Child:
    def __init__(self, cmd: list[str], log: Path, env: dict | None = None, cwd: str | None = None) -> None:
        self.cmd, self.log, self.env, self.cwd = cmd, log, env, cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> Child:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.log, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._f, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                     start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_http(self, url: str, timeout: float, what: str) -> None:
        """Until ``url`` answers 200. A child that does not come up (it exits, the time runs out,
        or Ctrl-C / SIGTERM interrupts the wait) is stopped before the error goes on: its caller
        never got it to stop (vLLM's 30 s start-up was the window a Ctrl-C left a server behind)."""
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                check_interrupted()
                if not self.alive():
                    raise RuntimeError(f"{what} exited with code {self.proc.returncode}; last log lines:\n{self.tail()}")
                try:
                    if requests.get(url, timeout=1).status_code == 200:
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.5)
            raise TimeoutError(f"{what} did not answer at {url} within {timeout:.0f}s; last log lines:\n{self.tail()}")
        except BaseException:
            self.stop(grace=10)
            raise

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM to the child's process group, SIGKILL after ``grace``; a Ctrl-C meanwhile is
        held until the group is gone (``signals_deferred``)."""
        with signals_deferred():
            return self._stop(grace)

    def _stop(self, grace: float) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        try:  # anything left in the group (spawned workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if hasattr(self, "_f"):
            self._f.close()
        return self.proc.returncode


def collector(store: str, workdir: Path, port: int | None = None) -> tuple[Child, str]:
    port = port or free_port()
    c = Child([sys.executable, "-m", "ttftscope", "collect", "--store", store, "--spool", str(workdir / f"spool-{port}"),
               "--listen", f"127.0.0.1:{port}"], workdir / "collector.log").start()
    url = f"http://127.0.0.1:{port}"
    c.wait_http(url + "/healthz", 60, "the collector")
    return c, url


def vllm_args(model: str, port: int, *, tp: int = 1, max_model_len: int = 2048, max_num_batched_tokens: int | None = 128,
              max_num_seqs: int | None = None, chunked_prefill: bool | None = None, prefix_caching: bool | None = None,
              gpu_memory_utilization: float = 0.3, dummy: bool = True, eager: bool = False,
              extra: list[str] | None = None) -> list[str]:
    """The vLLM OpenAI server's command line. vLLM's defaults (torch.compile on) unless
    ``eager``: users run compiled, so the product and its tests do too. ``max_num_batched_tokens``
    None: vLLM's own default (2048 a step for the API server on CPU)."""
    a = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "bfloat16",
         "--max-model-len", str(max_model_len),
         "--gpu-memory-utilization", str(gpu_memory_utilization), "--port", str(port), "--tensor-parallel-size", str(tp)]
    if max_num_batched_tokens is not None:
        a += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if dummy:
        a += ["--load-format", "dummy"]
    if eager:
        a += ["--enforce-eager"]
    if max_num_seqs:
        a += ["--max-num-seqs", str(max_num_seqs)]
    if chunked_prefill is not None:
        a += ["--enable-chunked-prefill" if chunked_prefill else "--no-enable-chunked-prefill"]
    if prefix_caching is not None:
        a += ["--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    return a + list(extra or [])


def vllm_env(endpoint: str | None, run: str, *, tp: int = 1, eager: bool = False, plugin: bool = True,
             extra: dict | None = None) -> dict:
    """The environment of a vLLM server with the ttftscope plugin (``plugin=False``: installed, off)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TTFTSCOPE_RUN": run, "TTFTSCOPE_ENABLED": "1" if plugin else "0"}
    if endpoint:
        env["TTFTSCOPE_ENDPOINT"] = endpoint
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        if not eager:  # a compiled model's collectives are seen through sampled profiler windows
            env.setdefault("TTFTSCOPE_PROFILE_EVERY", "8")
    return {**env, **(extra or {})}


def vllm(model: str, endpoint: str, run: str, workdir: Path, *, tp: int = 1, port: int | None = None,
         timeout: float = 300, **kw) -> tuple[Child, str]:
    port = port or free_port()
    env = vllm_env(endpoint, run, tp=tp, eager=kw.get("eager", False))
    c = Child(vllm_args(model, port, tp=tp, **kw), workdir / f"vllm-{port}.log", env=env, cwd=str(workdir)).start()
    url = f"http://127.0.0.1:{port}"
    c.wait_http(url + "/health", timeout, "the vLLM server")
    return c, url


def ui_command(store_url: str, port: int, host: str = "127.0.0.1") -> tuple[list[str], dict]:
    """The `streamlit run` command line (without its config-file pollers: `dashboards/ui/serve.py`) and
    environment for the UI."""
    import ttftscope.dashboards.ui as ui_pkg

    app = Path(ui_pkg.__file__).with_name("app.py")
    cmd = [sys.executable, "-m", "ttftscope.dashboards.ui.serve", "run", str(app), "--server.port", str(port), "--server.address", host,
           "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
           "--client.toolbarMode", "minimal"]  # no developer toolbar / Deploy button for viewers
    return cmd, {**os.environ, "TTFTSCOPE_STORE": store_url}
