"""bench/asgi_middleware: what the client-TTFT middleware costs vLLM's API server per request,
the part the plugin's self-timing does not see.

The ``http-ttft`` adapter adds an ASGI middleware (``collector/vllm_plugin/http.py``,
``ClientTTFTMiddleware``) that runs for every generate request: it gives the request a
traceparent, wraps ``receive`` (the priority field) and ``send`` (until the first token's
bytes: each SSE chunk read for a token, then a pass-through per chunk), and at the first
token's bytes emits ``ttftscope.http`` (the ``http`` hook, the only part the self-timing
accounts). Timed here: the same streamed response (a completions SSE stream of --tokens
chunks, shaped like vLLM's) through a bare ASGI app and through the middleware around it, in
one event loop, CPU per request, the least of interleaved --rounds; the difference is the
middleware's whole cost, hook included. Warm caches: a serving API server pays several times
these (README, bench/overhead).

Usage: python bench/asgi_middleware.py [--requests 2000] [--rounds 5] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()

    import orjson
    from ttftscope.collector.otel_setup import DeferredSpans
    from ttftscope.collector.vllm_plugin import http as H
    from ttftscope.collector.vllm_plugin.runtime import RT

    RT.deferred = DeferredSpans(None, None, max_queue=10**9, max_batch=10**9)  # spans queued, never exported
    H.ACTIVE[0] = True

    def chunk(i: int, text: str, finish=None) -> bytes:
        doc = {"id": "cmpl-bench", "object": "text_completion", "created": 1_700_000_000, "model": "m",
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                            "stop_reason": None}]}
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    body = [chunk(i, f" t{i}") for i in range(a.tokens - 1)] + [chunk(a.tokens, " end", "length"),
                                                                  b"data: [DONE]\n\n"]
    request = orjson.dumps({"model": "m", "prompt": "hello " * 50, "max_tokens": a.tokens, "stream": True})

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for i, b in enumerate(body):
            await send({"type": "http.response.body", "body": b, "more_body": i < len(body) - 1})

    wrapped = H.ClientTTFTMiddleware(app)

    async def receive():
        return {"type": "http.request", "body": request, "more_body": False}

    async def send(msg):
        return None

    def scope() -> dict:
        return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"host", b"x")],
                H.ARRIVAL_KEY: time.time()}

    async def load(target, n: int) -> float:
        c = time.process_time()
        for _ in range(n):
            await target(scope(), receive, send)
        return time.process_time() - c

    loop = asyncio.new_event_loop()
    best = {"bare": 1e9, "middleware": 1e9}
    for _ in range(a.rounds):
        for name, target in (("bare", app), ("middleware", wrapped)):
            RT.deferred.take(len(RT.deferred))  # (what the export thread would take)
            best[name] = min(best[name], loop.run_until_complete(load(target, a.requests)))
    per = {k: v / a.requests * 1e6 for k, v in best.items()}
    print(f"{a.tokens} streamed chunks a request, least of {a.rounds} interleaved rounds of {a.requests} requests:")
    print(f"  bare ASGI app           {per['bare']:7.1f} us of CPU a request")
    print(f"  with the middleware     {per['middleware']:7.1f} us")
    print(f"  the middleware's cost   {per['middleware'] - per['bare']:7.1f} us a request (warm; the http hook included)")


if __name__ == "__main__":
    main()
