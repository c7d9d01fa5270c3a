"""The plugin's CUDA paths on a real GPU (skipped where there is none, as on CI).

What runs for real: CUDA events, CUDA graph capture and replay, torch.profiler (CUPTI) over a
graph replay, and a Triton kernel on the current stream. vLLM itself cannot be installed on the
lent GPU machine (no package registry there; its CUDA wheel is far over what can be carried),
so the one vLLM class the eager path wraps, ``CudaCommunicator``, is a stand-in with vLLM's
module path, class name and ``all_reduce`` signature whose ``all_reduce`` runs a real kernel.
The collective kernel is a Triton kernel named as vLLM's custom all-reduce kernel is
(``cross_device_reduce_1stage``): one GPU cannot run a real two-rank collective.

Run on a GPU machine: ``pytest tests/gpu -p no:cacheprovider --noconftest``.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from ttftscope.collector.vllm_plugin import runtime, worker  # noqa: E402
from ttftscope.schemas.vocabulary import Attr, SpanName  # noqa: E402

N = 1 << 24  # 64 MiB of float32: a kernel long enough to time (~tens of µs on a datacentre GPU)


@triton.jit
def cross_device_reduce_1stage(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # vLLM's custom all-reduce kernel's name
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2.0, mask=m)


def reduce_(x, y) -> None:
    cross_device_reduce_1stage[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)


@dataclass
class Rec:
    name: str
    start: float
    end: float
    attrs: dict


class Recorder:
    """Takes the plugin's finished spans where its export queue would."""

    def __init__(self) -> None:
        self.spans: list[Rec] = []

    def add(self, name, start, end, attrs, parent=None) -> None:
        self.spans.append(Rec(name, start, end, dict(attrs)))

    def named(self, name: str) -> list[Rec]:
        return [s for s in self.spans if s.name == name]


@pytest.fixture
def rec(monkeypatch) -> Recorder:
    r = Recorder()
    monkeypatch.setattr(runtime.RT, "deferred", r)
    return r


def kernel_ms(x, y, reps: int = 20) -> float:
    """The witness: the kernel's own time by CUDA events, launched alone, mean of ``reps``."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reduce_(x, y)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        reduce_(x, y)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def _graph(body) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up off the capture (Triton compiles on the first call)
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()
    return g


def _profiled_step(g: torch.cuda.CUDAGraph) -> tuple[float, float, worker.WorkerState]:
    """One sampled step around a graph replay, as the worker adapter runs it; the step ends
    synchronised, as vLLM's does when the sampled tokens reach the host."""
    ws = worker.WorkerState(step=7, rank=0, tp=2, engine="engine-gpu", eager=False)

    def execute_model():
        g.replay()
        torch.cuda.synchronize()

    t0 = time.time()
    worker._profiled(ws, execute_model)
    t1 = time.time()
    for t in threading.enumerate():
        if t.name == "ttftscope-profile":
            t.join(60)
    return t0, t1, ws


def _what_the_profiler_saw(g) -> list[tuple[str, str]]:
    """For a failure's message: every event of a profiled replay, (name, device type)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    return [(e.name[:70], str(e.device_type)) for e in prof.events()]


def test_sampled_window_finds_collective_kernels_replayed_from_a_cuda_graph(rec):
    """Compiled/graph mode: no Python hook runs inside the graph, so the sampled profiler
    window is the only measure; it must find each collective kernel of the replay, at the
    kernel's own size, inside the step, and sum them into one step span."""
    x, y = torch.randn(N, device="cuda"), torch.empty(N, device="cuda")
    w = torch.randn(2048, 2048, device="cuda")
    calls = 4

    def body():  # a layer's shape: compute, then the all-reduce of its output
        for _ in range(calls):
            w @ w
            reduce_(x, y)

    g = _graph(body)
    witness = kernel_ms(x, y)
    t0, t1, _ = _profiled_step(g)

    got = rec.named(SpanName.ALLREDUCE_CALL)
    assert len(got) == calls, (rec.spans, _what_the_profiler_saw(g))
    assert all("cross_device_reduce_1stage" in s.attrs[Attr.COLLECTIVE] for s in got)
    assert all(s.attrs[Attr.SAMPLED] and s.attrs[Attr.STEP] == 7 for s in got)
    ms = [(s.end - s.start) * 1e3 for s in got]
    print(f"profiled kernel {sorted(ms)} ms vs CUDA events {witness:.4f} ms; step {t0:.6f}..{t1:.6f}, "
          f"calls {[(s.start, s.end) for s in got]}")
    for m in ms:
        assert m == pytest.approx(witness, rel=0.3, abs=0.005)
    slack = 0.05  # the profile's clock is mapped to wall time from the window's first event
    assert all(t0 - slack <= s.start <= s.end <= t1 + slack for s in got)
    (step,) = rec.named(SpanName.ALLREDUCE)  # compiled: the window is the step's only measure
    assert step.attrs[Attr.ALLREDUCE_COUNT] == calls
    # wall-clock seconds near 1.8e9 hold ~0.2 µs: compare to a µs
    assert (step.end - step.start) * 1e3 == pytest.approx(sum(ms), abs=1e-3)


