"""Token masks: the packed form matchers and channels use, unpacked for code that wants a list."""
from __future__ import annotations

import itertools
import struct

__all__ = ["unpack_mask"]

# byte value -> its 8 bits as bools, lowest bit first: unpacking is then table lookups run in C
# (a per-bit Python loop costs milliseconds per token in the sandbox)
_BYTE_BITS = [tuple(bool(b >> i & 1) for i in range(8)) for b in range(256)]


def unpack_mask(packed, vocab: int) -> list[bool]:
    """One bool per token id from packed int32 words (bit i % 32 of word i // 32 = token i),
    `vocab` long."""
    vocab, n = int(vocab), len(packed)
    if n * 32 < vocab:
        raise ValueError(f"{n} mask words hold {n * 32} tokens, fewer than vocab {vocab}")
    data = struct.pack(f"<{n}I", *(int(w) & 0xFFFFFFFF for w in packed))   # little-endian: token order
    return list(itertools.chain.from_iterable(map(_BYTE_BITS.__getitem__, data)))[:vocab]
