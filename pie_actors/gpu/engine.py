"""The engine: accepts forward-pass requests from many clients and runs them in shared batches.

Continuous batching: every `step` takes whatever passes are pending (FIFO, up to a token budget, one
lane per sequence per batch so a pipeline's passes stay ordered), plans their KV slots in the page
store, runs one batch on the workers, commits the written KV and runs each pass's epilogue on its
rows of logits. A bad pass fails alone: it is rejected while planning and its KV changes roll back.
"""
from __future__ import annotations

import socket
import threading
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..config import load_config, pick_device, pick_dtype
from ..kvstore import KVStore, KVStoreError, Mark
from ..model_store import resolve_model
from .adapters import AdapterFn, AdapterUse
from .attention import LanePlan
from .channels import ChannelError, ChannelStore
from .eta import EtaError, ProgramCache, argmax
from .loader import load_checkpoint
from .tokenizer import Tokenizer
from .tp import Comm, TorchDistComm
from .worker import BatchPlan, Worker, kv_bytes_per_page, start_remote_ranks

Epilogue = Callable[[torch.Tensor], Any]


class PassError(ValueError):
    """A forward pass was rejected; the message names the lane and the problem."""


_PASS_ERRORS = (PassError, KVStoreError, ChannelError, EtaError)   # a bad pass: fails alone


@dataclass
class Lane:
    """One sequence's rows in a pass.

    Default geometry (`slots` None) appends `tokens` at the end of the sequence at positions
    length.., attends causally over the whole sequence, and freezes the rows (`fold=True`).
    Explicit geometry writes rows at local `slots` with `positions`, attends over slots [0, kv_len)
    (causally by slot, or by `mask`), and freezes up to `fold` when it is an int.
    """

    seq: int
    tokens: list[int]
    positions: list[int] | None = None
    slots: list[int] | None = None
    kv_len: int | None = None
    mask: list[list[bool]] | None = None
    fold: bool | int = True
    readout: list[int] | None = None      # rows of this lane whose logits reach the epilogue; default: last
    tokens_from: int | None = None        # a channel: `tokens` are taken from it when the pass is planned


@dataclass
class Repeat:
    """A pass that runs again and again (run-ahead decoding): up to `budget` times, at most `window`
    runs ahead of what its client acknowledged reading (`Engine.ack`), until `Engine.stop`.
    Its future resolves with the number of runs kept when it ends."""

    budget: int
    window: int
    runs: int = 0
    acked: int = 0
    stopped: bool = False
    keep: int | None = None               # runs to keep when stopped (later ones are cut off)
    parked: bool = False                  # waiting for an ack (not in the pending queue)
    # Before each run not yet acknowledged (run `first + i` at index i), to cut back to on stop:
    lengths: list[dict[int, int]] = field(default_factory=list)   # seq -> length
    channels: list[dict] = field(default_factory=list)            # device channels' values
    first: int = 0


@dataclass
class PassRequest:
    lanes: list[Lane]
    epilogue: Epilogue | None = None      # logits [rows read out, vocab] -> result; default returns logits on CPU
    future: Future = field(default_factory=Future)
    prologue: Callable[[], None] | None = None   # runs when the pass is planned, before its inputs are taken
    channels: list[int] = field(default_factory=list)   # channels it uses: poisoned if it fails
    repeat: Repeat | None = None
    adapters: list[tuple[str, int | None, AdapterFn]] = field(default_factory=list)   # (site, layer, f)


@dataclass
class _Planned:
    request: PassRequest
    rows: slice                           # its readout rows in the batch's logits
    commits: list[tuple[int, int | None]] # (seq, fold_to) to commit after the batch ran
    undo: list[Mark]                      # sequence extents to roll back to if the batch fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _check_tp(cfg, tp: int) -> None:
    """Fail before any rank starts: a shape that does not split would fail on every rank at once."""
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("intermediate size", cfg.intermediate_size), ("vocabulary size", cfg.vocab_size)):
        if n % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the model's {what} ({n})")


