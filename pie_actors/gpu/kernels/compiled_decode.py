"""Decode batches through graphs compiled ahead of time at bucketed batch sizes.

Eager PyTorch spends most of a small model's decode step in per-op overhead (30 layers x ~25 ops).
Decode-only batches (every lane one row, no custom mask) are the steady state, so they are padded to a
bucketed batch size and run through one compiled graph per bucket, the KV span being a dynamic
dimension (one compile serves every context length); prefill and anything unusual stays eager.
Padding lanes write into and attend to a scratch page that no sequence owns.

Each bucket's step is exported (torch.export) and compiled by AOTInductor into a package, its frozen
(on the CPU, oneDNN-packed) weights inside, under $PIE_HOME/cache/compiled/<key>/. An engine compiles
the buckets it lacks at start (`warm_up`), so no request waits on a compile, and a second start of the
same model on the same machine loads them instead. torch.compile's own caches cannot do that on the
CPU: its graph cache bypasses graphs that hold oneDNN-packed weights, so every start compiled again
(bench/RESULTS.md, "Compiled engine start").
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from ...config import pie_home

from . import amx_gemm
from .attention import AttentionMetadata, LanePlan, _Group
from ..model import LlamaModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Up to this batch, decode attention is broadcast multiply-sums, which inductor fuses with the RoPE,
# the KV write and the K gather into one kernel a layer; above it, the worker's batch form (the C++
# paged kernel where it builds), which reads the pages in place and beats inductor's reductions as
# lanes add up (bench/RESULTS.md, "compiled decode forms").
FUSED_ATTENTION_MAX_BATCH = 1


def package_dir(key: dict) -> Path:
    """Where the compiled buckets of an engine with this `cache_key` live on this machine."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    return pie_home() / "cache" / "compiled" / digest


def buckets(max_batch: int) -> list[int]:
    """The batch buckets an engine compiles for decode batches of up to `max_batch` lanes."""
    return [b for b in BATCH_BUCKETS if b <= max_batch] or [BATCH_BUCKETS[0]]


def _package(folder: Path, batch: int) -> Path:
    return folder / f"bucket-{batch}.pt2"


def is_cached(key: dict, max_batch: int) -> bool:
    """Whether every bucket up to `max_batch` of an engine with this `cache_key` is compiled here."""
    return all(_package(package_dir(key), b).is_file() for b in buckets(max_batch))


class DecodeStep(nn.Module):
    """A decode batch's forward over plain tensors, the form torch.export takes. The KV caches are
    inputs, written in place, so that a package holds only the weights."""

    def __init__(self, model: LlamaModel, page_size: int, form: str):
        super().__init__()
        self.model, self.page_size, self.form = model, page_size, form

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                pages: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor | None,
                mask: torch.Tensor | None, kv: list[torch.Tensor]) -> torch.Tensor:
        meta = AttentionMetadata(write_slots, self.page_size, decode_form=self.form)
        meta.decode = _Group(None, pages, lengths, index, mask, whole_batch=True)
        caches = list(zip(kv[0::2], kv[1::2]))
        return self.model.logits(self.model(ids, positions, caches, meta))


