"""TTFT as the client sees it: an ASGI middleware the plugin adds to vLLM's API server.

The window is request received (its bytes reached the server's socket: uvicorn's protocol read
them, less how long the kernel says they had waited, ``http-arrival``; else the middleware is
entered) -> the first response bytes that carry a generated token handed to the transport
(streaming: the first SSE ``data:`` chunk whose choice has text, a delta with content,
reasoning or tool calls; non-streaming: the response body, marked as such). It becomes the
``ttftscope.http`` span, parent window of everything else, and with it two API-server
phases that vLLM's own window does not see:

* ``receive``: request received -> rendering starts (waiting for a busy event loop to accept
  and read it, body read, JSON parse, validation, middleware, routing), emitted with the
  tokenize span;
* ``deliver``: the engine's first token produced -> those bytes handed to the server's
  transport (taken just before the ASGI ``send``, which writes synchronously; IPC back, output
  processing, detokenize, serialise, event-loop wait). Whichever of the two
  ends learns its time last (the output processor at request finish, the middleware at the
  first bytes) emits it, through a small bounded rendezvous keyed by trace id.

The middleware also gives every request its W3C ``traceparent`` (the client's, else a new
one with the head-sampling decision) by adding the header to the request scope, so vLLM's
own tracing and every adapter see the same trace.
"""

from __future__ import annotations

import contextvars
import functools
import re
import socket
import threading
import time
from collections import OrderedDict

import orjson
from ttftscope.schemas.phases import Phase
from ttftscope.schemas.vocabulary import Attr, ProcessRole, SpanName

from .adapters import FRONTEND, Internal, adapter
from .runtime import (
    RT,
    claim_role,
    hot,
    log,
    new_traceparent,
    sampled,
    set_model,
    span,
    timing_floor,
    turn_off,
)

#: (received at, traceparent) of the HTTP request this task serves
HTTP: contextvars.ContextVar[tuple[float, str] | None] = contextvars.ContextVar("ttftscope_http", default=None)

_GENERATE_SUFFIXES = ("/completions", "/responses", "/generate")


class Rendezvous:
    """first token produced (output processor) x first bytes written (middleware), by trace."""

    def __init__(self, cap: int = 16_384) -> None:
        self.cap = cap
        self.lock = threading.Lock()
        self.produced: OrderedDict[str, tuple[float, float, str, dict]] = OrderedDict()
        self.written: OrderedDict[str, float] = OrderedDict()

    @staticmethod
    def _put(d: OrderedDict, k, v, cap: int) -> None:
        d[k] = v
        while len(d) > cap:
            d.popitem(last=False)

    def on_produced(self, trace_id: str, produced: float, handled: float, request_id: str, headers: dict) -> None:
        with self.lock:
            w = self.written.pop(trace_id, None)
            if w is None:
                self._put(self.produced, trace_id, (produced, handled, request_id, headers), self.cap)
                return
        emit_deliver(produced, handled, w, request_id, headers)

    def on_written(self, trace_id: str, written: float) -> None:
        with self.lock:
            p = self.produced.pop(trace_id, None)
            if p is None:
                self._put(self.written, trace_id, written, self.cap)
                return
        emit_deliver(p[0], p[1], written, p[2], p[3])


RDV = Rendezvous()
ACTIVE = [False]  # the middleware is installed: deliver ends at the bytes written
LIVE = [True]  # the http hook is on (hot: no guard of its own; off, logged once, if it raises)
#: TTFTSCOPE_SELF_TIMING: a hook that does nothing, timed once a request like the API server's
#: hooks (the accounting's own cost in this process, which bench/overhead subtracts)
FLOOR: list = [None]


def emit_deliver(produced: float, handled: float, written: float, request_id: str, headers: dict) -> None:
    end = max(written, handled)
    start = min(produced, end)
    span(SpanName.DELIVER, start, end, (_deliver_attrs, (request_id, handled - start)), headers)


