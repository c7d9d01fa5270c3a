"""Advise: what to change, tied to the findings that motivate it, with the expected effect."""

from __future__ import annotations

_ADVICE = {
    "queue_dominates": ("Raise engine capacity for admission: increase `max_num_seqs` / `max_num_batched_tokens` "
                        "if memory allows, else add replicas (scale out).",
                        "p99 TTFT falls by up to the queue share"),
    "chunk_wait": ("Long prompts' chunks starve: tune chunked prefill (`--max-num-batched-tokens` larger so a long "
                   "prompt needs fewer steps), or cap concurrent long prefills / use priority scheduling.",
                   "removes most between-chunk waits for long prompts"),
    "kv_preemption": ("The KV cache ran out: a running request needed blocks and vLLM preempted the newest running "
                      "request, which waited for blocks and computed its prompt again. Give the KV cache more memory "
                      "(`--gpu-memory-utilization`, `--kv-cache-memory-bytes`; no `--num-gpu-blocks-override` below "
                      "what fits), run fewer requests at once (`--max-num-seqs`), cap long outputs (`max_tokens`), "
                      "or add replicas / tensor parallelism for more KV memory.",
                      "no preemptions: the preempted requests' wait for blocks and their redone prefill gone"),
    "chunk_budget": ("Long prompts are prefilled over many steps of at most `--max-num-batched-tokens` tokens: "
                     "raise it toward the common prompt length (long prefills then stretch other requests' "
                     "inter-token latency), or let only very "
                     "long prompts be split (`--long-prefill-token-threshold`, `--max-num-partial-prefills`).",
                     "prefill in one step: TTFT shorter by the extra steps and the waits between them"),
    "tokenizer_long_prompts": ("Tokenization of long prompts is super-linear: run more API-server processes "
                               "(`--api-server-count`), pre-tokenize, or use the fast tokenizer path.",
                               "long-prompt tokenization back to the short-prompt per-token cost"),
    "allreduce_concurrency": ("Collectives grow with batch size: enable custom all-reduce / check the interconnect, "
                              "or lower tensor parallelism (more replicas at TP=1 or 2).",
                              "flat allreduce time per step as concurrency rises"),
    "cold_start_gap": ("Idle time inside cold start: overlap weight loading with warmup/compilation, cache "
                       "compiled graphs, or warm up before marking the server ready.",
                       "cold start shortened by the idle share"),
    "cold_start_slow": ("Cold start over target: use a faster load format (safetensors on local NVMe, "
                        "`--load-format` sharded/runai streamer), cache torch.compile artifacts.",
                        "cold start within target"),
    "scheduling_bubbles": ("The engine idled while requests waited: check async scheduling and the "
                           "API-server -> engine IPC path; consider more API-server processes.",
                           "idle time between steps recovered"),
    "engine_host_overhead": ("The engine core's Python (scheduling, output processing) takes a large share of every "
                             "step while the model waits: turn on `--async-scheduling` (overlaps scheduling with "
                             "execution), lighten per-step work (logits processors, structured output, "
                             "`--disable-log-stats` off the hot path), batch more per step (`--max-num-seqs`); on a "
                             "GPU keep CUDA graphs on (no `--enforce-eager`).",
                             "engine time per request shorter by the host share"),
    "host_gap": ("Time lost between tokenization and the engine: the frontend is saturated; add API-server "
                 "processes or move rendering off the event loop.", "host gap removed from TTFT"),
    "scale_out": ("TTFT tracks offered load: add replicas or autoscale on queue length / TTFT p90.",
                  "TTFT flat under load"),
    "regression": ("A phase regressed between versions: bisect the version change or roll back.",
                   "phase back to the previous version's median"),
    "tokenize_dominates": ("Tokenization (chat template + tokenizer, in the API server's tokenizer thread pool) "
                           "dominates: use the fast (Rust) tokenizer (`--tokenizer-mode auto`, not `slow`), give "
                           "rendering more threads (`--renderer-num-workers`) or API-server processes "
                           "(`--api-server-count`), or send token ids instead of text from a client that already "
                           "has them.", "tokenize back to its healthy baseline"),
    "deliver_dominates": ("Delivery after the first token dominates: the API server's event loop is busy "
                          "(detokenization, serialisation, heavy middleware, many streams per process). Add API-server "
                          "processes (`--api-server-count`), move heavy middleware off the event loop.",
                          "deliver back to a few ms"),
    "receive_dominates": ("Receiving and parsing requests dominates: requests wait in the socket for a busy "
                          "API-server event loop to accept and read them (bursts, many streams per process), or "
                          "large bodies or slow middleware/auth before rendering; add API-server processes "
                          "(`--api-server-count`), trim middleware.",
                          "receive back to under a ms"),
    "intake_dominates": ("Requests wait for the engine loop: the engine core only takes new requests between "
                         "steps, and its steps are long. Shorter steps (a smaller `--max-num-batched-tokens`), "
                         "fewer concurrent long prompts per replica, or more replicas.",
                         "intake back to the IPC cost (well under a ms)"),
    "allreduce_dominates": ("Tensor-parallel collectives take a large share of prefill: check the interconnect "
                            "(NVLink/P2P enabled, `NCCL_P2P_DISABLE` unset, GPUs of one TP group on one NVLink "
                            "domain), keep vLLM's custom all-reduce on (no `--disable-custom-all-reduce`), keep CUDA "
                            "graphs on (no `--enforce-eager`), or use a smaller `--tensor-parallel-size` with more "
                            "replicas (`--data-parallel-size`).",
                            "allreduce back to the interconnect's healthy cost"),
    "load_dominates": ("Requests hit model loading: warm up before taking traffic.", "no cold requests"),
    "prefix_cache_misses": ("Shared prompt prefixes are recomputed: enable prefix caching (`--enable-prefix-caching`), "
                            "and keep the shared part (system prompt) byte-identical at the start of the prompt.",
                            "prefill of repeats shrinks by the shared prefix"),
    "cold_requests": ("The first requests after start pay one-off initialisation (kernels, graphs, caches): send "
                      "warmup requests before marking the server ready / adding it to the load balancer.",
                      "first-request TTFT like the steady state"),
}


