"""Token masks: the packed form matchers and channels use, unpacked for code that wants a list."""
from __future__ import annotations

import itertools
import struct

__all__ = ["unpack_mask", "Mask"]

# byte value -> its 8 bits as bools, lowest bit first: unpacking is then table lookups run in C
# (a per-bit Python loop costs milliseconds per token in the sandbox)
_BYTE_BITS = [tuple(bool(b >> i & 1) for i in range(8)) for b in range(256)]


class Mask(list):
    """A list of bools (one per token id) that remembers its packed words: a channel sends the
    words (1 int per 32 tokens) and the engine unpacks them, instead of one JSON bool per token."""

    __slots__ = ("words",)


def unpack_mask(packed, vocab: int) -> Mask:
    """One bool per token id from packed int32 words (bit i % 32 of word i // 32 = token i),
    `vocab` long."""
    vocab, n = int(vocab), len(packed)
    if n * 32 < vocab:
        raise ValueError(f"{n} mask words hold {n * 32} tokens, fewer than vocab {vocab}")
    words = [int(w) & 0xFFFFFFFF for w in packed]
    data = struct.pack(f"<{n}I", *words)   # little-endian: token order
    mask = Mask(itertools.chain.from_iterable(map(_BYTE_BITS.__getitem__, data)))
    del mask[vocab:]
    mask.words = [w - (1 << 32) if w >> 31 else w for w in words[:(vocab + 31) // 32]]   # as int32
    return mask