# Span attributes are built on the export thread (``DeferredSpans``' lazy ``(build, args)``):
# the event loop that serves the clients keeps the plain values these take.

def _deliver_attrs(request_id: str, handled_s: float) -> dict:
    return {Attr.REQUEST_ID: request_id, Attr.PHASE: _DELIVER, Attr.DELIVER_HANDLED_NS: int(max(handled_s, 0) * 1e9)}


def _http_attrs(stream: bool, path: str, status: int, rid: str, priority, text_wait_s: float, empty: int) -> dict:
    attrs = {Attr.HTTP_STREAMING: stream, Attr.HTTP_ROUTE: path, Attr.HTTP_STATUS: status, Attr.REQUEST_ID: rid}
    if priority:
        attrs[Attr.PRIORITY] = priority
    if text_wait_s > 0:
        attrs[Attr.HTTP_TEXT_WAIT_NS] = int(text_wait_s * 1e9)
        attrs[Attr.HTTP_TEXT_WAIT_TOKENS] = empty
    return attrs


_DELIVER = Phase.DELIVER.value
#: the receive span's attributes: the same every time, never changed (one dict, not one a request)
RECEIVE_ATTRS = {Attr.PHASE: Phase.RECEIVE.value}


def trace_id_of(traceparent: str) -> str:
    return traceparent[3:35] if len(traceparent) >= 55 else ""


def _has_token(body: bytes) -> tuple[bool, str, bool]:
    """(whether an SSE body chunk carries a generated token, the response id if seen, whether
    it carries a choice at all: vLLM sends one only once the engine produced a token, with
    empty text when the token decodes to nothing yet).

    vLLM's completion and chat chunks (``{"id":"...", ..., "choices":[...]}``) are read by
    searching their bytes (one regular expression), nothing parsed or built but the id: the
    JSON parse of the same chunk, with the dicts it builds, was the plugin's largest item in the
    API server by py-spy's samples (bench/plugin_profile, one round each: 58 µs a request, 20
    after; 1.5 and 1.3 µs a chunk warm). In JSON every quote inside a string is escaped, so
    ``"text":"`` can only be a key and its value's start. Any other shape (the Responses API's
    events) is parsed (:func:`_has_token_parsed`)."""
    rid, choice = "", False
    for line in body.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        c = data.find(b'"choices":[')
        if not data.startswith(b'{"id":"') or c < 0:
            first, r, ch = _has_token_parsed(data)
            rid, choice = rid or r, choice or ch
            if first:
                return True, rid, True
            continue
        rid = rid or data[7:data.find(b'"', 7)].decode(errors="replace")
        if data[c + 11:c + 12] == b"]":  # no choice
            continue
        choice = True
        if _TOKEN.search(data, c):  # (from the choices on: not the fields before them, as ``prompt_text``)
            return True, rid, True
    return False, rid, choice


#: a choice's key whose value is a token when it is not empty: a string, or a list
_TOKEN = re.compile(rb'"(?:text|content|reasoning_content|reasoning|finish_reason)":"[^"]'
                    rb'|"(?:token_ids|tool_calls)":\[[^\]]')


def _has_token_parsed(data: bytes) -> tuple[bool, str, bool]:
    """:func:`_has_token` of one ``data:`` payload, parsed (any shape)."""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False, "", False
    if not isinstance(doc, dict):
        return False, "", False
    rid, choice = str(doc.get("id", "")), False
    for ch in doc.get("choices") or ():
        choice = True
        # a token that decodes to nothing still ends the wait when its choice finishes
        if ch.get("text") or ch.get("token_ids") or ch.get("finish_reason"):
            return True, rid, True
        d = ch.get("delta") or {}
        if d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls"):
            return True, rid, True
    if str(doc.get("type", "")).endswith(".delta") and doc.get("delta"):  # Responses API events
        return True, rid, True
    return False, rid, choice


