"""``handover``: before vLLM signals its engine cores at a shutdown, every plugin process under
them hands over the spans it holds; vLLM's shutdown goes on once they have (at most
``HANDOVER_WAIT_S`` later).

With ``--shutdown-timeout 0`` (vLLM's default: requests are aborted at once) vLLM's process
manager sends each engine core SIGTERM and then, with no window, SIGKILLs its whole process
tree. A Ctrl-C signals every process of the group first, and the engine core's handler puts
SIGTERM back to its default as it leaves its busy loop, so the manager's SIGTERM ends it there.
Either way the engine core and its workers never reached their exit hooks: the engine core's
steps of the last second (folded once a second) and the spans waiting for its next export
(every 2 s) were lost. A server stopped within a few seconds of its last request came back with
none of those requests' queue, prefill or step spans, while the API server's all arrived
(tests/test_vllm_plugin.py: 0 engine-core spans for 7 requests).

Each engine core and worker listens on an abstract Unix datagram socket named by its pid (a
thread blocked on it: nothing of it runs per request or step; requests from another user are
ignored). The process that manages the engine cores (the API server, or the launcher of several)
wraps vLLM's ``CoreEngineProcManager.shutdown``: before vLLM's own code runs, it asks every live
process of those trees to hand over and waits for their answers. Each answers once it has
recorded what it held (its exit hooks: the open run of steps) and written its spans to its
export sidecar, which outlives the tree (``collector.handoff.detach``) and posts them. vLLM's
timeouts and its abort of requests are not touched; its shutdown starts later by the
hand-over's time (a few ms a process; at most ``HANDOVER_WAIT_S`` when a process does not answer).

``handover-api-servers`` does the same for the API servers a launcher starts (``vllm serve
--api-server-count N``, and ``--data-parallel-size N``, which starts as many): the launcher
stops them first, through ``APIServerProcessManager.shutdown``, and force-kills them at once as well.
Before it, none of their spans of the last two seconds arrived: a stopped server's short run
lost every ``llm_request``, ``http`` and ``deliver`` span.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import struct
import threading
import time

from ttftscope.schemas.vocabulary import ProcessRole

from .adapters import ENGINE, FRONTEND, WORKER, Internal, adapter
from .runtime import RT, log, run_exit_hooks, stopped_by_a_manager

#: how long the managing process waits for the answers, all together (seconds)
HANDOVER_WAIT_S = 2.0
_ASK, _DONE, _LATE = b"hand over", b"done", b"late"
_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_LISTENING: list[socket.socket] = []  # this process's socket (a forked child closes the parent's)


def sender_uid(ancillary) -> int | None:
    """The user id the kernel vouches for in a datagram's credentials (``SCM_CREDENTIALS``): an
    abstract socket has no file permissions, so a request from another user is ignored."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CRED.size:
            return _CRED.unpack_from(data)[1]
    return None


def address(pid: int) -> bytes:
    """The abstract socket a plugin process with ``pid`` listens on."""
    return b"\0ttftscope-handover-%d" % pid


def hand_over(wait_s: float = HANDOVER_WAIT_S) -> bool:
    """This process's spans handed to its export now: what its exit hooks record, then a flush
    (to its export sidecar's pipe, or posted where there is none); False if that did not end
    within ``wait_s``."""
    run_exit_hooks()
    p = RT.processor
    return p.force_flush(int(wait_s * 1000)) if p is not None else True