#: queue_dominates when every seat was held while requests waited
_SEATS = ("Requests queue because every seat is taken (running requests, typically long decodes, hold all "
          "`--max-num-seqs` seats): raise `--max-num-seqs` if KV-cache memory allows (vLLM logs the "
          "maximum concurrency at start-up), cap `max_tokens` of long generations, give latency-sensitive "
          "requests a priority (`--scheduling-policy priority`), or add replicas.",
          "the queue wait until a seat frees up removed from TTFT")


#: queue_dominates when seats were free and no prompt was computed while requests waited
_KV_FULL = ("Requests queue with seats free: the KV cache has no free blocks for the next prompt (vLLM admits a "
            "request only when its prompt's blocks fit), so raising `--max-num-seqs` would not help. Give the KV "
            "cache more memory (`--gpu-memory-utilization`, `--kv-cache-memory-bytes`, an FP8 KV cache with "
            "`--kv-cache-dtype fp8`, tensor parallelism), keep prefix caching on, cap long outputs (`max_tokens`), "
            "or add replicas. (vLLM holds requests back with seats free for a few other reasons, which the steps "
            "alone do not tell apart: chunked prefill turned off, an engine paused, data-parallel prefill "
            "balancing, requests waiting for a structured-output grammar, a LoRA slot or remote KV.)",
            "the queue wait for KV-cache blocks removed from TTFT")


#: queue_dominates when seats were free and the steps' token budget was taken by prompt work
_BUDGET = ("Requests queue with seats free: every step's token budget (`--max-num-batched-tokens`) went to "
           "the prompts admitted before them, so raising `--max-num-seqs` would not help. The engine was "
           "computing prompts as fast as its budget lets: a larger `--max-num-batched-tokens` admits more "
           "prompt per step, which shortens the queue where a step's time grows less than its tokens (a GPU "
           "below saturation; longer steps stretch the running requests' inter-token latency), and does little "
           "where the device is already saturated; there, fewer prompt tokens (prefix caching, shorter "
           "prompts) or more replicas shorten it.",
           "the queue wait for the token budget removed from TTFT")


#: intake_dominates when most of it is IPC, before the engine core's input thread has the request
_IPC = ("Most of the intake is the hop from the API server to the engine core's input thread (ZMQ and "
        "msgpack): very large requests (long prompts sent as text, many images), or an engine core process "
        "starved of CPU (its input thread competes with the busy engine loop and workers for cores). Send token "
        "ids instead of long texts, keep a core free for the engine core, or add API-server processes "
        "(`--api-server-count`) if one process serialises for many.",
        "intake back to the IPC cost of a small request (well under a ms)")


def advise(findings: list[dict], stats: dict, slo_result: dict) -> list[dict]:
    out, seen = [], set()
    for f in findings:
        if f["severity"] == "low" or f["kind"] in seen or f["kind"] not in _ADVICE:
            continue
        seen.add(f["kind"])
        what, effect = _ADVICE[f["kind"]]
        if f["evidence"].get("all_seats_held"):  # a queue behind running requests (bottlenecks.seats)
            what, effect = _SEATS
        elif f["evidence"].get("kv_cache_full"):  # a queue behind a full KV cache, seats free
            what, effect = _KV_FULL
        elif f["evidence"].get("token_budget_full"):  # a queue behind the steps' prompt work, seats free
            what, effect = _BUDGET
        if f["evidence"].get("ipc_share", 0.0) > 0.5:  # intake mostly before the engine core had it
            what, effect = _IPC
        out.append({"because": f["title"], "finding": f["kind"], "severity": f["severity"], "change": what,
                    "expected_effect": effect, "expected_effect_ms": f.get("impact_ms"), "evidence": {k: v for k, v in f["evidence"].items()
                                                            if k in ("request_ids", "trace_ids")}})
    # prefill/decode disaggregation: TTFT breaks its SLO while inter-token latency holds
    tpot = stats.get("tpot_ms_p99")
    if slo_result.get("violated") and tpot is not None and tpot < 50 and "queue_dominates" not in seen:
        out.append({"because": f"TTFT SLO broken ({'; '.join(slo_result['violated'][:2])}) while TPOT p99 is {tpot:.0f} ms",
                    "finding": "slo", "severity": "medium",
                    "change": "Consider prefill/decode disaggregation, sizing the prefill pool by the prefill share of load.",
                    "expected_effect": "TTFT no longer competes with decode steps", "evidence": {}})
    return out