class ClientTTFTMiddleware:
    """Pure ASGI (no task of its own): runs in the request's task, so the context variable
    it sets is seen by the handlers below it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or \
                not scope.get("path", "").endswith(_GENERATE_SUFFIXES):
            return await self.app(scope, receive, send)
        now = time.time()
        t_recv = scope.get(ARRIVAL_KEY) or now  # the first bytes read by the server, if the hook is on
        t_recv = t_recv if now - 60.0 < t_recv <= now else now
        scope, tp = _with_traceparent(scope)
        token = HTTP.set((t_recv, tp))
        st = {"status": 0, "stream": False, "done": False, "rid": "", "priority": None, "choice_at": 0.0,
              "empty": 0}

        async def receive_wrapper():
            msg = await receive()
            if st["priority"] is None and msg.get("type") == "http.request":
                st["priority"] = _priority_of(msg.get("body", b""))
            return msg

        def send_wrapper(msg):
            # once the first token's bytes are out, every later chunk (a stream's every token)
            # goes straight to the server's send: its own awaitable, no coroutine of ours
            if st["done"]:
                return send(msg)
            return watch(msg)

        async def watch(msg):
            kind = msg.get("type")
            if kind == "http.response.start":
                st["status"] = msg.get("status", 0)
                for k, v in msg.get("headers") or ():
                    if k.lower() == b"content-type":
                        st["stream"] = v.lower().startswith(b"text/event-stream")
                return await send(msg)
            if kind != "http.response.body":
                return await send(msg)
            body = msg.get("body", b"")
            first, choice, more = False, False, msg.get("more_body", False)
            try:
                if st["stream"]:
                    first, rid, choice = _has_token(body)
                    st["rid"] = st["rid"] or rid
                    first = first or not more  # no token ever (empty output): the end of the response
                else:
                    first = not more
                    if first and not st["rid"]:
                        head = body[:256]
                        i = head.find(b'"id":')
                        if i >= 0:
                            st["rid"] = head[i + 5:].split(b'"')[1].decode(errors="replace")
            except Exception:  # noqa: BLE001 - never let tracing hurt a response
                first = not more
            # the server writes to the transport synchronously inside send(); the time after
            # it returns may include other tasks the event loop ran first
            t_write = time.time()
            # (asked before the send: after a response's last bytes the server may close the
            # connection itself, Connection: close)
            tr = scope.get(TRANSPORT_KEY) if first else None
            gone = tr is not None and tr.is_closing()
            r = await send(msg)
            if choice and not first:
                st["choice_at"] = st["choice_at"] or t_write
                st["empty"] += 1
            if first:
                st["done"] = True
                if gone:  # the client left before its first token: it saw none
                    return r
                if LIVE[0]:
                    try:
                        _on_first_bytes(t_recv, t_write, tp, st, scope.get("path", ""))
                    except Exception:  # noqa: BLE001 - never let tracing hurt a response
                        turn_off(LIVE, "http")
                if FLOOR[0] is not None:  # (self-timing only) what timing a hook costs here, to net it out
                    FLOOR[0]()
            return r

        try:
            return await self.app(scope, receive_wrapper, send_wrapper)
        finally:
            HTTP.reset(token)


def _priority_of(body: bytes) -> str:
    """The request's ``priority`` field (vLLM's scheduling priority), read from the first
    body chunk without parsing the JSON; "" when absent."""
    i = body.find(b'"priority"')
    if i < 0:
        return ""
    rest = body[i + 10:i + 40].lstrip()
    if not rest.startswith(b":"):
        return ""
    rest = rest[1:].lstrip()
    n = 1 if rest[:1] == b"-" else 0
    while n < len(rest) and rest[n:n + 1].isdigit():
        n += 1
    try:
        return str(int(rest[:n]))
    except ValueError:
        return ""


#: the scope key where the arrival hook leaves the time the request's first bytes were read
ARRIVAL_KEY = "ttftscope.arrival"
#: ... and the connection's transport: a client that closed it before the first token saw no
#: first token (uvicorn's send then writes nothing, silently), so it has no client TTFT
TRANSPORT_KEY = "ttftscope.transport"


_TCP_INFO = getattr(socket, "TCP_INFO", None)  # Linux
#: one tick of the kernel's clock that stamps a TCP socket's last received data: the socket
#: wait is counted less one tick, so never more than it was (``kernel_tick_s``)
_TICK_S = [0.010]


def kernel_tick_s() -> float:
    """1 / the kernel's ``CONFIG_HZ`` (from /proc/config.gz or /boot/config-<release>; 250 on this
    VM), else 10 ms (HZ=100, the coarsest in use): the resolution of ``tcpi_last_data_recv``."""
    import gzip
    import platform
    import re

    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{platform.release()}", open)):
        try:
            with opener(path, "rt") as f:
                for line in f:
                    m = re.match(r"CONFIG_HZ=(\d+)$", line.strip())
                    if m and int(m.group(1)) > 0:
                        return 1.0 / int(m.group(1))
        except OSError:
            continue
    return 0.010


class _LastDataRecv:
    """``tcpi_last_data_recv`` of a socket's file descriptor, read with libc's ``getsockopt``:
    uvloop's transports hand out a stand-in socket whose ``getsockopt`` makes a Python socket
    for each call (a ``getsockname`` system call, an object made and dropped), which py-spy
    sampled at ~35 us a request on a loaded API server's event loop (bench/plugin_profile); this
    is one system call into a buffer kept for it (under a lock: any thread may call it; libc is
    called through ``PyDLL``, holding the GIL, as ``socket.getsockopt`` does)."""

    def __init__(self) -> None:
        import ctypes

        self._call = ctypes.PyDLL(None, use_errno=True).getsockopt
        self._get_errno = ctypes.get_errno
        self._buf = (ctypes.c_uint8 * 104)()  # struct tcp_info, longer than the 56 bytes read
        self._len = ctypes.c_uint32(0)
        self._len_p = ctypes.byref(self._len)
        self._last = ctypes.c_uint32.from_buffer(self._buf, 52)  # tcpi_last_data_recv, ms
        self._lock = threading.Lock()

    def __call__(self, fd: int) -> int:
        with self._lock:
            self._len.value = 104
            if self._call(fd, socket.IPPROTO_TCP, _TCP_INFO, self._buf, self._len_p):
                raise OSError(self._get_errno(), "getsockopt(TCP_INFO)")  # e.g. a Unix socket
            return self._last.value


def _last_data_recv_reader() -> _LastDataRecv | None:
    try:
        return _LastDataRecv() if _TCP_INFO is not None else None
    except (OSError, AttributeError):  # no libc to load: the socket object's getsockopt
        return None


_LAST_DATA_RECV = _last_data_recv_reader()


def socket_wait_s(transport) -> float:
    """How long the request's bytes had waited at the server before its event loop read them:
    the kernel's ``tcpi_last_data_recv`` (TCP_INFO, ms since the socket last received data; the
    connection waiting to be accepted counts too) less one clock tick, at least 0. In a burst of
    50 requests at once the event loop read them 30 ms (median), at most 163 ms, after they had arrived:
    TTFT the client waited and the report, opening its window at the read, did not see. Raises
    OSError where the socket has no TCP_INFO (a Unix socket)."""
    if _TCP_INFO is None:
        return 0.0
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0.0
    if _LAST_DATA_RECV is not None:
        ms = _LAST_DATA_RECV(sock.fileno())
    else:
        ms = int.from_bytes(sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 56)[52:56], "little")
    return max(ms / 1e3 - _TICK_S[0], 0.0)


@adapter("http-arrival", roles=FRONTEND,
         what="the client-TTFT window starts when the request's bytes reached the server's socket: read by "
              "uvicorn's httptools protocol, less how long they had waited there (the kernel's TCP_INFO), not "
              "when the ASGI task first runs: a request that waits for a busy event loop to accept or read it "
              "is counted",
         internals=[Internal("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.data_received"),
                    Internal("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_message_begin"),
                    Internal("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.scope", "attribute"),
                    Internal("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.transport", "attribute")])
def _install_arrival() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as P

    _TICK_S[0] = kernel_tick_s()
    orig_data, orig_begin = P.data_received, P.on_message_begin

    @functools.wraps(orig_data)
    def data_received(self, data):
        self._ttftscope_rx = time.time()
        return orig_data(self, data)

    @functools.wraps(orig_begin)
    def on_message_begin(self):
        orig_begin(self)
        # called from the parser inside data_received: the stamp is this message's first bytes
        rx = getattr(self, "_ttftscope_rx", None)
        if rx is None:  # the middleware falls back to its own entry time
            return
        try:
            # counted back from the kernel's moment, never from the read's stamp: a thread that
            # takes the GIL in between (its switch interval, 5 ms) is in the kernel's wait, and
            # counted from the stamp it opened the window before the client sent (a CI burst:
            # one report 5.07 ms longer than the client's stopwatch)
            wait = socket_wait_s(self.transport)
            rx = min(rx, time.time() - wait)
        except Exception:  # noqa: BLE001 - not TCP (a Unix socket: --uds): the read's time
            pass
        self.scope[ARRIVAL_KEY] = rx  # (scope: a dict the original has just set up)
        self.scope[TRANSPORT_KEY] = self.transport  # whether the client is still there at the first token

    P.data_received, P.on_message_begin = data_received, on_message_begin


def _with_traceparent(scope) -> tuple[dict, str]:
    headers = scope.get("headers") or []
    for k, v in headers:
        if k == b"traceparent":
            return scope, v.decode("latin-1")
    tp = new_traceparent()
    return {**scope, "headers": [*headers, (b"traceparent", tp.encode())]}, tp


@hot("http")
def _on_first_bytes(t_recv: float, t_written: float, tp: str, st: dict, path: str) -> None:
    """A request's first token bytes were written (once a request; hot: its caller catches)."""
    if not sampled({"traceparent": tp}) or st["status"] != 200:
        return
    choice_at = st["choice_at"]
    span(SpanName.HTTP, t_recv, t_written,
         (_http_attrs, (st["stream"], path, st["status"], st["rid"], st["priority"],
                        t_written - choice_at if choice_at else 0.0, st["empty"])), {"traceparent": tp})
    RDV.on_written(trace_id_of(tp), t_written)


