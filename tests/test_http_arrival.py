"""The socket wait that opens the client-TTFT window earlier (collector/vllm_plugin/http.py), on a
real loopback TCP connection: the kernel's stamp against the time the test let the bytes wait."""

from __future__ import annotations

import socket
import time

import pytest
from ttftscope.collector.vllm_plugin import http


class _Transport:
    def __init__(self, sock) -> None:
        self.sock = sock

    def get_extra_info(self, key):
        return self.sock if key == "socket" else None


@pytest.fixture
def pair():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    c = socket.create_connection(srv.getsockname())
    a, _ = srv.accept()
    yield c, a
    for s in (c, a, srv):
        s.close()


@pytest.mark.parametrize("reader", ["libc", "socket object"])
def test_bytes_that_waited_are_counted_less_a_tick_never_more(pair, monkeypatch, reader):
    # the libc reader (one system call) and the socket object's getsockopt read the same field
    assert http._LAST_DATA_RECV is not None, "Linux: libc's getsockopt is loadable"
    if reader == "socket object":
        monkeypatch.setattr(http, "_LAST_DATA_RECV", None)
    monkeypatch.setattr(http, "_TICK_S", [http.kernel_tick_s()])
    tick = http._TICK_S[0]
    c, a = pair
    c.sendall(b"POST / HTTP/1.1\r\n\r\n")
    t0 = time.monotonic()
    time.sleep(0.08)
    got = http.socket_wait_s(_Transport(a))
    waited = time.monotonic() - t0
    assert waited - 2 * tick - 0.002 <= got <= waited, (got, waited, tick)


def test_bytes_read_at_once_count_no_more_than_they_waited(pair, monkeypatch):
    monkeypatch.setattr(http, "_TICK_S", [http.kernel_tick_s()])
    c, a = pair
    t0 = time.monotonic()
    c.sendall(b"x")
    a.recv(1)
    got = http.socket_wait_s(_Transport(a))
    assert got <= time.monotonic() - t0  # (0 unless this process was held off a CPU for ticks)


def test_a_transport_without_a_socket_counts_nothing():
    assert http.socket_wait_s(_Transport(None)) == 0.0


def test_the_kernel_tick_is_a_plausible_hz():
    assert 1 / 1000 <= http.kernel_tick_s() <= 1 / 100


def test_a_unix_socket_raises_so_the_read_time_is_kept():
    # (--uds: no TCP_INFO) the arrival hook keeps the read's time when socket_wait_s raises
    a, b = socket.socketpair()
    try:
        with pytest.raises(OSError):
            http.socket_wait_s(_Transport(a))
    finally:
        a.close()
        b.close()


def test_through_uvloops_transport_the_wait_of_a_busy_loop_is_counted(monkeypatch):
    # the API server's own path: uvicorn on uvloop, whose transport hands out a stand-in socket;
    # the loop is kept busy while the client's bytes wait at the socket, then reads them
    uvloop = pytest.importorskip("uvloop")
    import asyncio

    monkeypatch.setattr(http, "_TICK_S", [http.kernel_tick_s()])
    tick, got = http._TICK_S[0], {}

    class Proto(asyncio.Protocol):
        def connection_made(self, t):
            self.t = t

        def data_received(self, data):
            got["wait"] = http.socket_wait_s(self.t)
            got["read"] = time.monotonic()
            self.t.write(b"k")

    async def main():
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(Proto, "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
        await asyncio.sleep(0.05)  # accepted
        w.write(b"POST / HTTP/1.1\r\n\r\n")
        await w.drain()  # (the client's write is done here: the bytes are at the server's socket)
        sent = time.monotonic()
        time.sleep(0.08)  # the loop is busy: nothing is read
        await r.read(1)
        w.close()
        srv.close()
        return sent

    sent = uvloop.run(main())
    waited = got["read"] - sent
    assert waited - 2 * tick - 0.002 <= got["wait"] <= waited + 0.002, (got, waited, tick)


def test_a_thread_switch_inside_the_parse_does_not_open_the_window_before_the_bytes_arrived(pair, monkeypatch):
    # uvicorn's own protocol with the http-arrival hook installed, on a real loopback connection.
    # Seen in a CI run: one burst request of 150 with the report's TTFT 5.07 ms longer than the
    # client's stopwatch (one GIL switch interval). The hook stamped the read in data_received and
    # asked the kernel later, in on_message_begin: when another thread takes the GIL between the
    # two (here: the parse is held 30 ms), the kernel's wait includes that hold and the window
    # opened that much before the bytes were sent.
    import asyncio

    from uvicorn.config import Config
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as P
    from uvicorn.server import ServerState

    for name in ("data_received", "on_message_begin"):
        monkeypatch.setattr(P, name, getattr(P, name))  # restored after the test
    real_begin = P.on_message_begin

    def held_begin(self):  # another thread holds the GIL inside the parse
        time.sleep(0.03)
        real_begin(self)

    monkeypatch.setattr(P, "on_message_begin", held_begin)
    http._install_arrival()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    class Transport(_Transport):
        def get_extra_info(self, key, default=None):
            return {"socket": self.sock, "sockname": self.sock.getsockname(),
                    "peername": self.sock.getpeername()}.get(key, default)

        def write(self, data):
            pass

        def is_closing(self):
            return False

    c, a = pair
    got = {}

    async def main():
        cfg = Config(app=app, log_level="warning")
        cfg.load()
        proto = P(config=cfg, server_state=ServerState(), app_state={})
        proto.connection_made(Transport(a))
        got["before_send"] = time.time()
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.05)  # the bytes wait at the socket: the event loop is busy
        proto.data_received(a.recv(4096))
        got["arrival"] = proto.scope[http.ARRIVAL_KEY]
        got["read"] = time.time()

    asyncio.run(main())
    # never before the bytes were sent (the client's window would be shorter than the report's) ...
    assert got["arrival"] >= got["before_send"], got["before_send"] - got["arrival"]
    # ... and the bytes' wait is still counted: well before the read (50 ms waited, less a tick)
    assert got["arrival"] <= got["before_send"] + 2 * http._TICK_S[0] + 0.005, got["arrival"] - got["before_send"]


def test_a_port_picked_for_later_is_one_no_bind_of_port_0_can_be_handed():
    # (ttftscope.servers.free_port: the collector's port in a test that starts it after vLLM,
    # the vLLM server's own) below the kernel's ephemeral range, and free: binds of port 0 meanwhile
    # (vLLM's listeners, torch's, ZMQ's) never get it
    from ttftscope.servers import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (ports, low)
    held = []
    try:
        for p in ports:  # free: each can be bound
            s = socket.socket()
            s.bind(("127.0.0.1", p))
            held.append(s)
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            held.append(s)
            assert s.getsockname()[1] >= low
    finally:
        for s in held:
            s.close()
