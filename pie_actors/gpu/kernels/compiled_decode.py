"""Decode batches through graphs compiled ahead of time at bucketed batch sizes.

Eager PyTorch spends most of a small model's decode step in per-op overhead (30 layers x ~25 ops).
Decode-only batches (every lane one row, no custom mask) are the steady state, so they are padded to a
bucketed batch size and run through one compiled graph per bucket, the KV span being a dynamic
dimension (one compile serves every context length); prefill and anything unusual stays eager.
Padding lanes write into and attend to a scratch page that no sequence owns.

Each bucket's step is exported (torch.export) and compiled by AOTInductor into a package, its frozen
(on the CPU, oneDNN-packed) weights inside, under $PIE_HOME/cache/compiled/<key>/, so a second start
of the same model on the same machine loads them instead. torch.compile's own caches cannot do that on
the CPU: its graph cache bypasses graphs that hold oneDNN-packed weights, so every start compiled again
(bench/RESULTS.md, "Compiled engine start").

A bucket compiles in minutes on a CPU. A one-shot engine compiles what it lacks at start (`warm_up`);
an engine that serves for long loads what is there and serves at once, eager where a bucket is
missing, while `compile_behind` compiles the rest one bucket at a time, the most used first, each in a
child process at the lowest CPU priority: a compile is seconds of Python (export, inductor's code
generation) that in a thread would hold the interpreter lock against every engine step, and minutes
of C++ compiles and autotuning that would take the cores from serving. A bucket switches to its graph
once loaded: the engine thread reads its graph once a step, so a step runs wholly eager or compiled.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, TypedDict

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

log = logging.getLogger("pie.engine")


class Progress(TypedDict):
    """Where an engine's compiled decode stands (all 0 on an eager engine)."""

    ready: int                # buckets whose graphs are loaded: their decode batches run compiled
    total: int                # buckets up to compile_max_batch
    compiling: int            # the bucket (its batch size) compiling now; 0: none
    failed: int               # buckets whose compile failed: they run eager (the log says why)


