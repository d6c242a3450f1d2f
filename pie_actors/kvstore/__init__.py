"""Paged KV bookkeeping: page pool, page tables, prefix index, fork, LRU eviction (no tensors)."""

from .pool import (Evicted, InvalidSlot, KVStoreError, OutOfPages, QuotaExceeded, UnknownSaved,
                   UnknownSequence)
from .prefix import ROOT, chain_key, partition_root
from .states import OutOfStates
from .store import AppendPlan, KVStore, Mark

__all__ = [
    "AppendPlan",
    "Evicted",
    "InvalidSlot",
    "KVStore",
    "KVStoreError",
    "Mark",
    "OutOfPages",
    "OutOfStates",
    "QuotaExceeded",
    "ROOT",
    "UnknownSaved",
    "UnknownSequence",
    "chain_key",
    "partition_root",
]