def listen() -> bool:
    """Answer hand-over requests (engine core, worker, a launcher's API server): a daemon thread
    blocked on the socket."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # each request says who sent it
        sock.bind(address(os.getpid()))
    except OSError as e:
        log.warning("ttftscope: this process cannot be asked to hand its spans over at a shutdown (%s): its last "
                    "spans are lost if vLLM force-kills it", e)
        return False
    if not _LISTENING:
        os.register_at_fork(after_in_child=_forget)
    _LISTENING[:] = [sock]
    threading.Thread(target=_serve, args=(sock,), name="ttftscope-handover", daemon=True).start()
    return True


def _forget() -> None:
    for s in _LISTENING:
        try:
            s.close()
        except OSError:
            pass
    _LISTENING.clear()


def _serve(sock: socket.socket) -> None:
    from ..otel_setup import name_native_thread

    name_native_thread("ttftscope-handover")
    uid = os.getuid()
    while True:
        try:
            data, anc, _flags, peer = sock.recvmsg(64, socket.CMSG_SPACE(_CRED.size))
        except OSError:  # closed
            return
        if data != _ASK or not peer or sender_uid(anc) != uid:
            continue
        try:
            ok = hand_over()
        except Exception:  # noqa: BLE001 - never let tracing hurt the server: the asker goes on either way
            log.exception("ttftscope: handing the spans over at shutdown failed")
            ok = False
        try:
            sock.sendto(_DONE if ok else _LATE, peer)
        except OSError:
            pass


def ask(pids, wait_s: float = HANDOVER_WAIT_S) -> tuple[int, int]:
    """Ask every process of ``pids`` that listens to hand over: (asked, answered), once all have
    answered or ``wait_s`` passed. A pid with no listener (no plugin there, gone) is skipped."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(b"\0ttftscope-handover-ask-%d-%s" % (os.getpid(), secrets.token_hex(4).encode()))
        asked = answered = 0
        for pid in pids:
            try:
                sock.sendto(_ASK, address(pid))
                asked += 1
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while answered < asked:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                sock.recv(16)
            except OSError:  # (a timeout is one)
                break
            answered += 1
        return asked, answered
    finally:
        sock.close()


def _trees(procs) -> list[int]:
    """The live processes ``procs`` (a vLLM process manager's) and their descendants. Of each it
    reads ``pid`` and ``is_alive()``: multiprocessing's process API, which vLLM's
    ``_SubprocessWrapper`` mirrors (an object without them: the wrapper logs one error and vLLM's
    shutdown goes on unchanged)."""
    import psutil

    out = []
    for p in procs:
        pid = getattr(p, "pid", None)
        if not pid or not p.is_alive():
            continue
        try:
            root = psutil.Process(pid)
            out += [pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.Error:
            continue
    return out


def _wrap_shutdown(manager: type, what: str) -> None:
    """``manager.shutdown`` (one of vLLM's process managers) asks the trees of its processes to
    hand over first, once per manager (vLLM calls it again when it cleans up), then runs vLLM's
    own exactly once, whatever happened before it."""
    orig = manager.shutdown

    @functools.wraps(orig)
    def shutdown(self, *a, **kw):
        if not getattr(self, "_ttftscope_handed_over", False):
            try:
                self._ttftscope_handed_over = True
                t0 = time.monotonic()
                asked, answered = ask(_trees(getattr(self, "processes", ())))
                if asked:
                    log.info("ttftscope: %d of %d %s handed their spans over in %.0f ms", answered, asked, what,
                             (time.monotonic() - t0) * 1e3)
            except Exception:  # noqa: BLE001 - never let tracing hurt the server: vLLM's shutdown goes on
                log.exception("ttftscope: asking the %s to hand their spans over failed", what)
        return orig(self, *a, **kw)

    manager.shutdown = shutdown


@adapter("handover", roles=FRONTEND | ENGINE | WORKER,
         what="at a shutdown, the engine cores and workers hand their spans over before vLLM signals them "
              "(it force-kills their trees at once when requests are aborted)",
         internals=[Internal("vllm.v1.engine.utils", "CoreEngineProcManager.shutdown"),
                    Internal("vllm.v1.engine.utils", "CoreEngineProcManager.processes", "attribute")])
def _install_handover() -> None:
    if RT.role in (ProcessRole.ENGINE_CORE.value, ProcessRole.WORKER.value):
        listen()
        return
    from vllm.v1.engine import utils

    _wrap_shutdown(utils.CoreEngineProcManager, "engine processes")


@adapter("handover-api-servers", roles=FRONTEND,
         what="at a shutdown, the API servers a launcher started (--api-server-count) hand their spans over before "
              "it signals them (it force-kills them at once when requests are aborted)",
         internals=[Internal("vllm.v1.utils", "APIServerProcessManager.shutdown"),
                    Internal("vllm.v1.utils", "APIServerProcessManager.processes", "attribute")])
def _install_handover_api_servers() -> None:
    if stopped_by_a_manager(RT.role):  # one of a launcher's API servers
        listen()
        return
    from vllm.v1 import utils

    _wrap_shutdown(utils.APIServerProcessManager, "API servers")
