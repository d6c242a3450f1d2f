"""Content-hash chain keys for prefix sharing.

The KV of a page depends on every token before it, not only on its own tokens, so a page's key
hashes its parent's key together with its tokens: equal keys mean equal prefixes up to and
including that page. blake2b (not Python's ``hash``) keeps keys identical across processes and
runs; 128 bits make an accidental collision negligible.
"""

import hashlib
import struct
from collections.abc import Sequence

ROOT = 0
"""Parent key of a sequence's first page."""


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """Key of a page holding ``tokens`` whose previous page has key ``parent``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent.to_bytes(16, "little"))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")
