"""A floor for bench/ingest's fleet case: the least an HTTP/1.1 server on one event loop can do.

It reads each POST (its head, then Content-Length bytes) and answers ``200`` with an empty body:
no check, no spool, no store. What this costs per request under the fleet's load (the same
senders on the same cores) is what any receiver in Python pays before it does anything with
the spans: the event loop's wake-ups and the socket calls, with the kernel's loopback work
on both sides. Run: ``python bench/http_floor.py PORT``."""

from __future__ import annotations

import asyncio
import socket
import sys

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n"
_HEALTH = b'{"queue_spans": 0}'


class _Sink(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.t, self.buf, self.need = transport, bytearray(), -1
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need < 0:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end]).lower()
                del self.buf[:end + 4]
                if head.startswith(b"get"):
                    self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(_HEALTH), _HEALTH))
                    continue
                at = head.find(b"content-length:")
                self.need = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buf) < self.need:
                return
            del self.buf[:self.need]
            self.need = -1
            self.t.write(_OK)


def main(port: int) -> None:
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # as the collector does without it
        loop = asyncio.new_event_loop()
    loop.run_until_complete(loop.create_server(_Sink, "127.0.0.1", port))
    loop.run_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]))
