"""A worker holds one tensor-parallel shard of the model and its KV page tensors, and runs batch plans.

Rank 0 (inside the engine) plans every batch and hands the same `BatchPlan` to all ranks; each rank runs
its shard and the row-parallel layers all-reduce. Ranks 1..tp-1 are `WorkerActor`s that block in
`serve()`, receiving plans by broadcast from rank 0, so no Ray call sits on the per-batch path.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from ... import cpu_cores
from ...config import EngineConfig
from ..kernels import cpu_kernels, hugepages
from ..kernels.attention import AttentionMetadata, LanePlan
from ..kernels.compiled_decode import CompiledDecode
from ..model import LlamaModel, ModelConfig, build_model
from ..model.config import FULL_ATTENTION
from ..model.qwen3_5 import RecurrentMetadata, recurrent_state, recurrent_state_bytes
from ..model.adapters import AdapterUse
from ..model.loader import load_checkpoint
from ..model.tp import Comm, join_group, use_row_kernel


@dataclass
class BatchPlan:
    """Everything a rank needs to run one batch. Plain lists: it is pickled to the other ranks."""

    input_ids: list[int]
    positions: list[int]
    write_slots: list[int]                 # global KV slot of each row
    lanes: list[LanePlan]
    readout: list[int]                     # batch rows whose logits are returned
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) pages to copy first
    # A model with recurrent layers: each lane's (state slot read, state slot written, [(rows, slot)]
    # for states kept after its first rows), and the (src, dst) state slots to copy first
    states: list[tuple[int, int, list[tuple[int, int]]]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    adapters: list[AdapterUse] = field(default_factory=list)      # (tensor-parallel size 1 only)


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype, comm: Comm | None = None) -> LlamaModel:
    """The model in `model_dir` (this rank's shard of it), its weights loaded, for inference."""
    ckpt = load_checkpoint(model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(ckpt.config, comm or Comm())
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(ckpt.weights())
    return model.eval()


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    return 2 * len(cfg.kv_layers) * page_size * (cfg.num_kv_heads // tp) * cfg.head_dim * dtype.itemsize


def state_slots(cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype) -> int:
    """Recurrent-state slots for a model with recurrent layers (0 for one without): as many as fit
    in the memory of the KV pages, between 32 and two per page (a working set holds a page and,
    while a pass runs, two slots: the state it reads and the one it writes)."""
    if not cfg.recurrent_layers:
        return 0
    fit = num_pages * kv_bytes_per_page(cfg, page_size, dtype) // recurrent_state_bytes(cfg, dtype)
    return max(32, min(2 * num_pages, fit))


def state_pages(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """What one recurrent-state slot counts against a partition's page bound (`KVStore.limit`): the
    bytes of one working set's state over those of one KV page, rounded up, so that a bound in
    pages bounds the memory a tenant holds in either kind (1 for a model without recurrent layers)."""
    if not cfg.recurrent_layers:
        return 1
    return -(-recurrent_state_bytes(cfg, dtype) // max(1, kv_bytes_per_page(cfg, page_size, dtype)))


class Worker:
    """One rank: the model shard plus per-layer K and V caches of shape [kv_heads, num_pages * page_size, head_dim]."""

    def __init__(self, model_dir: str | Path, config: EngineConfig, *, device: torch.device,
                 dtype: torch.dtype, num_pages: int, comm: Comm | None = None, packages: Path | None = None,
                 num_states: int = 0):
        """`packages`: the folder of this engine's compiled decode buckets (compiled_decode.py); None
        runs decode eager. `num_states`: recurrent-state slots (`state_slots`)."""
        if device.type == "cpu":   # Ray sets OMP_NUM_THREADS=1 inside actors: say how many we use
            torch.set_num_threads(config.num_threads or _cores())
        self.comm = comm or Comm()
        self.device, self.dtype, self.page_size = device, dtype, config.page_size
        self.model_dir = Path(model_dir)
        self.model = load_model(model_dir, device, dtype, self.comm)
        self.cfg = self.model.cfg
        if config.cpu_linear_kernel and device.type == "cpu" and dtype == torch.float32 and cpu_kernels.load():
            use_row_kernel(self.model)
        use_hugepages = config.hugepages and device.type == "cpu"
        if use_hugepages:
            hugepages.advise(self.model.parameters())   # every decode step streams them all
        zeros = partial(hugepages.zeros if use_hugepages else torch.zeros, device=device)
        heads = self.cfg.num_kv_heads // self.comm.world_size
        # One page past the pool: a scratch page for the padding rows of compiled decode batches.
        shape = (heads, (num_pages + 1) * self.page_size, self.cfg.head_dim)
        self.kv_caches = [(zeros(shape, dtype=dtype), zeros(shape, dtype=dtype)) for _ in self.cfg.kv_layers]
        # each layer's state: its K and V caches, or (linear attention) its recurrent-state slots
        kv = iter(self.kv_caches)
        self.caches = [next(kv) if self.cfg.layer_type(i) == FULL_ATTENTION
                       else recurrent_state(self.cfg, num_states, device, dtype) for i in range(self.cfg.num_layers)]
        self.recurrent = [self.caches[i] for i in self.cfg.recurrent_layers]
        # decode attention: the C++ kernel on the CPU where it builds (cpu_kernels.py)
        use_kernel = (device.type == "cpu" and self.cfg.head_dim in cpu_kernels.HEAD_DIMS
                      and cpu_kernels.load())
        self.decode_form = "kernel" if use_kernel else "matmul"
        # Compiled decode graphs would need traceable collectives; tensor-parallel ranks run eager.
        self.compiled = (CompiledDecode(self.model, self.kv_caches, self.page_size, num_pages, packages,
                                        batch_form="kernel" if use_kernel else "fused_scores",
                                        amx_gemm_edits=config.amx_gemm_edits,
                                        max_batch=config.compile_max_batch)
                         if packages and self.comm.world_size == 1 else None)

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> torch.Tensor:
        """Run one batch; returns float32 logits [len(plan.readout), vocab] on the worker's device."""
        if plan.copies:
            self._copy_pages(plan.copies)
        if plan.state_copies:
            self._copy_states(plan.state_copies)
        if not plan.input_ids:
            return torch.empty(0, self.cfg.vocab_size, device=self.device)
        if (self.compiled and not plan.adapters and self.compiled.accepts(plan.lanes)
                and plan.readout == list(range(len(plan.lanes)))):
            logits = self.compiled.run(plan.input_ids, plan.positions, plan.write_slots, plan.lanes)
            if logits is not None:          # else its bucket is still compiling: eager
                return logits
        dev = self.device
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(plan.positions, dtype=torch.long, device=dev)
        meta = AttentionMetadata.build(plan.lanes, plan.write_slots, self.page_size, dev, self.decode_form)
        args = (ids, pos, self.caches, meta, plan.adapters)
        hidden = (self.model(*args, RecurrentMetadata.build(plan.lanes, plan.states, dev)) if self.recurrent
                  else self.model(*args))
        rows = torch.tensor(plan.readout, dtype=torch.long, device=dev)
        return self.model.logits(hidden.index_select(0, rows))

    def _slots(self, pages: list[int]) -> torch.Tensor:
        """The global KV slots of `pages`, page by page."""
        offsets = torch.arange(self.page_size, device=self.device)
        return (torch.tensor(pages, device=self.device).unsqueeze(1) * self.page_size + offsets).flatten()

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        src, dst = self._slots([s for s, _ in copies]), self._slots([d for _, d in copies])
        for k, v in self.kv_caches:
            k.index_copy_(1, dst, k.index_select(1, src))
            v.index_copy_(1, dst, v.index_select(1, src))

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            for conv, ssm in self.recurrent:
                conv[dst], ssm[dst] = conv[src], ssm[src]

    @torch.inference_mode()
    def read_pages(self, pages: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host-memory copies of the K and V rows of `pages`, a pair per layer (a saved working
        set spilled out of the page pool)."""
        slots = self._slots(pages)
        return [(k.index_select(1, slots).cpu(), v.index_select(1, slots).cpu()) for k, v in self.kv_caches]

    @torch.inference_mode()
    def write_pages(self, pages: list[int], rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write what `read_pages` returned into `pages` (a spilled working set coming back)."""
        slots = self._slots(pages)
        for (k, v), (host_k, host_v) in zip(self.kv_caches, rows):
            k.index_copy_(1, slots, host_k.to(k.device))
            v.index_copy_(1, slots, host_v.to(v.device))

    def serve(self, cores: cpu_cores.ModelCores) -> None:
        """Ranks > 0: run every plan rank 0 broadcasts until it broadcasts None, on `cores` (the
        rank's actor has its process to itself)."""
        while (plan := self.comm.broadcast_object()) is not None:
            cores.hold()
            self.execute(plan)
        self.comm.close()
        cores.release()


class WorkerActor:
    """Ray actor body for ranks 1..tp-1 (see `start_remote_ranks`)."""

    def __init__(self, config: EngineConfig, model_dir: str, device: str, dtype: str, num_pages: int,
                 rank: int, init_method: str):
        self.config, self.model_dir, self.num_pages = config, model_dir, num_pages
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        self.rank, self.init_method = rank, init_method

    def placement_group(self) -> str | None:
        """The id of the placement group this rank runs in (answered while `serve` runs)."""
        import ray
        pg = ray.util.get_current_placement_group()
        return pg.id.hex() if pg else None

    def serve(self) -> None:
        # The process group is joined here, not in __init__, because joining blocks until rank 0 joins too.
        comm = join_group(self.rank, self.config.tp, self.init_method, self.device)
        Worker(self.model_dir, self.config, device=self.device, dtype=self.dtype, num_pages=self.num_pages,
               comm=comm).serve(cpu_cores.ModelCores.for_engine(self.config, self.device.type))


def start_remote_ranks(config: EngineConfig, model_dir: str, device: torch.device, dtype: torch.dtype,
                       num_pages: int, init_method: str) -> list:
    """Start ranks 1..tp-1 as Ray actors and set them serving. They take bundles 1..tp-1 of the
    placement group the caller (rank 0, the engine actor) runs in (see `start_engine_actor`); a
    caller outside one (an Engine built in a driver) gets a group of its own for them.

    Returns [the group made here or None, the actor handles, their `serve` refs]; the caller joins
    the process group as rank 0 next.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ...placement import engine_resources

    resources = engine_resources(config, device.type == "cuda")
    pg = ray.util.get_current_placement_group()
    owned = None
    if pg is None or len(pg.bundle_specs) < config.tp:
        pg = owned = ray.util.placement_group(resources.bundles[1:], strategy=resources.strategy)
        ray.get(pg.ready(), timeout=60)
    first = 0 if owned else 1                    # a group of its own has no bundle for rank 0
    remote = ray.remote(WorkerActor)
    actors, refs = [], []
    for rank in range(1, config.tp):
        actor = remote.options(
            **resources.rank_options, max_concurrency=2,    # `placement_group` answers during `serve`
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank - 1 + first),
        ).remote(config, model_dir, str(device), str(dtype).removeprefix("torch."), num_pages, rank, init_method)
        actors.append(actor)
        refs.append(actor.serve.remote())
    return [owned, actors, refs]


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
