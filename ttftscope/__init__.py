"""ttftscope: where the time before the first token goes, for LLM serving on vLLM."""

__version__ = "0.1.0"
