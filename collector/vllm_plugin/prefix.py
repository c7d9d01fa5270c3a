"""A prompt's prefix hashes for the prefix-cache analysis: made from its token ids off the engine
loop, handed to the export sidecar as the ids (or the hashes, once computed)."""

from __future__ import annotations

from ttftscope.schemas.vocabulary import PREFIX_BLOCK, PREFIX_MAX_BLOCKS


class PrefixHashes:
    """A prompt's prefix hashes, computed once when the span is encoded (``str()``, on the
    export thread): the chained hashes of its ``PREFIX_BLOCK``-token blocks (``chain``, up to
    ``PREFIX_MAX_BLOCKS``), the first of them standing for the prompt's first block. The step-flush
    thread keeps only a reference to vLLM's token list (which it does not change after the
    request is created; a longer prompt's reachable blocks are copied, so a queued span never
    holds more); when the export queue is backed up (the collector down), :meth:`freeze`
    computes them at once and lets the list go. Token ids hash the same in every process."""

    __slots__ = ("toks", "_hashes")

    def __init__(self, toks) -> None:
        cap = PREFIX_BLOCK * PREFIX_MAX_BLOCKS
        self.toks = toks if len(toks) <= cap else toks[:cap]
        self._hashes: list[str] | None = None

    @property
    def chain(self) -> _ChainOf:
        """All the block hashes, joined when encoded (made off the engine loop, when asked)."""
        return _ChainOf(self)

    def hashes(self) -> list[str]:
        if self._hashes is None:
            t, b, h, out = self.toks, PREFIX_BLOCK, 0, []
            for i in range(0, len(t) // b * b, b):
                h = hash((h, *t[i:i + b]))
                out.append(format(h & 0xFFFFFFFFFFFF, "x"))
            self._hashes, self.toks = out, ()
        return self._hashes

    def __reduce__(self):
        # handed to the export sidecar as a plain list of its whole blocks' ids: pickle writes a
        # list of ints in C (~4 us for 256 ids), less than converting it to an array of C ints
        # first costs (~6.5 us: ~22 ns an id; bench/handoff_frame.py); vLLM's own list type (or
        # a view) stays here
        if self._hashes is not None:
            return _prefix_hashes, ((), self._hashes)
        t = self.toks
        k = len(t) // PREFIX_BLOCK * PREFIX_BLOCK  # whole blocks are hashed
        whole = t if k == len(t) else t[:k]
        return _prefix_hashes, (whole if type(whole) is list else list(whole), None)

    def freeze(self) -> PrefixHashes:
        self.hashes()
        return self

    def __str__(self) -> str:
        return self.hashes()[0]


def _prefix_hashes(toks: list, hashes: list[str] | None) -> PrefixHashes:
    ph = PrefixHashes(toks)
    ph._hashes = hashes
    return ph


class _ChainOf:
    """The ``chain`` attribute's value: its prompt's block hashes, joined when encoded."""

    __slots__ = ("of",)

    def __init__(self, of: PrefixHashes) -> None:
        self.of = of

    def __str__(self) -> str:
        return ",".join(self.of.hashes())