def package_dir(key: dict) -> Path:
    """Where the compiled buckets of an engine with this `cache_key` live on this machine."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    return pie_home() / "cache" / "compiled" / digest


def buckets(max_batch: int) -> list[int]:
    """The batch buckets an engine compiles for decode batches of up to `max_batch` lanes."""
    return [b for b in BATCH_BUCKETS if b <= max_batch] or [BATCH_BUCKETS[0]]


def bucket(lanes: int) -> int:
    """The bucket a decode batch of `lanes` lanes runs in."""
    return next(b for b in BATCH_BUCKETS if b >= lanes)


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
        self.gemm_autotune = gemm_autotune
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
        self.failed: dict[int, str] = {}             # buckets whose compile failed: why
        self.compiling = 0                           # the bucket `compile_behind` compiles now
        self.runs: Counter[int] = Counter()          # decode steps run compiled, by bucket
        self.wanted: Counter[int] = Counter()        # decode steps by bucket, compiled or not yet
        self._changed = threading.Condition()        # a bucket loaded or failed; closing
        self._closing = False
        self._child: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def accepts(self, lanes: list[LanePlan]) -> bool:
        return len(lanes) <= self.max_batch and all(l.q_len == 1 and l.mask is None for l in lanes)

    def warm_up(self, progress: bool = True) -> None:
        """Load every bucket up to `max_batch`, compiling here and now the ones not yet compiled on
        this machine."""
        with contextlib.ExitStack() as stack:
            folder = self.packages or Path(stack.enter_context(tempfile.TemporaryDirectory()))
            folder.mkdir(parents=True, exist_ok=True)
            todo = [b for b in buckets(self.max_batch) if not _package(folder, b).is_file()]
            for batch in tqdm(todo, desc="compiling decode batches", unit="bucket",
                              disable=not progress or not todo):
                self._compile(batch, _package(folder, batch))
                self.compiled_now.append(batch)
            for batch in buckets(self.max_batch):
                self.graphs[batch] = _load(_package(folder, batch))

    def load_compiled(self) -> None:
        """Load the buckets that are compiled on this machine (in `packages`)."""
        for batch in buckets(self.max_batch):
            if _package(self.packages, batch).is_file():
                self.graphs[batch] = _load(_package(self.packages, batch))

    def compile_behind(self, model_dir: Path) -> None:
        """Compile the buckets not loaded into `packages` on a thread, one at a time, each in a child
        process that loads the model from `model_dir`; each bucket runs compiled from the decode step
        after its package loaded. `close` stops it."""
        self.packages.mkdir(parents=True, exist_ok=True)
        self.compiling = self._next()
        self._thread = threading.Thread(target=self._compile_left, args=(model_dir,), name="pie-compile",
                                        daemon=True)
        self._thread.start()

    def progress(self) -> Progress:
        return {"ready": len(self.graphs), "total": len(buckets(self.max_batch)), "compiling": self.compiling,
                "failed": len(self.failed)}

    def wait(self, ready: int | None = None, timeout: float | None = None) -> bool:
        """Wait until `ready` buckets are loaded (default: every one), or none is left to compile, or
        `close`; True when so many are loaded."""
        goal = len(buckets(self.max_batch)) if ready is None else ready
        with self._changed:
            self._changed.wait_for(lambda: len(self.graphs) >= goal or not self.compiling or self._closing,
                                   timeout)
            return len(self.graphs) >= goal

    def close(self) -> None:
        """Stop compiling: the compile under way is killed, its package never written."""
        with self._changed:
            self._closing = True
            child = self._child
            self._changed.notify_all()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)       # its compiler processes too
        if self._thread is not None:
            self._thread.join()

    @property
    def loaded(self) -> list[int]:
        """The buckets this engine loaded as they were, compiled by an earlier start."""
        return sorted(set(self.graphs) - set(self.compiled_now))

    def _next(self) -> int:
        """The bucket to compile next: of those neither loaded nor failed, the one most decode steps
        wanted so far, then the smallest; 0: none is left."""
        left = [b for b in buckets(self.max_batch) if b not in self.graphs and b not in self.failed]
        return min(left, key=lambda b: (-self.wanted[b], b)) if left else 0

    def _compile_left(self, model_dir: Path) -> None:
        while batch := self.compiling:
            path, started = _package(self.packages, batch), time.monotonic()
            try:
                if not path.is_file():     # (an engine starting beside this one may have compiled it)
                    self._compile_in_child(batch, path, model_dir)
                graph, error = _load(path), ""
            except Exception as e:
                graph, error = None, f"{type(e).__name__}: {e}"
            with self._changed:
                if self._closing:
                    self.compiling = 0
                elif graph is not None:
                    self.graphs[batch] = graph   # one dict store: a step reads its graph once
                    self.compiled_now.append(batch)
                    log.info("decode bucket %d compiled in %.0f s (%d of %d)", batch, time.monotonic() - started,
                             len(self.graphs), len(buckets(self.max_batch)))
                else:
                    self.failed[batch] = error
                    log.error("decode bucket %d failed to compile; it runs eager:\n%s", batch, error)
                if not self._closing:
                    self.compiling = self._next()
                self._changed.notify_all()

    def _compile_in_child(self, batch: int, path: Path, model_dir: Path) -> None:
        """Compile bucket `batch` into `path` in a child process (`_compile_main`)."""
        spec = {"model_dir": str(model_dir), "device": str(self.device), "dtype": str(self.kv[0].dtype),
                "slots": self.kv[0].shape[1], "page_size": self.page_size, "scratch_page": self.scratch_page,
                "batch_form": self.batch_form, "amx_gemm_edits": self.amx_gemm_edits,
                "gemm_autotune": self.gemm_autotune, "fused_attention_max_batch": self.fused_attention_max_batch,
                "batch": batch, "path": str(path)}
        root = str(Path(__file__).resolve().parents[3])     # this package's, wherever the engine runs
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        code = f"from {__name__} import _compile_main; _compile_main()"
        with self._changed:
            if self._closing:
                raise RuntimeError("the engine closed")
            child = self._child = subprocess.Popen(
                [sys.executable, "-c", code, json.dumps(spec)], env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = child.communicate()
        finally:
            with self._changed:
                self._child = None
        if child.returncode != 0:
            raise RuntimeError(f"the compile exited with status {child.returncode}: {stderr[-4000:]}")

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
            lanes: list[LanePlan]) -> torch.Tensor | None:
        """Logits [len(lanes), vocab] for a decode batch whose row i is lane i; None while its bucket
        is not loaded (the batch runs eager)."""
        batch = bucket(len(lanes))
        self.wanted[batch] += 1
        graph = self.graphs.get(batch)
        if graph is None:
            return None
        self.runs[batch] += 1
        # The package's own __call__ parses its input spec and flattens the inputs again at every
        # call (~50 µs a step); the flat list of tensors, in export's order, is what it passes on.
        *inputs, kv = self._inputs(input_ids, positions, write_slots, lanes, batch)
        flat = [t for t in inputs if t is not None] + kv
        return graph.loader.boxed_run(flat)[0][:len(lanes)]


def _load(path: Path) -> Callable[..., torch.Tensor]:
    return torch._inductor.aoti_load_package(str(path))


def _compile_main() -> None:
    """A child process of `compile_behind`: compile one bucket of the model its argument names, at
    the lowest CPU priority, into its package."""
    os.nice(19)
    spec = json.loads(sys.argv[1])
    from . import cpu_kernels
    from ..engine.worker import load_model
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"].removeprefix("torch."))
    if spec["batch_form"] == "kernel":
        cpu_kernels.load()
    model = load_model(spec["model_dir"], device, dtype)
    # the engine's pool shape (the slots are a dynamic dimension, yet a size that equals another
    # one would tie them in the export), left unwritten: the compile reads none of it
    shape = (model.cfg.num_kv_heads, spec["slots"], model.cfg.head_dim)
    kv = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
          for _ in range(model.cfg.num_layers)]
    compiled = CompiledDecode(model, kv, spec["page_size"], spec["scratch_page"], None, batch_form=spec["batch_form"],
                              amx_gemm_edits=spec["amx_gemm_edits"], gemm_autotune=spec["gemm_autotune"],
                              fused_attention_max_batch=spec["fused_attention_max_batch"])
    compiled._compile(spec["batch"], Path(spec["path"]))
