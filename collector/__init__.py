"""Getting spans in: the OTLP/HTTP collector service (``server``, ``otlp``, ``spool``,
``pipeline``, ``service``, metrics) and the vLLM plugin (``vllm_plugin``, ``otel_setup``)."""
