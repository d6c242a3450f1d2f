"""Paged KV bookkeeping: page pool, page tables, prefix index, fork, LRU eviction (no tensors)."""

from .pool import InvalidSlot, KVStoreError, OutOfPages, UnknownSaved, UnknownSequence
from .prefix import chain_key
from .store import AppendPlan, KVStore, Mark

__all__ = [
    "AppendPlan",
    "InvalidSlot",
    "KVStore",
    "KVStoreError",
    "Mark",
    "OutOfPages",
    "UnknownSaved",
    "UnknownSequence",
    "chain_key",
]
