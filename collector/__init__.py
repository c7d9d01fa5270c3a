"""Getting spans in: the OTLP/HTTP collector service (``server``, ``otlp``, ``spool``,
``pipeline``, ``service``, ``metrics``, ``phase_metrics``) and the vLLM plugin
(``vllm_plugin``; its export path: ``otel_setup``, ``span_wire``)."""