@adapter("http-ttft", roles=FRONTEND,
         what="TTFT as the client sees it (ASGI middleware: request received -> first token bytes written), "
              "the receive and deliver phases, one traceparent per request",
         internals=[Internal("vllm.entrypoints.launchers.app", "build_app"),
                    Internal("vllm.entrypoints.launchers.app", "init_entrypoints_middleware")])
def _install_http() -> None:
    from vllm.entrypoints.launchers import app as launcher

    orig = launcher.init_entrypoints_middleware

    @functools.wraps(orig)
    def init_middleware(args, app, *a, **kw):
        r = orig(args, app, *a, **kw)
        claim_role(ProcessRole.API_SERVER.value)
        set_model(getattr(args, "served_model_name", None) or getattr(args, "model", None))
        try:
            app.add_middleware(ClientTTFTMiddleware)  # added last = outermost: sees the most
        except Exception:  # noqa: BLE001
            ACTIVE[0] = False
            log.exception("ttftscope: could not add the client-TTFT middleware")
        return r

    launcher.init_entrypoints_middleware = init_middleware
    ACTIVE[0] = True
    FLOOR[0] = timing_floor if RT.config.self_timing_dir else None


def emit_receive(render_start: float, trace_headers) -> None:
    """``receive``: request received -> rendering starts (called with the tokenize span)."""
    h = HTTP.get()
    if h is None or not sampled(trace_headers):
        return
    if h[0] < render_start:
        span(SpanName.RECEIVE, h[0], render_start, RECEIVE_ATTRS, trace_headers)