def test_sampled_window_of_a_step_without_collectives_emits_nothing(rec):
    w = torch.randn(2048, 2048, device="cuda")
    g = _graph(lambda: [w @ w for _ in range(4)])
    _profiled_step(g)
    assert rec.named(SpanName.ALLREDUCE_CALL) == [] and rec.named(SpanName.ALLREDUCE) == []


@pytest.fixture
def stand_in_comm(monkeypatch):
    """A stand-in for ``vllm.distributed.device_communicators.cuda_communicator`` (vLLM cannot
    be installed on the GPU machine): vLLM's module path, class name and ``all_reduce(input_)``
    signature; the call runs a real kernel on the current stream and returns a new tensor."""
    names = ["vllm", "vllm.distributed", "vllm.distributed.device_communicators"]
    for n in names:
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    mod = types.ModuleType(worker._CUDA_COMM)

    class CudaCommunicator:
        def all_reduce(self, input_):
            out = torch.empty_like(input_)
            reduce_(input_, out)
            return out

    mod.CudaCommunicator = CudaCommunicator
    monkeypatch.setitem(sys.modules, worker._CUDA_COMM, mod)
    monkeypatch.setattr(sys.modules[names[-1]], "cuda_communicator", mod, raising=False)
    ws = worker.WorkerState(step=3, rank=0, tp=2, engine="engine-gpu", eager=True)
    monkeypatch.setattr(worker, "WS", ws)
    worker._install_cuda_allreduce_eager()
    assert CudaCommunicator.all_reduce.__wrapped__ is not None  # ours, around vLLM's
    return CudaCommunicator(), ws


def _step_start(ws) -> None:
    worker._on_exec_start(ws, types.SimpleNamespace(_ttftscope_step=ws.step))


def test_eager_collectives_are_timed_by_cuda_events_at_the_kernels_size(rec, stand_in_comm):
    """As in serving, the GPU is behind the host (kernels queued ahead of the collective), so
    the events bracket the collective's kernel alone."""
    comm, ws = stand_in_comm
    x = torch.randn(N, device="cuda")
    witness = kernel_ms(x, torch.empty_like(x))
    _step_start(ws)
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU work queued ahead
    for _ in range(3):
        out = comm.all_reduce(x)
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2.0)
    worker._on_exec_end(ws)
    (s,) = rec.named(SpanName.ALLREDUCE)
    assert s.attrs[Attr.ALLREDUCE_COUNT] == 3 and s.attrs[Attr.ALLREDUCE_BYTES] == 3 * x.numel() * 4
    print(f"events {(s.end - s.start) * 1e3:.4f} ms for 3 calls vs witness 3 x {witness:.4f} ms")
    assert (s.end - s.start) * 1e3 == pytest.approx(3 * witness, rel=0.3, abs=0.015)
    assert ws.cuda_pending == []


def test_eager_step_end_never_waits_for_the_gpu(rec, stand_in_comm):
    """The step's end reads only finished events (``query``), never synchronises: a collective
    still running stays pending, and is counted at a later step's end."""
    comm, ws = stand_in_comm
    x = torch.randn(N, device="cuda")
    _step_start(ws)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued before the collective
    comm.all_reduce(x)
    worker._on_exec_end(ws)
    assert rec.named(SpanName.ALLREDUCE) == []
    assert len(ws.cuda_pending) == 1 and not ws.cuda_pending[0][1].query()  # still running: not waited for
    torch.cuda.synchronize()
    _step_start(ws)  # the next step
    worker._on_exec_end(ws)
    (s,) = rec.named(SpanName.ALLREDUCE)
    assert s.attrs[Attr.ALLREDUCE_COUNT] == 1 and ws.cuda_pending == []


def test_eager_wrapper_stays_out_of_cuda_graph_capture(rec, stand_in_comm):
    """Inside a capture the wrapper records no event (a timing event in a capture would break it):
    the graph captures vLLM's call alone, and replays it."""
    comm, ws = stand_in_comm
    x = torch.randn(N, device="cuda")
    _step_start(ws)
    comm.all_reduce(x)  # warm (Triton compiles) outside the capture
    torch.cuda.synchronize()
    worker._on_exec_end(ws)
    before = len(rec.named(SpanName.ALLREDUCE))
    _step_start(ws)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = comm.all_reduce(x)
    assert ws.cuda_pending == []
    x.copy_(torch.arange(N, device="cuda", dtype=torch.float32))
    _step_start(ws)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2.0)
    worker._on_exec_end(ws)
    assert len(rec.named(SpanName.ALLREDUCE)) == before  # the replayed call was not timed (no event in the graph)