class CompiledDecode:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 page_size: int, scratch_page: int, packages: Path | None, *,
                 batch_form: str = "fused_scores", amx_gemm_edits: bool = True,
                 gemm_autotune: bool = True, fused_attention_max_batch: int = FUSED_ATTENTION_MAX_BATCH,
                 max_batch: int = BATCH_BUCKETS[-1]):
        """`packages`: the folder of this engine's compiled buckets (`package_dir`); None compiles
        into a scratch folder that goes at the end of `warm_up`. `batch_form`: the decode attention
        form (`AttentionMetadata.decode_form`) of batches above `fused_attention_max_batch`.
        `amx_gemm_edits` is the engine's setting (EngineConfig). The other keyword arguments are for
        benchmarks (bench/decode_forms.py)."""
        self.model, self.page_size, self.scratch_page = model, page_size, scratch_page
        self.kv = [t for pair in kv_caches for t in pair]
        self.packages = packages
        self.batch_form, self.fused_attention_max_batch = batch_form, fused_attention_max_batch
        self.max_batch = min(max_batch, BATCH_BUCKETS[-1])
        self.device = kv_caches[0][0].device
        on_cpu = self.device.type == "cpu"
        # freezing turns the weights into constants, so the GEMMs get them prepacked (faster on the CPU)
        self.options: dict = {"freezing": True}
        if on_cpu and gemm_autotune:
            # Inductor's own C++ GEMM template (AMX/AVX-512 micro-kernels on the frozen, prepacked
            # weights, the residual add and the next norm fused in) reads a batch-1 step's weights
            # ~1.5x faster than oneDNN's prepacked GEMV here; autotuning measures both per shape and
            # keeps the faster, at ~20 s more per bucket's compile (bench/RESULTS.md, "compiled
            # decode forms").
            self.options |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
        self.amx_gemm_edits = amx_gemm_edits and on_cpu and amx_gemm.in_use()
        if self.amx_gemm_edits:
            self.options |= {"post_grad_custom_post_pass": amx_gemm.CacheKey()}   # see `_compile`
        self.graphs: dict[int, Callable[..., torch.Tensor]] = {}   # loaded packages, by bucket
        self.compiled_now: list[int] = []            # buckets this engine compiled, not loaded
        self.runs: Counter[int] = Counter()          # decode steps run, by bucket

    def accepts(self, lanes: list[LanePlan]) -> bool:
        return len(lanes) <= self.max_batch and all(l.q_len == 1 and l.mask is None for l in lanes)

    def warm_up(self, progress: bool = True) -> None:
        """Load every bucket up to `max_batch`, compiling the ones not yet compiled on this machine."""
        with contextlib.ExitStack() as stack:
            folder = self.packages or Path(stack.enter_context(tempfile.TemporaryDirectory()))
            folder.mkdir(parents=True, exist_ok=True)
            todo = [b for b in buckets(self.max_batch) if not _package(folder, b).is_file()]
            for batch in tqdm(todo, desc="compiling decode batches", unit="bucket",
                              disable=not progress or not todo):
                self._compile(batch, _package(folder, batch))
                self.compiled_now.append(batch)
            for batch in buckets(self.max_batch):
                self.graphs[batch] = torch._inductor.aoti_load_package(str(_package(folder, batch)))

    @property
    def loaded(self) -> list[int]:
        """The buckets this engine loaded as they were, compiled by an earlier start."""
        return sorted(set(self.graphs) - set(self.compiled_now))

    def _form(self, batch: int) -> str:
        return "fused" if batch <= self.fused_attention_max_batch else self.batch_form

    def _inputs(self, input_ids: list[int], positions: list[int], write_slots: list[int],
                lanes: list[LanePlan], batch: int) -> tuple:
        """A bucket's inputs, lanes past `lanes` padded onto the scratch page."""
        scratch_slot = self.scratch_page * self.page_size
        pad = batch - len(lanes)
        padding = [LanePlan(i, 1, [self.scratch_page], 1) for i in range(len(lanes), batch)]
        meta = AttentionMetadata.build(lanes + padding, write_slots + [scratch_slot] * pad, self.page_size,
                                       self.device, self._form(batch))
        g = meta.decode
        if g.pages.shape[1] == 1:
            # Export specializes a dimension of size 1: one page column more (never read, as the
            # lengths end before it) keeps the first page's steps on the same graph as the rest.
            g.pages = nn.functional.pad(g.pages, (0, 1))
        ids = torch.tensor(input_ids + [0] * pad, device=self.device)
        pos = torch.tensor(positions + [0] * pad, device=self.device)
        return ids, pos, meta.write_slots, g.pages, g.lengths, g.index, g.mask, self.kv

    @torch.inference_mode()
    def _compile(self, batch: int, path: Path) -> None:
        """Export the step of `batch` lanes and compile it into a package at `path`."""
        lanes = [LanePlan(i, 1, [self.scratch_page, self.scratch_page], 2) for i in range(batch)]
        args = self._inputs([0] * batch, [0] * batch, [self.scratch_page * self.page_size] * batch, lanes, batch)
        auto = torch.export.Dim.AUTO
        # the page table's width, the slots it spans and the pool's slots vary; the batch does not
        dynamic = ({}, {}, {}, {1: auto}, {}, None if args[5] is None else {1: auto},
                   None if args[6] is None else {3: auto}, [{1: auto}] * len(self.kv))
        program = torch.export.export(DecodeStep(self.model, self.page_size, self._form(batch)), args,
                                      dynamic_shapes=dynamic, strict=False)
        # the AMX GEMM edits are read when the GEMMs are generated, inside this call
        edits = amx_gemm.patched() if self.amx_gemm_edits else contextlib.nullcontext()
        partial = path.with_name(f".{path.stem}.{os.getpid()}.pt2")
        with edits:
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial),
                                                     inductor_configs=self.options)
        partial.replace(path)                # whole or absent, for an engine starting beside this one

    def run(self, input_ids: list[int], positions: list[int], write_slots: list[int],
            lanes: list[LanePlan]) -> torch.Tensor:
        """Logits [len(lanes), vocab] for a decode batch whose row i is lane i."""
        batch = next(b for b in BATCH_BUCKETS if b >= len(lanes))
        self.runs[batch] += 1
        # The package's own __call__ parses its input spec and flattens the inputs again at every
        # call (~50 µs a step); the flat list of tensors, in export's order, is what it passes on.
        *inputs, kv = self._inputs(input_ids, positions, write_slots, lanes, batch)
        flat = [t for t in inputs if t is not None] + kv
        return self.graphs[batch].loader.boxed_run(flat)[0][:len(lanes)]
