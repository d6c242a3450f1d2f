"""Content-hash chain keys for prefix sharing.

The KV of a page depends on every token before it, not only on its own tokens, so a page's key
hashes its parent's key together with its tokens: equal keys mean equal prefixes up to and
including that page. blake2b (not Python's ``hash``) keeps keys identical across processes and
runs; 128 bits make an accidental collision negligible.

A chain starts at its partition's root: pages match only within a partition. A cache hit shows in
the time to first token, so tenants that shared one could learn each other's prompts; the engine
gives each owner a partition of its own (`partition_root`), keyed by its secret so no one can name
another's partition without it.
"""

import hashlib
import hmac
import struct
from collections.abc import Sequence

ROOT = 0
"""Parent key of a sequence's first page in the shared partition (no owner)."""


def partition_root(secret: bytes, owner: str | None) -> int:
    """The root key of ``owner``'s partition: HMAC-SHA256 of the owner under the engine's secret
    (None, a single-user server's owner: the shared partition, ROOT)."""
    if owner is None:
        return ROOT
    digest = hmac.new(secret, b"pie-prefix-partition:" + owner.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:16], "little")


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """Key of a page holding ``tokens`` whose previous page has key ``parent``."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent.to_bytes(16, "little"))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")
