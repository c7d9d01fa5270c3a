"""Getting spans in: the OTLP/HTTP collector service and (later) the vLLM plugin."""
