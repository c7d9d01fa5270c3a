"""bench/socket_wait: what reading a request's socket wait costs the API server's event loop.

The ``http-arrival`` adapter reads the kernel's ``tcpi_last_data_recv`` (TCP_INFO) once a
request, on the event loop that serves the clients (``collector/vllm_plugin/http.socket_wait_s``).
On uvloop (vLLM's API server) the transport's socket is a stand-in whose ``getsockopt`` makes a
Python socket for every call: a ``getsockname`` system call and an object made and dropped. The
plugin reads the field with libc's ``getsockopt`` on the file descriptor instead: one system call.
Timed here on a real loopback connection inside a uvloop protocol, thread CPU per call, the least
of interleaved --rounds (warm caches: a loaded server pays several times these; bench/plugin_profile
samples the real one).

Usage: python bench/socket_wait.py [--calls 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()

    import uvloop
    from ttftscope.collector.vllm_plugin import http as H

    libc = H._LAST_DATA_RECV
    if libc is None:
        raise SystemExit("no libc getsockopt here (or no TCP_INFO): nothing to compare")
    best: dict[str, float] = {}

    def run(transport) -> None:
        for _ in range(a.rounds):
            for name, reader in (("socket object", None), ("libc", libc)):
                H._LAST_DATA_RECV = reader
                c0 = time.thread_time()
                for _ in range(a.calls):
                    H.socket_wait_s(transport)
                us = (time.thread_time() - c0) / a.calls * 1e6
                best[name] = min(best.get(name, us), us)
        H._LAST_DATA_RECV = libc

    class Proto(asyncio.Protocol):
        def connection_made(self, t):
            self.t = t

        def data_received(self, data):
            run(self.t)
            self.t.write(b"k")

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(Proto, "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
        w.write(b"POST / HTTP/1.1\r\n\r\n")
        await r.read(1)
        w.close()
        srv.close()

    uvloop.run(serve())
    base = best["socket object"]
    print(f"socket_wait_s on a uvloop transport, CPU per call (least of {a.rounds} interleaved rounds of {a.calls}):")
    for name, us in best.items():
        print(f"  {name:<14} {us:6.2f} us   ({us / base:.2f} x the socket object's getsockopt)")


if __name__ == "__main__":
    main()
