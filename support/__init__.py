"""Helpers the tests and the benchmarks share (not shipped with ttftscope): real processes
(``procs``), OTLP requests and senders (``otlp``), a headless browser (``browser``), and the
truth harness on real vLLM (``truth``)."""
