"""Decode batches through torch.compile at bucketed batch sizes.

Eager PyTorch spends most of a small model's decode step in per-op overhead (30 layers x ~25 ops).
Decode-only batches (every lane one row, no custom mask) are the steady state, so they are padded to a
bucketed batch size and run through one compiled graph per bucket, the KV span being a dynamic
dimension (one compile serves every context length); prefill and anything unusual stays eager.
Padding lanes write into and attend to a scratch page that no sequence owns.

An engine compiles every bucket up to its `compile_max_batch` at start (`warm_up`), so no request
waits on a compile. Inductor's caches live under $PIE_HOME/cache/inductor: a second start of the same
model on the same machine reuses the GEMM autotuning and the compiled kernels (the graphs themselves
are traced again: inductor does not cache graphs that hold oneDNN-packed weights). `warm_up` leaves a
marker (`is_cached`) so one-shot runs know the compile will be cheap.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import types
from pathlib import Path

import torch
from tqdm import tqdm

from ...config import pie_home

from . import amx_gemm, hugepages
from .attention import AttentionMetadata, LanePlan
from ..model import LlamaModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Up to this batch, decode attention is broadcast multiply-sums, which inductor fuses with the RoPE,
# the KV write and the K gather into one kernel a layer; above it, the worker's batch form (the C++
# paged kernel where it builds), which reads the pages in place and beats inductor's reductions as
# lanes add up (bench/RESULTS.md, "compiled decode forms").
FUSED_ATTENTION_MAX_BATCH = 1


def _marker(key: dict) -> Path:
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    return pie_home() / "cache" / "compiled" / digest


def is_cached(key: dict) -> bool:
    """Whether an engine with this `cache_key` has warmed up on this machine before."""
    return _marker(key).is_file()


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a code object of its own (a separate Dynamo cache)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


class CompiledDecode:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 page_size: int, scratch_page: int, *, batch_form: str = "fused_scores",
                 hugepages: bool = True, amx_gemm_edits: bool = True, gemm_autotune: bool = True,
                 cpp_wrapper: bool = True, fused_attention_max_batch: int = FUSED_ATTENTION_MAX_BATCH,
                 max_batch: int = BATCH_BUCKETS[-1]):
        """`batch_form`: the decode attention form (`AttentionMetadata.decode_form`) of batches above
        `fused_attention_max_batch`. `hugepages` and `amx_gemm_edits` are the engine's CPU speed
        edits (EngineConfig). The other keyword arguments are for benchmarks (bench/decode_forms.py)."""
        self.model, self.kv_caches, self.page_size = model, kv_caches, page_size
        self.scratch_page = scratch_page
        self.batch_form, self.fused_attention_max_batch = batch_form, fused_attention_max_batch
        self.max_batch = min(max_batch, BATCH_BUCKETS[-1])
        self.device = kv_caches[0][0].device
        # The model's modules never change after loading, so their guards are pure per-call cost
        # (~0.8 ms a step here); tensor shape guards stay, and buckets keep those few. Without those
        # guards nothing tells two engines' graphs apart, and Dynamo keeps graphs per code object:
        # each instance compiles its own copy of `_forward` (its graphs hold its frozen weights).
        forward = types.MethodType(_own_code(CompiledDecode._forward), self)
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if self.device.type == "cpu" and gemm_autotune:
            # Inductor's own C++ GEMM template (AMX/AVX-512 micro-kernels on the frozen, prepacked
            # weights, the residual add and the next norm fused in) reads a batch-1 step's weights
            # ~1.5x faster than oneDNN's prepacked GEMV here; autotuning measures both per shape and
            # keeps the faster, at ~20 s more per bucket's compile (bench/RESULTS.md, "compiled
            # decode forms").
            options |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
        on_cpu = self.device.type == "cpu"
        self.hugepages = hugepages and on_cpu
        self.amx_gemm_edits = amx_gemm_edits and on_cpu and amx_gemm.in_use()
        if self.amx_gemm_edits:
            options |= {"post_grad_custom_post_pass": amx_gemm.CacheKey()}   # see `run`
        if self.device.type == "cpu" and cpp_wrapper:
            # The graph's ~400 kernel calls from generated C++ instead of Python: 1.03-1.09x a step
            # here, ~10 s more compile per bucket (bench/RESULTS.md, "compiled decode forms").
            options |= {"cpp_wrapper": True}
        self._fn = torch.compile(forward, dynamic=False, options=options)
        # one graph per batch bucket, each a "recompile" of the same code
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   len(BATCH_BUCKETS))
        self.batch_sizes: set[int] = set()           # buckets run so far (one compile each)

    def accepts(self, lanes: list[LanePlan]) -> bool:
        return len(lanes) <= self.max_batch and all(l.q_len == 1 and l.mask is None for l in lanes)

    @torch.inference_mode()                  # as the worker runs batches: the graphs' grad-mode guard
    def warm_up(self, key: dict, progress: bool = True) -> None:
        """Compile every bucket up to `max_batch` now (lanes on the scratch page), then mark `key`
        as cached on this machine."""
        buckets = [b for b in BATCH_BUCKETS if b <= self.max_batch] or [BATCH_BUCKETS[0]]
        scratch_slot = self.scratch_page * self.page_size
        for batch in tqdm(buckets, desc="compiling decode batches", unit="bucket", disable=not progress):
            lanes = [LanePlan(i, 1, [self.scratch_page], 1) for i in range(batch)]
            self.run([0] * batch, [0] * batch, [scratch_slot] * batch, lanes)
        marker = _marker(key)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(key, sort_keys=True) + "\n", encoding="utf-8")

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.logits(self.model(ids, positions, self.kv_caches, meta))

    def run(self, input_ids: list[int], positions: list[int], write_slots: list[int],
            lanes: list[LanePlan]) -> torch.Tensor:
        """Logits [len(lanes), vocab] for a decode batch whose row i is lane i."""
        n = len(lanes)
        batch = next(b for b in BATCH_BUCKETS if b >= n)
        scratch_slot = self.scratch_page * self.page_size
        padding = [LanePlan(i, 1, [self.scratch_page], 1) for i in range(n, batch)]
        form = "fused" if batch <= self.fused_attention_max_batch else self.batch_form
        meta = AttentionMetadata.build(lanes + padding, write_slots + [scratch_slot] * len(padding),
                                       self.page_size, self.device, form)
        if meta.decode.pages.shape[1] == 1:
            # Dynamo specializes a dimension of size 1: one page column more (never read, as the
            # lengths end before it) keeps the first page's steps on the same graph as the rest.
            meta.decode.pages = torch.nn.functional.pad(meta.decode.pages, (0, 1))
        torch._dynamo.mark_dynamic(meta.decode.pages, 1)
        if meta.decode.index is not None:
            torch._dynamo.mark_dynamic(meta.decode.index, 1)
            torch._dynamo.mark_dynamic(meta.decode.mask, 3)
        ids = torch.tensor(input_ids + [0] * len(padding), device=self.device)
        pos = torch.tensor(positions + [0] * len(padding), device=self.device)
        # freezing turns the weights into constants, so the GEMMs get them prepacked (faster on the
        # CPU), and the AMX GEMMs prefetch their weights (amx_gemm.py); both are read when a
        # bucket compiles, which happens inside this call.
        edits = amx_gemm.patched() if self.amx_gemm_edits else contextlib.nullcontext()
        with torch._inductor.config.patch(freezing=True), edits:
            logits = self._fn(ids, pos, meta)[:n]
        if batch not in self.batch_sizes and self.hugepages:
            hugepages.advise(hugepages.cpu_tensors())   # the bucket's new prepacked weights among them
        self.batch_sizes.add(batch)
        return logits
