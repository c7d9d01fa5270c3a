"""vLLM forks its engine core and workers where it can (its default multiprocessing method on a
GPU host; vLLM's CPU platform here always spawns, so the served tests never fork). A forked child
inherits vLLM's "plugins loaded" flag and never calls the plugin's ``register()``: the plugin
must still register there as what the child is. Real vLLM plugin loader, real forks, processes
named as vLLM names them; in a subprocess (the plugin patches vLLM's classes as it registers)."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import PY, ROOT

SCRIPT = r'''
import json, multiprocessing as mp, os, sys
sys.argv = ["vllm", "serve", "model"]  # the API server, as the plugin tells it
from vllm.plugins import load_general_plugins
load_general_plugins()  # vLLM's own loader: the plugin's entry point, as in vLLM's API server
from ttftscope.collector.vllm_plugin import RT
from ttftscope.collector.vllm_plugin import runtime
def parents_hook():
    pass
runtime.at_exit(parents_hook)  # an exit hook of the parent's (an open run of its steps)
PARENT_PROC = RT.processor
from ttftscope.collector.vllm_plugin import coldstart
coldstart._DONE[0] = True  # the parent's cold start reported (as the API server's is when it serves)

def seen():
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # what EngineCore.__init__ and WorkerBase.__init__ do
    from vllm.v1.core.sched.scheduler import Scheduler
    from ttftscope.collector.vllm_plugin import engine
    p = RT.processor
    return {"role": RT.role, "pid_ok": p is not None and p is not PARENT_PROC and p._t.is_alive(),
            "scheduler_hooked": bool(engine.ST.wrappers) and Scheduler.schedule is engine.ST.wrappers[0],
            "parents_hook": parents_hook in runtime._EXIT_HOOKS, "cold_start_left": not coldstart._DONE[0]}

def worker(q):
    q.put(seen())

def engine_core(q):
    me = seen()
    wq = ctx.Queue()
    w = ctx.Process(target=worker, args=(wq,), name="VllmWorker-0")  # the engine core forks its workers
    w.start(); me["worker"] = wq.get(timeout=120); w.join(60)
    q.put(me)

ctx = mp.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=engine_core, args=(q,), name="EngineCore_DP0")
p.start(); got = q.get(timeout=240); p.join(60)
got["parent_role"] = RT.role
print("@@" + json.dumps(got))
'''


def test_processes_vllm_forks_register_as_what_they_are():
    env = {**os.environ, "TTFTSCOPE_ENDPOINT": "http://127.0.0.1:9/v1/traces", "TTFTSCOPE_EXPORT_PROCESS": "0"}
    env.pop("TTFTSCOPE_ENABLED", None)
    r = subprocess.run([PY, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=400, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("@@")), None)
    assert line is not None, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    got = json.loads(line[2:])
    assert got["parent_role"] == "api_server"
    # the engine core: its own role, its scheduler hooked, its own export thread, none of the parent's exit hooks
    assert (got["role"], got["pid_ok"], got["scheduler_hooked"]) == ("engine_core", True, True), got
    assert not got["parents_hook"] and got["cold_start_left"]  # the parent's exit hooks and cold start left behind
    w = got["worker"]
    assert (w["role"], w["pid_ok"], w["parents_hook"]) == ("worker", True, False), w
