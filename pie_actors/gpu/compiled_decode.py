"""Decode batches through torch.compile at bucketed shapes.

Eager PyTorch spends most of a small model's decode step in per-op overhead (30 layers x ~25 ops).
Decode-only batches (every lane one row, no custom mask) are the steady state, so they are padded to a
bucketed batch size and KV span and run through one compiled graph per bucket; prefill and anything
unusual stays eager. Padding lanes write into and attend to a scratch page that no sequence owns.
"""
from __future__ import annotations

import torch

from .attention import AttentionMetadata, LanePlan
from .models import LlamaModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SPAN_PAGES = 16     # the KV span is padded to a multiple of this many pages


class CompiledDecode:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 page_size: int, scratch_page: int, mode: str | None = None):
        self.model, self.kv_caches, self.page_size = model, kv_caches, page_size
        self.scratch_page = scratch_page
        self.device = kv_caches[0][0].device
        self._fn = torch.compile(self._forward, dynamic=False, mode=mode)
        self.shapes: set[tuple[int, int]] = set()     # (batch, pages) buckets compiled so far

    @staticmethod
    def accepts(lanes: list[LanePlan]) -> bool:
        return len(lanes) <= BATCH_BUCKETS[-1] and all(l.q_len == 1 and l.mask is None for l in lanes)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.logits(self.model(ids, positions, self.kv_caches, meta))

    def run(self, input_ids: list[int], positions: list[int], write_slots: list[int],
            lanes: list[LanePlan]) -> torch.Tensor:
        """Logits [len(lanes), vocab] for a decode batch whose row i is lane i."""
        n = len(lanes)
        batch = next(b for b in BATCH_BUCKETS if b >= n)
        pages = -(-max(len(l.pages) for l in lanes) // SPAN_PAGES) * SPAN_PAGES
        scratch_slot = self.scratch_page * self.page_size
        padding = [LanePlan(i, 1, [self.scratch_page], 1) for i in range(n, batch)]
        meta = AttentionMetadata.build(lanes + padding, write_slots + [scratch_slot] * len(padding),
                                       self.page_size, self.device, min_pages=pages)
        self.shapes.add((batch, pages))
        ids = torch.tensor(input_ids + [0] * len(padding), device=self.device)
        pos = torch.tensor(positions + [0] * len(padding), device=self.device)
        return self._fn(ids, pos, meta)[:n]
