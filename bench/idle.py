"""bench/idle: what ttftscope's own processes cost a host while nothing happens.

A collector beside vLLM, or a UI nobody is looking at, should stay asleep. This starts each,
waits for start-up to settle, then reads for --seconds from /proc (all threads): CPU per
second and wake-ups per second (voluntary context switches, the kernel's count of a thread's
sleeps), each next to a baseline in the same run, interleaved over --rounds:

  engine     ttftscope's chDB engine (``schemas.engine.session()``, its memory worker at a
             1-s tick) against a default chDB session (the worker at 50 ms), each idle in a
             process of its own after one query
  ui         ``ttftscope ui`` (``dashboards/ui/serve.py``) against ``python -m streamlit run``
             with the same app and flags (streamlit's config-file pollers on)
  collector  ``ttftscope collect`` on an empty spool (no baseline: the figure itself)

Usage: python bench/idle.py [--rounds 3] [--seconds 10] [--only engine,ui,collector]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.procs import CollectorProc, cpu_s, free_port, wait_http, wakeups  # noqa: E402
from ttftscope.servers import ui_command  # noqa: E402

ENGINE = """
import sys, time
if sys.argv[1] == "ours":
    from ttftscope.schemas import engine
    with engine.LOCK:
        engine.session().query("SELECT 1", "CSV")
else:
    from chdb import session
    s = session.Session()
    s.query("SELECT 1", "CSV")
print("ready", flush=True)
time.sleep(3600)
"""


def measure(pid: int, seconds: float) -> tuple[float, float]:
    """(ms of CPU a second, wake-ups a second) of a live process over ``seconds``."""
    c0, w0 = cpu_s(pid), wakeups(pid)
    time.sleep(seconds)
    return (cpu_s(pid) - c0) * 1000 / seconds, (wakeups(pid) - w0) / seconds


def run_engine(which: str, seconds: float) -> tuple[float, float]:
    p = subprocess.Popen([sys.executable, "-c", ENGINE, which], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(2)
        return measure(p.pid, seconds)
    finally:
        p.kill()
        p.wait(30)


def run_ui(which: str, seconds: float, tmp: Path) -> tuple[float, float]:
    port = free_port()
    cmd, env = ui_command(str(tmp / "store"), port)
    if which == "streamlit":  # the same app and flags through streamlit's own command line
        cmd[cmd.index("ttftscope.dashboards.ui.serve")] = "streamlit"
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", p, timeout=90)
        time.sleep(3)
        return measure(p.pid, seconds)
    finally:
        p.terminate()
        p.wait(30)


def run_collector(seconds: float, tmp: Path) -> tuple[float, float]:
    col = CollectorProc(str(tmp / "cstore"), tmp / "spool", flush_interval=2.0).start()  # (its default interval)
    try:
        col.wait_compiled(120)  # its compiled passes are built at start-up (seconds on a cold cache)
        time.sleep(3)
        return measure(col.proc.pid, seconds)
    finally:
        col.terminate()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--only", default="engine,ui,collector")
    a = ap.parse_args()
    only = set(a.only.split(","))
    res: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(a.rounds):
            if "engine" in only:
                for which in ("ours", "default"):
                    res.setdefault(f"engine {which}", []).append(run_engine(which, a.seconds))
            if "ui" in only:
                for which in ("ours", "streamlit"):
                    res.setdefault(f"ui {which}", []).append(run_ui(which, a.seconds, tmp))
            if "collector" in only:
                res.setdefault("collector", []).append(run_collector(a.seconds, tmp))
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(f"idle, {a.seconds:.0f} s a reading, {a.rounds} interleaved rounds (median; each round's in brackets)")
    for name, vals in res.items():
        cpu = [v[0] for v in vals]
        wake = [v[1] for v in vals]
        print(f"  {name:18s} {statistics.median(cpu):6.2f} ms of CPU a second {[round(c, 2) for c in cpu]}   "
              f"{statistics.median(wake):6.1f} wake-ups a second {[round(w, 1) for w in wake]}")
    for ours, base in (("engine ours", "engine default"), ("ui ours", "ui streamlit")):
        if ours in res and base in res:
            o = statistics.median(v[0] for v in res[ours])
            b = statistics.median(v[0] for v in res[base])
            print(f"  {ours.split()[0]}: {o:.2f} against {b:.2f} ms of CPU a second = {o / b if b else float('nan'):.2f} x its baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
