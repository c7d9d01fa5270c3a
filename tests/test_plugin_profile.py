"""bench/plugin_profile's witness: each py-spy sample goes to the right owner.

The stacks are planted (py-spy's raw format, innermost frame last) with the paths of the real
installed modules, so that a change in where ttftscope's code is installed, or in how a sample is
attributed, shows here rather than as a wrong figure in a benchmark."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import plugin_profile as pp  # noqa: E402 - bench/ is not a package
from ttftscope.collector import otel_setup  # noqa: E402
from ttftscope.collector.vllm_plugin import engine, http  # noqa: E402

VLLM = "/venv/lib/python3.11/site-packages/vllm"
OTEL = "/venv/lib/python3.11/site-packages/opentelemetry/sdk/trace/__init__.py"
THREADING = "/usr/lib/python3.11/threading.py"


def fr(func: str, path: str, line: int = 1) -> str:
    return f"{func} ({path}:{line})"


def test_the_innermost_owner_decides() -> None:
    ours = fr("schedule", engine.__file__, 330)
    vllm_loop = fr("step", f"{VLLM}/v1/engine/core.py", 300)
    # vLLM's scheduler running inside the plugin's wrapper: vLLM's work
    assert pp.owner([vllm_loop, ours, fr("schedule", f"{VLLM}/v1/core/sched/scheduler.py", 400)])[0] == pp.VLLM
    # the wrapper's own code: the plugin's, named by the frame that decided it
    who, where = pp.owner([vllm_loop, ours])
    assert who == pp.PLUGIN and where.endswith("collector/vllm_plugin/engine.py)") and where.startswith("schedule ")
    # the OpenTelemetry SDK or the standard library called by the plugin: the plugin's
    assert pp.owner([fr("run", THREADING), fr("_run", otel_setup.__file__), fr("on_end", OTEL)])[0] == pp.PLUGIN


def test_the_web_stack_serving_vllms_app_is_vllms_even_inside_the_middleware() -> None:
    mw = fr("__call__", http.__file__, 150)
    starlette = fr("__call__", "/venv/lib/python3.11/site-packages/starlette/routing.py", 700)
    pydantic = fr("validate", "/venv/lib/python3.11/site-packages/pydantic/main.py", 600)
    assert pp.owner([mw, starlette, pydantic])[0] == pp.VLLM
    # ...but the middleware's own frame, innermost, is the plugin's
    assert pp.owner([starlette, mw])[0] == pp.PLUGIN


def test_vllms_tracing_is_apart_and_the_bench_plugin_is_no_ones() -> None:
    out = fr("process_outputs", f"{VLLM}/v1/engine/output_processor.py", 500)
    assert pp.owner([out, fr("do_tracing", f"{VLLM}/v1/engine/output_processor.py", 880)])[0] == pp.TRACING
    assert pp.owner([out, fr("extract_trace_context", f"{VLLM}/tracing/otel.py", 40)])[0] == pp.TRACING
    waits = fr("acquire_read", str(ROOT / "bench" / "vllm_waits" / "x.py"), 10)
    assert pp.owner([fr("dequeue", f"{VLLM}/distributed/shm.py"), waits])[0] == pp.OTHER
    assert pp.owner([fr("run", THREADING)]) == (pp.OTHER, "")


def test_parse_counts_samples_per_thread_and_owner(tmp_path: Path) -> None:
    ours = fr("_on_first_bytes", http.__file__, 300)
    loop = fr("run", f"{VLLM}/entrypoints/openai/api_server.py", 10)
    raw = tmp_path / "spy.txt"
    raw.write_text(
        f"thread (101): MainThread;{loop};{ours} 7\n"
        f"thread (101): MainThread;{loop} 90\n"
        f"thread (102): ttftscope-export;{fr('_run', otel_setup.__file__)} 3\n"
        f"thread (101): MainThread;{loop};{ours} 2\n"
        "a line py-spy did not write\n")
    got = pp.parse(raw)
    assert set(got) == {101, 102}
    assert got[101]["by"] == {pp.PLUGIN: 9, pp.VLLM: 90}
    assert got[102]["by"] == {pp.PLUGIN: 3}
    (where, n), = got[101]["plugin_at"].items()
    assert n == 9 and where.startswith("_on_first_bytes (collector/vllm_plugin/http.py")