class Engine:
    def __init__(self, worker: Worker, kv: KVStore, tokenizer: Tokenizer | None = None,
                 max_batch_tokens: int = 4096, remote: list | None = None):
        self.worker, self.kv, self.tokenizer = worker, kv, tokenizer
        self.cfg = worker.cfg
        self.max_batch_tokens = max_batch_tokens
        self.batch_sizes: Counter[int] = Counter()   # lanes per executed batch
        self._remote = remote
        self.channels = ChannelStore(worker.device)
        self.programs = ProgramCache()               # compiled eta programs, by IR hash
        self._pending: deque[PassRequest] = deque()
        self._copies: list[tuple[int, int]] = []
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def from_model(cls, model: str = "", *, device: str | None = None, dtype: str | None = None,
                   page_size: int | None = None, kv_memory_mb: int | None = None, num_pages: int | None = None,
                   max_batch_tokens: int | None = None, tp: int | None = None,
                   num_threads: int | None = None, compile: bool | None = None) -> "Engine":
        """Build an engine from a model store name or folder; unset options come from the config file.

        The KV pool is `num_pages` pages, or as many as fit in `kv_memory_mb` per rank.
        """
        conf = load_config()
        model_dir = resolve_model(model or conf["model"])
        dev = pick_device(device or conf["device"])
        dt = pick_dtype(dtype or conf["dtype"], dev)
        page_size = page_size or conf["page_size"]
        tp = tp or conf["tp"]
        # A folder without a tokenizer still serves passes of token ids.
        tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        cfg = load_checkpoint(model_dir).config
        if num_pages is None:
            budget = (kv_memory_mb or conf["kv_memory_mb"]) * 2**20
            num_pages = max(1, budget // kv_bytes_per_page(cfg, page_size, dt, tp))
        comm, remote = Comm(), None
        if tp > 1:
            _check_tp(cfg, tp)
            import ray
            if not ray.is_initialized():
                ray.init()                # joins the running cluster if there is one
            init = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
            remote = start_remote_ranks(str(model_dir), dev, dt, num_pages, page_size, tp, init, num_threads)
            comm = TorchDistComm(0, tp, init, dev)
        # Compiled decode graphs would need traceable collectives; tensor-parallel ranks run eager.
        compile = (conf["compile"] if compile is None else compile) and tp == 1
        worker = Worker(model_dir, device=dev, dtype=dt, num_pages=num_pages, page_size=page_size,
                        comm=comm, num_threads=num_threads, compile=compile)
        return cls(worker, KVStore(num_pages, page_size), tokenizer,
                   max_batch_tokens or conf["max_batch_tokens"], remote)

    # ---- sequences ---------------------------------------------------------------------------
    def create_sequence(self) -> int:
        with self._lock:
            return self.kv.create()

    def fork(self, seq: int) -> int:
        """A child sharing `seq`'s frozen prefix; a partial tail page is copied before the next batch."""
        with self._lock:
            child, copies = self.kv.fork(seq)
            self._copies.extend(copies)
            return child

    def free(self, seq: int) -> None:
        with self._lock:
            self.kv.free(seq)

    def reserve(self, seq: int, end: int) -> None:
        """Pages for local slots [0, end), for passes with explicit geometry."""
        with self._lock:
            self.kv.reserve(seq, end)

    def seq_state(self, seq: int) -> dict[str, int]:
        with self._lock:
            kv = self.kv
            return {"length": kv.length(seq), "folded": kv.folded(seq), "cached_tokens": kv.cached_tokens(seq)}

    def kv_stats(self) -> dict[str, int]:
        with self._lock:
            return self.kv.stats()

    # ---- passes ------------------------------------------------------------------------------
    def submit(self, request: PassRequest) -> Future:
        with self._lock:
            self._pending.append(request)
            self._lock.notify()
        return request.future

    def step(self) -> int:
        """Run one batch of pending passes. Returns how many passes it completed or rejected."""
        with self._lock:
            planned, plan, handled = self._plan_batch()
        if planned:
            self._execute(planned, plan)
        elif plan.copies:
            self._broadcast_and_run(plan)
        return handled

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def _plan_batch(self) -> tuple[list[_Planned], BatchPlan, int]:
        plan = BatchPlan([], [], [], [], [], self._copies)
        self._copies = []
        planned: list[_Planned] = []
        busy: set[int] = set()
        handled, waiting = 0, deque()
        while self._pending:
            req = self._pending.popleft()
            seqs = [lane.seq for lane in req.lanes]
            n_tokens = sum(len(lane.tokens) for lane in req.lanes)
            # A pass with adapters runs in a batch of its own: its adapter code runs inside the
            # model, where a failure fails the whole batch.
            full = len(plan.input_ids) + n_tokens > self.max_batch_tokens
            alone = bool(req.adapters or plan.adapters)
            if busy.intersection(seqs) or (planned and (alone or full)):
                waiting.append(req)        # next batch: keeps each sequence's passes in order
                busy.update(seqs)
                continue
            handled += 1
            try:
                planned.append(self._plan_pass(req, plan))
                busy.update(seqs)
            except _PASS_ERRORS as e:
                self._fail(req, e)
        self._pending = waiting
        return planned, plan, handled

    def _fail(self, req: PassRequest, error: Exception) -> None:
        """The pass failed: its channels are poisoned, so whoever waits on them hears of it."""
        self.channels.poison(req.channels, f"{type(error).__name__}: {error}")
        if not req.future.done():
            req.future.set_exception(error)

    def _plan_pass(self, req: PassRequest, plan: BatchPlan) -> _Planned:
        if not req.lanes:
            raise PassError("a forward pass needs at least one lane")
        if len({lane.seq for lane in req.lanes}) != len(req.lanes):
            raise PassError("two lanes of one pass update the same sequence")
        if req.repeat is not None:
            req.repeat.lengths.append({lane.seq: self.kv.length(lane.seq) for lane in req.lanes})
            req.repeat.channels.append(self.channels.snapshot(req.channels))
        if req.prologue is not None:
            req.prologue()
        lanes = [self._take_tokens(lane) for lane in req.lanes]
        for i, lane in enumerate(lanes):
            self._validate(i, lane)
        if req.adapters and self._remote:
            raise PassError("adapters need tensor-parallel size 1")
        undo: list[Mark] = []
        mark = (len(plan.input_ids), len(plan.lanes), len(plan.readout))
        try:
            # adapted KV is not the model's: never shared through the prefix index
            commits = [self._plan_lane(lane, plan, undo, shareable=not req.adapters) for lane in lanes]
        except (PassError, KVStoreError):
            self._rollback(undo)
            del plan.input_ids[mark[0]:], plan.positions[mark[0]:], plan.write_slots[mark[0]:]
            del plan.lanes[mark[1]:], plan.readout[mark[2]:]
            raise
        plan.adapters += [AdapterUse(site, layer, mark[0], len(plan.input_ids), fn)
                          for site, layer, fn in req.adapters]
        return _Planned(req, slice(mark[2], len(plan.readout)), commits, undo)

    def _take_tokens(self, lane: Lane) -> Lane:
        """The lane with its input tokens taken from its channel, when it has one."""
        if lane.tokens_from is None:
            return lane
        value = self.channels.take(lane.tokens_from)
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise PassError(f"input channel {lane.tokens_from} holds {value.dtype} values, not token ids")
        return replace(lane, tokens=value.flatten().tolist(), tokens_from=None)

    def _rollback(self, undo: list[Mark]) -> None:
        for mark in reversed(undo):
            try:
                self.kv.rollback(mark)
            except KVStoreError:
                pass                      # the sequence was freed meanwhile: nothing left to undo

    def _validate(self, i: int, lane: Lane) -> None:
        n, vocab = len(lane.tokens), self.cfg.vocab_size
        if n == 0:
            raise PassError(f"lane {i}: no input tokens")
        bad = [t for t in lane.tokens if not 0 <= t < vocab]
        if bad:
            raise PassError(f"lane {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        for name in ("positions", "slots"):
            values = getattr(lane, name)
            if values is not None and len(values) != n:
                raise PassError(f"lane {i}: {len(values)} {name} for {n} tokens")
        max_pos = self.cfg.max_position_embeddings
        end = self.kv.length(lane.seq) + n if lane.positions is None else max(lane.positions) + 1
        if end > max_pos or (lane.positions and min(lane.positions) < 0):
            raise PassError(f"lane {i}: position {end - 1} is beyond the model's context of {max_pos} tokens")
        if lane.readout is not None and not all(0 <= r < n for r in lane.readout):
            raise PassError(f"lane {i}: readout rows {lane.readout} outside the lane's {n} rows")

    def _plan_lane(self, lane: Lane, plan: BatchPlan, undo: list[Mark], shareable: bool = True
                   ) -> tuple[int, int | None]:
        kv, seq, n = self.kv, lane.seq, len(lane.tokens)
        canonical = shareable and lane.positions is None and lane.mask is None
        undo.append(kv.mark(seq))
        if lane.slots is None:
            appended = kv.append(seq, lane.tokens, canonical=canonical,
                                 reuse_prefix=canonical and lane.readout is None)
            skip, write, q_slots = appended.reused, appended.slots, None
            positions = (list(range(appended.start, appended.start + n - skip)) if lane.positions is None
                         else lane.positions[skip:])
        else:
            skip, q_slots = 0, lane.slots
            write = kv.slots_for(seq, lane.slots, lane.tokens, canonical=False)
            positions = lane.positions if lane.positions is not None else lane.slots
        kv_len = kv.length(seq) if lane.kv_len is None else lane.kv_len
        if not 0 < kv_len <= kv.length(seq) or (q_slots and max(q_slots) >= kv_len):
            raise PassError(f"sequence {seq}: kv_len {kv_len} must cover the rows written "
                            f"and stay within the sequence's {kv.length(seq)} slots")
        if lane.mask is not None and (len(lane.mask) != n or any(len(r) != kv_len for r in lane.mask)):
            raise PassError(f"sequence {seq}: mask must be {n} rows x {kv_len} slots")
        start = len(plan.input_ids)
        plan.input_ids += lane.tokens[skip:]
        plan.positions += positions
        plan.write_slots += write
        plan.lanes.append(LanePlan(start, n - skip, kv.kv_pages(seq, kv_len), kv_len, q_slots, lane.mask))
        plan.readout += [start + r - skip for r in (lane.readout or [n - 1])]
        fold = kv.length(seq) if lane.fold is True else (None if lane.fold is False else lane.fold)
        return seq, fold

    def _broadcast_and_run(self, plan: BatchPlan) -> torch.Tensor:
        if self._remote:
            self.worker.comm.broadcast_object(plan)
        return self.worker.execute(plan)

    def _execute(self, planned: list[_Planned], plan: BatchPlan) -> None:
        try:
            logits = self._broadcast_and_run(plan)
        except Exception as e:            # a worker failure fails the whole batch, nothing else
            with self._lock:
                for p in planned:
                    self._rollback(p.undo)
                    self._fail(p.request, e)
            return
        self.batch_sizes[len(plan.lanes)] += 1
        for p in planned:
            req = p.request
            try:                          # the epilogue first: if it fails, the pass never happened
                rows = logits[p.rows]
                result = req.epilogue(rows) if req.epilogue else rows.cpu()
                with self._lock:
                    for seq, fold in p.commits:
                        self.kv.commit(seq, fold)
            except Exception as e:        # a failing epilogue, or a sequence freed mid-batch
                with self._lock:
                    self._rollback(p.undo)
                    self._fail(req, e)
                continue
            if req.repeat is None:
                req.future.set_result(result)
            else:
                with self._lock:
                    self._repeat_ran(req)

    # ---- repeating passes (run-ahead) --------------------------------------------------------
    def _repeat_ran(self, req: PassRequest) -> None:
        r = req.repeat
        r.runs += 1
        if r.stopped or r.runs >= r.budget:
            self._end_repeat(req)
        elif r.runs - r.acked < r.window:
            self._pending.append(req)
            self._lock.notify()
        else:
            r.parked = True

    def ack(self, req: PassRequest, read: int) -> None:
        """The client has read the outputs of `read` runs: the pass may run `window` beyond that."""
        with self._lock:
            r = req.repeat
            r.acked = max(r.acked, min(read, r.runs))
            # runs the client has read are never cut: forget their before-states
            del r.lengths[:r.acked - r.first], r.channels[:r.acked - r.first]
            r.first = r.acked
            if r.parked and r.runs - r.acked < r.window:
                r.parked = False
                self._pending.append(req)
                self._lock.notify()

    def stop(self, req: PassRequest, keep: int | None = None) -> None:
        """Stop repeating; with `keep`, the runs after the first `keep` are cut off the sequences
        (their tokens were produced but never read)."""
        with self._lock:
            r = req.repeat
            if r.stopped or req.future.done():
                return
            r.stopped, r.keep = True, keep
            if r.parked or req in self._pending:
                if req in self._pending:
                    self._pending.remove(req)
                self._end_repeat(req)
            # else it is running: _repeat_ran ends it

    def _end_repeat(self, req: PassRequest) -> None:
        r = req.repeat
        kept = r.runs if r.keep is None else min(max(r.keep, r.first), r.runs)
        if kept < r.runs:                 # as if the runs after `kept` had never happened
            try:
                for seq, length in r.lengths[kept - r.first].items():
                    self._copies.extend(self.kv.cut(seq, length))
            except KVStoreError as e:     # the sequence was freed meanwhile
                req.future.set_exception(e)
                return
            self.channels.restore(r.channels[kept - r.first])
        req.future.set_result(kept)

    # ---- background loop ---------------------------------------------------------------------
    def start(self) -> "Engine":
        """Serve submitted passes from a background thread until `close`."""
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._copies and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
            self.step()

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread:
            self._thread.join()
        if self._remote:
            import ray
            self.worker.comm.broadcast_object(None)
            pg, actors, refs = self._remote
            ray.get(refs, timeout=60)
            self.worker.comm.close()
            for a in actors:
                ray.kill(a)
            ray.util.remove_placement_group(pg)
            self._remote = None

    # ---- convenience -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = False,
                 stop: set[int] | None = None,
                 on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """Greedy decoding of several prompts batched together; returns the new tokens of each.

        `on_token(prompt_index, token)` is called as each token arrives (streaming)."""
        stop = set() if ignore_eos else set(stop if stop is not None else self.cfg.eos_token_ids)
        seqs = [self.create_sequence() for _ in prompts]
        outputs: list[list[int]] = [[] for _ in prompts]
        inputs = [list(p) for p in prompts]
        live = list(range(len(prompts)))
        greedy: Epilogue = lambda logits: argmax(logits).tolist()   # one token per lane
        try:
            for _ in range(max_new_tokens):
                groups = self._pass_groups(live, inputs)
                futures = [self.submit(PassRequest([Lane(seqs[i], inputs[i]) for i in g], greedy)) for g in groups]
                if self._thread is None:
                    self.run_until_idle()
                tokens = [t for f in futures for t in f.result()]
                for i, token in zip([i for g in groups for i in g], tokens):
                    outputs[i].append(token)
                    if on_token:
                        on_token(i, token)
                    inputs[i] = [token]
                    if token in stop:
                        live.remove(i)
                if not live:
                    break
        finally:
            for s in seqs:
                self.free(s)
        return outputs

    def _pass_groups(self, live: list[int], inputs: list[list[int]]) -> list[list[int]]:
        """`live` split into passes of many lanes (one epilogue call for them all, not one per lane),
        each within the batch token budget, so that long prompts still prefill over several batches."""
        groups: list[list[int]] = []
        used = self.max_batch_tokens
        for i in live:
            if used + len(inputs[i]) > self.max_batch_tokens:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += len(inputs[i])
        return groups
