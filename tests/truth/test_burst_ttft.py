"""Truth on real vLLM: in a burst, the report's TTFT is still the client's.

Bursts of 50 streaming requests sent at once (the stopwatch, one thread a request, at real-time
priority): the API server's event loop accepts and reads them one after the other, so the last
ones' bytes wait at its socket for tens of milliseconds before uvicorn reads them. Measured here
before the fix: the report's TTFT 39 ms short of the client's on average (median 30, most 163 ms),
because the window opened at the read. It now opens when the bytes reached the socket (the
kernel's ``tcpi_last_data_recv``: collector/vllm_plugin/http.socket_wait_s), counted less one
tick of the kernel's clock so that it is never longer than the client's: the report stays within
two ticks (8 ms at this VM's HZ=250) of the client, per request.
"""

from __future__ import annotations

import functools

import pytest
from ttftscope.collector.vllm_plugin.http import kernel_tick_s

from support.truth import WITNESS_MAX_WAIT_MS, drive_burst, served

pytestmark = pytest.mark.slow  # a real vLLM server


@pytest.fixture(scope="module")
def bursts(tmp_path_factory):
    return served(tmp_path_factory.mktemp("bursts"), "bursts",
                  drive=functools.partial(drive_burst, bursts=3, size=50, max_tokens=8))


def test_in_a_burst_the_report_ttft_is_the_clients_per_request(bursts):
    df, _ = bursts
    tick_ms = kernel_tick_s() * 1e3
    diff = df["client_ms"] - df["ttft"] / 1e6
    print(f"client - report (ms), tick {tick_ms:.1f}: p10 {diff.quantile(0.1):.2f} median {diff.median():.2f} "
          f"p90 {diff.quantile(0.9):.2f} most {diff.max():.2f}; client TTFT median {df['client_ms'].median():.1f} ms")
    # the burst's stopwatch waits once for all its requests (its process's CPU wait over the burst):
    # what it adds to a request's time is at most that
    wait = df["client_cpu_wait_ms"]
    # (the harness's bound on a witness's wait, as every truth test's; 5 ms here failed a clean clone at 5.16)
    assert wait.max() < WITNESS_MAX_WAIT_MS, f"the stopwatch was served a CPU when it needed one (most {wait.max():.2f} ms)"
    # never longer than the client's window (the socket wait is counted less a tick)
    assert (diff > -0.5).all(), df.filter(diff <= -0.5).select("rid", "client_ms", "ttft")
    # within two ticks (the kernel stamps the last received data in ticks) and the client's own
    # connect, send and parse (~1 ms: the clean test's) for 9 requests in 10
    close = diff <= 2 * tick_ms + (df["client_ms"] * 0.05).clip(lower_bound=2.0) + wait
    assert close.mean() >= 0.9, sorted(diff.to_list())
    assert diff.median() <= tick_ms + 2.0, diff.describe()
