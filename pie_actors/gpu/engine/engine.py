"""The engine: accepts forward-pass requests from many clients and runs them in shared batches.

`submit` queues a pass; each `step` asks the scheduler (scheduler.py) for a batch of pending passes,
runs it on the workers (worker.py: this process's rank, plus the other tensor-parallel ranks by
broadcast), commits the written KV and runs each pass's epilogue on its rows of logits. A bad pass
fails alone: the scheduler rejects it while planning, and a failing epilogue rolls its pass back.
`start` runs steps on a background thread; `generate` is greedy decoding for benchmarks and tests.
Saved working sets and those of parked programs leave the KV pool when it runs short, to host memory
or as their tokens, and come back before they are used (saved.py).
"""
from __future__ import annotations

import gc
import socket
import threading
import time
from collections import Counter
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ... import cpu_cores
from ...config import EngineConfig, load, pick_device, pick_dtype
from ...kvstore import ROOT, KVStore
from ...model_store import resolve_model
from ...tokenizer import Tokenizer
from ..eta import ProgramCache, argmax
from ..kernels import compiled_decode
from ..model.loader import load_checkpoint
from ..model.tp import Comm, join_group
from .channels import ChannelStore
from .saved import ParkedSets, SavedSets, Spill
from .scheduler import Epilogue, Lane, PassRequest, Planned, Scheduler
from .worker import BatchPlan, Worker, kv_bytes_per_page, start_remote_ranks, state_pages, state_slots


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _compile_key(config: EngineConfig, model_dir: Path, device: torch.device, dtype: torch.dtype) -> dict:
    """What a compiled decode step depends on: the key of the folder its packages live in."""
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.glob("*.safetensors"))
    return {"model": str(model_dir.resolve()), "weights": weights, "dtype": str(dtype), "device": device.type,
            "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability(),
            **{k: getattr(config, k) for k in ("page_size", "amx_gemm_edits")}}


def _compiles(config: EngineConfig, device: torch.device, long_lived: bool, key: dict) -> bool:
    """compile "on" / "off" as said; "auto": where it pays (CUDA, CPUs with AVX2 or better; not across
    tensor-parallel ranks), for engines that serve for long, and for others too once every bucket
    they would compile is compiled on this machine (a start then loads them: bench/RESULTS.md,
    "Compiled engine start")."""
    if config.compile != "auto":
        return config.compile == "on"
    pays = device.type == "cuda" or torch.backends.cpu.get_cpu_capability().lower() in ("avx2", "avx512")
    cached = compiled_decode.is_cached(key, config.compile_max_batch)
    return pays and config.tp == 1 and (long_lived or cached)


def _nothing(logits: torch.Tensor) -> None:
    return None


class Engine:
    def __init__(self, worker: Worker, kv: KVStore, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 remote: list | None = None):
        self.worker, self.kv, self.config, self.tokenizer = worker, kv, config, tokenizer
        self.model_config = worker.cfg               # the model's hyper-parameters (self.config: the engine settings)
        self.model_dir = worker.model_dir
        # the store name; a model given as a folder or file is known by its folder's name
        self.model_name = self.model_dir.name if Path(config.model).expanduser().exists() else config.model
        self.batch_sizes: Counter[int] = Counter()   # lanes per executed batch
        self.decode_batch_sizes: Counter[int] = Counter()   # the same, of batches of one row a lane
        self.tokens_computed = 0                     # input rows the model ran, prefill and decode
        self.tokens_by_owner: Counter[int | None] = Counter()   # the same per program, while it is connected
        self.row_epilogues = Counter()               # "calls": batched epilogue runs, "passes": passes they served
        # seconds of executed steps by part: "plan" (scheduling, page tables), "model" (the forward
        # on the workers), "epilogue", "finish" (commits, futures); the engine's own cost is plan +
        # finish. "plan_cpu" and "finish_cpu" are the engine thread's CPU time in those parts: the
        # wall time less the waits for the interpreter lock and the CPU that other threads hold.
        self.step_seconds: Counter[str] = Counter()
        self.batches_run = 0                         # batches handed to the workers, failed ones included
        self._remote = remote
        self.channels = ChannelStore(worker.device, config.channel_memory_mb << 20)
        self.programs = ProgramCache()               # compiled eta programs, by IR hash
        self.scheduler = Scheduler(kv, self.channels, self.model_config, config.max_batch_tokens,
                                   tensor_parallel=bool(remote), wait_for_programs=config.wait_for_programs)
        self._lock = threading.Condition()
        self._device = threading.Lock()              # held while the workers run a batch
        spill = Spill(kv, worker, config.spill_memory_mb << 20, lambda: self.scheduler.copies, self._device)
        self.saved, self.parked = SavedSets(spill), ParkedSets(spill)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.cores = cpu_cores.ModelCores()           # the cores its model thread has to itself (`start`)

    @classmethod
    def from_model(cls, model: str = "", *, long_lived: bool = False, progress: bool = True,
                   **settings: Any) -> Engine:
        """An engine for a model store name or folder (default: the configured model); `settings`
        override the config file's engine settings by name (`dtype="float32"`, `num_pages=256`)."""
        return cls.from_config(load(model=model or None, **settings).engine, long_lived=long_lived,
                               progress=progress)

    @classmethod
    def from_config(cls, config: EngineConfig, *, long_lived: bool = False, progress: bool = True) -> Engine:
        """Build the engine `config` describes. The KV pool is `num_pages` pages, or as many as fit
        in `kv_memory_mb` per rank. `long_lived`: it will serve for long (pie serve, the cluster's
        engines), so compile "auto" compiles it; a compiled engine warms up every bucket now (a
        progress bar unless `progress` is False)."""
        model_dir = resolve_model(config.model)
        dev = pick_device(config.device)
        dt = pick_dtype(config.dtype, dev)
        # A folder without a tokenizer still serves passes of token ids.
        tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        cfg = load_checkpoint(model_dir).config
        config.check_model(cfg)
        if cfg.recurrent_layers and config.tp > 1:
            raise ValueError(f"{cfg.architecture} has recurrent layers, which run at tensor-parallel size 1")
        num_pages = config.num_pages or max(
            1, (config.kv_memory_mb << 20) // kv_bytes_per_page(cfg, config.page_size, dt, config.tp))
        comm, remote = Comm(), None
        if config.tp > 1:
            import ray
            if not ray.is_initialized():
                ray.init()                # joins the running cluster if there is one
            init = f"tcp://{ray.util.get_node_ip_address()}:{_free_port()}"
            remote = start_remote_ranks(config, str(model_dir), dev, dt, num_pages, init)
            comm = join_group(0, config.tp, init, dev)
        key = _compile_key(config, model_dir, dev, dt)
        # compiled decode steps cover models whose every layer keeps KV
        compiles = not cfg.recurrent_layers and _compiles(config, dev, long_lived, key)
        packages = compiled_decode.package_dir(key) if compiles else None
        num_states = state_slots(cfg, num_pages, config.page_size, dt)
        worker = Worker(model_dir, config, device=dev, dtype=dt, num_pages=num_pages, comm=comm,
                        packages=packages, num_states=num_states)
        if worker.compiled is not None and long_lived:
            worker.compiled.load_compiled()      # a tenth of a second a bucket (after inductor's imports)
            worker.compiled.compile_behind(model_dir)
        elif worker.compiled is not None:
            worker.compiled.warm_up(progress)
        kv = KVStore(num_pages, config.page_size, config.prefix_cache, num_states,
                     state_pages(cfg, config.page_size, dt))
        return cls(worker, kv, config, tokenizer, remote)

    # ---- sequences ---------------------------------------------------------------------------
    def create_sequence(self, partition: int = ROOT) -> int:
        """A new empty working set whose pages match the prefix cache only within `partition`
        (a root key, `kvstore.partition_root`)."""
        with self._lock:
            return self.kv.create(partition)

    def fork(self, seq: int) -> int:
        """A child sharing `seq`'s frozen prefix; a partial tail page is copied before the next batch."""
        with self._lock:
            child, copies = self.kv.fork(seq)
            self.scheduler.copies.extend(copies)
            return child

    def free(self, seq: int) -> None:
        with self._lock:
            self.kv.free(seq)
            if self.parked:
                self.parked.forget(seq)

    def limit_pages(self, partition: int, pages: int) -> None:
        """Bound the KV pages the working sets of `partition` hold together, their recurrent states
        counted in pages (`KVStore.limit`; 0: no bound)."""
        with self._lock:
            self.kv.limit(partition, pages)

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

    def state_stats(self) -> dict[str, int]:
        """Recurrent-state slots (`KVStore.state_stats`; all 0 for a model without recurrent layers)."""
        with self._lock:
            return self.kv.state_stats()

    def compile_progress(self) -> compiled_decode.Progress:
        """How far the compiled decode buckets are (all 0 on an eager engine)."""
        compiled = self.worker.compiled
        return compiled.progress() if compiled else {"ready": 0, "total": 0, "compiling": 0, "failed": 0}

    # ---- saved working sets (saved.py) -------------------------------------------------------
    def save(self, seq: int, name: str, owner: str | None) -> int:
        """Keep `seq`'s frozen prefix as `owner`'s saved set `name` (replacing one of that name);
        returns its number of tokens."""
        with self._lock:
            tokens, copies = self.saved.save(seq, (owner, name))
            self.scheduler.copies.extend(copies)
            return tokens

    def open(self, name: str, owner: str | None) -> tuple[int, Future]:
        """A new sequence holding `owner`'s saved set `name`, and the future of {"seq", "restored":
        "kept" | "spilled" | "recomputed", "tokens"}: a recomputed set's comes once the prefill of
        its history ran (the sequence is the caller's to free, also when that prefill fails)."""
        with self._lock:
            seq, how, prefill, copies = self.saved.open((owner, name))
            self.scheduler.copies.extend(copies)
            report = {"seq": seq, "restored": how, "tokens": self.kv.length(seq) + len(prefill)}
        if prefill:
            return seq, self.submit(PassRequest([Lane(seq, prefill)], epilogue=lambda logits: report))
        future: Future = Future()
        future.set_result(report)
        return seq, future

    def list_saved(self, owner: str | None) -> list[dict]:
        """`owner`'s saved sets: {"name", "state" (kept, spilled, tokens), "tokens"}, by name."""
        with self._lock:
            return self.saved.listing(owner)

    def delete_saved(self, name: str, owner: str | None) -> None:
        """Forget `owner`'s saved set `name`; its pages and host memory return."""
        with self._lock:
            self.saved.delete((owner, name))

    def saved_stats(self) -> dict[str, int]:
        with self._lock:
            return self.saved.stats()

    # ---- parked working sets (saved.py) ------------------------------------------------------
    def park(self, seqs: Iterable[int]) -> None:
        """The program holding `seqs` waits for a message with no pass in flight: when the pool
        runs short, these sets leave it first (to host memory, or as their tokens) until `unpark`."""
        with self._lock:
            self.parked.park(seqs)

    def unpark(self, seqs: Iterable[int], owner: int | None) -> Future | None:
        """Bring back the parked sets among `seqs` before the next pass of their program `owner`:
        spilled ones are written back now (OutOfPages: those not back stay parked); ones kept as
        tokens are prefilled with their history, ahead of any pass submitted after this call.
        Returns the future of that prefill, None when there is none."""
        with self._lock:
            prefills = self.parked.unpark(seqs)
            if not prefills:
                return None
            request = PassRequest([Lane(seq, tokens) for seq, tokens in prefills], epilogue=_nothing, owner=owner)
            # A pass fails under the lock, rolled back (the scheduler's `fail`), so this evicts the
            # sets again before any later pass on them is planned.
            request.future.add_done_callback(partial(self._prefill_done, prefills))
            self.submit(request)
            return request.future

    def _prefill_done(self, prefills: list[tuple[int, list[int]]], future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                for seq, tokens in prefills:
                    self.parked.prefill_failed(seq, tokens)

    def parked_stats(self) -> dict[str, int]:
        with self._lock:
            return self.parked.stats()

    # ---- passes ------------------------------------------------------------------------------
    def submit(self, request: PassRequest) -> Future:
        with self._lock:
            self.scheduler.add(request, time.monotonic())
            self._lock.notify()
        return request.future

    def connected(self, owner: int) -> None:
        """Program `owner` connected; the batch of first passes waits for it a while (scheduler.py)."""
        with self._lock:
            self.scheduler.arrivals.connected(owner)

    def idle(self, owner: int) -> None:
        """Program `owner` waits on something other than the engine: the next batch does not wait
        for it (scheduler.py, `Arrivals`)."""
        with self._lock:
            self.scheduler.arrivals.idle(owner)
            self._lock.notify()

    def forget(self, owner: int) -> None:
        """Program `owner` has gone (its connection closed)."""
        with self._lock:
            self.scheduler.arrivals.forget(owner)
            self.tokens_by_owner.pop(owner, None)
            self._lock.notify()

    def step(self) -> int:
        """Run one batch of pending passes. Returns how many passes it completed or rejected."""
        started, cpu = time.perf_counter(), time.thread_time()
        with self._lock:
            planned, plan, handled = self.scheduler.schedule()
        if planned:
            self.step_seconds.update(plan=time.perf_counter() - started, plan_cpu=time.thread_time() - cpu)
            self._execute(planned, plan)
        elif plan.copies or plan.state_copies:
            self._broadcast_and_run(plan)
        return handled

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def _broadcast_and_run(self, plan: BatchPlan) -> torch.Tensor:
        with self._device:
            if self._remote:
                self.worker.comm.broadcast_object(plan)
            return self.worker.execute(plan)

    def _execute(self, planned: list[Planned], plan: BatchPlan) -> None:
        started = time.monotonic()
        t0 = time.perf_counter()
        try:
            self.batches_run += 1
            logits = self._broadcast_and_run(plan)
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)    # so that "model" holds the forward's time
        except Exception as e:            # a worker failure fails the whole batch, nothing else
            with self._lock:
                # forks' tail-page copies go first into the next batch (copying twice is harmless)
                self.scheduler.copies[:0] = plan.copies
                self.kv.state_copies[:0] = plan.state_copies
                for p in planned:
                    self.scheduler.rollback(p.undo)
                    self.scheduler.fail(p.request, e)
            return
        self.batch_sizes[len(plan.lanes)] += 1
        self.tokens_computed += len(plan.input_ids)
        for p in planned:
            self.tokens_by_owner[p.request.owner] += p.inputs
        if len(plan.input_ids) == len(plan.lanes):
            self.decode_batch_sizes[len(plan.lanes)] += 1
        t1 = time.perf_counter()
        # the epilogue first: if it fails, the pass never happened
        results = self._batched_epilogues(planned, logits)
        done: list[tuple[Planned, Any]] = []
        failed: list[tuple[Planned, Exception]] = []
        for i, p in enumerate(planned):
            try:
                if i in results:
                    if isinstance(results[i], Exception):      # its own part of a shared run
                        raise results[i]
                    done.append((p, results[i]))
                else:
                    rows = logits[p.rows]
                    done.append((p, p.request.epilogue(rows) if p.request.epilogue else rows.cpu()))
            except Exception as e:
                failed.append((p, e))
        t2, cpu = time.perf_counter(), time.thread_time()
        with self._lock:
            for p, e in failed:
                self.scheduler.rollback(p.undo)
                self.scheduler.fail(p.request, e)
            for p, result in list(done):
                try:
                    self.scheduler.commit(p)
                except Exception as e:    # its sequence was freed mid-batch
                    self.scheduler.rollback(p.undo)
                    self.scheduler.fail(p.request, e)
                    done.remove((p, result))
            for p, _ in done:
                if p.request.repeat is not None:
                    self.scheduler.repeat_ran(p.request)
            now = time.monotonic()
            self.scheduler.served(planned, now, now - started)
        for p, result in done:
            if p.request.repeat is None:
                p.request.future.set_result(result)
        self.step_seconds.update(model=t1 - t0, epilogue=t2 - t1, finish=time.perf_counter() - t2,
                                 finish_cpu=time.thread_time() - cpu, steps=1)

    def _batched_epilogues(self, planned: list[Planned], logits: torch.Tensor) -> dict[int, Any]:
        """Results of the passes whose epilogues run once for all passes sharing them (their
        `rows_epilogue`), by index in `planned`; a group whose run fails falls back to each pass's
        own epilogue, so a pass's error stays its own."""
        groups: dict[Any, list[int]] = {}
        for i, p in enumerate(planned):
            batched = p.request.rows_epilogue
            if batched is not None and p.rows.stop - p.rows.start == 1:
                groups.setdefault(batched.key, []).append(i)
        results: dict[int, Any] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            starts = [planned[i].rows.start for i in members]
            if starts == list(range(starts[0], starts[0] + len(starts))):
                rows = logits[starts[0]:starts[0] + len(starts)]     # a view: a whole step's rows, no copy
            else:
                rows = logits[torch.tensor(starts, device=logits.device)]
            epilogues = [planned[i].request.rows_epilogue for i in members]
            try:
                outputs = epilogues[0].run(rows, epilogues)
            except Exception:
                continue
            results.update(zip(members, outputs))
            self.row_epilogues.update(calls=1, passes=len(members))
        return results

    # ---- repeating passes (run-ahead) --------------------------------------------------------
    def ack(self, req: PassRequest, read: int) -> None:
        """The client has read the outputs of `read` runs of a repeating pass (`Scheduler.ack`)."""
        with self._lock:
            if self.scheduler.ack(req, read):
                self._lock.notify()

    def stop(self, req: PassRequest, keep: int | None = None) -> None:
        """Stop a repeating pass, keeping its first `keep` runs (`Scheduler.stop`)."""
        with self._lock:
            self.scheduler.stop(req, keep)

    # ---- background loop ---------------------------------------------------------------------
    def start(self, own_process: bool = False) -> "Engine":
        """Serve submitted passes from a background thread until `close`. `own_process`: the engine
        has its process to itself (an engine actor, an engine child), so on the CPU its model
        thread takes cores of its own (`cpu_cores.ModelCores`).

        It freezes the heap the process has built so far (`gc.freeze`): the model, the tokenizer
        and the libraries hold some 330,000 objects, and a full collection walking them holds the
        interpreter lock for ~160 ms, a stall of every step and program in the process that came
        every few batches ("Speed edits kept" in bench/RESULTS.md). `close` thaws it again, so what a
        closed engine leaves in reference cycles is collected."""
        gc.collect()
        gc.freeze()
        if own_process:
            self.cores = cpu_cores.ModelCores.for_engine(self.config, self.worker.device.type)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            self.cores.hold()     # at its start, and again while an ending engine's process holds them
            with self._lock:
                while True:
                    if self._stopping:
                        return
                    if not self.scheduler.has_work():
                        self._lock.wait()
                    elif (left := self.scheduler.wait_left(time.monotonic())) > 0:
                        self._lock.wait(left)     # programs that are coming: submit and idle wake us
                    else:
                        break
            self.step()

    def close(self) -> None:
        if self.worker.compiled:
            self.worker.compiled.close()
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread:
            self._thread.join()
            gc.unfreeze()
        self.cores.release()
        if self._remote:
            import ray
            self.worker.comm.broadcast_object(None)
            pg, actors, refs = self._remote
            ray.get(refs, timeout=60)
            self.worker.comm.close()
            for a in actors:
                ray.kill(a)
            if pg is not None:      # an engine actor's group is removed by whoever placed the actor
                ray.util.remove_placement_group(pg)
            self._remote = None

    # ---- convenience -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = False,
                 stop: set[int] | None = None,
                 on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """Greedy decoding of several prompts batched together; returns the new tokens of each.

        `on_token(prompt_index, token)` is called as each token arrives (streaming)."""
        stop = set() if ignore_eos else set(stop if stop is not None else self.model_config.eos_token_ids)
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
        used = budget = self.config.max_batch_tokens
        for i in live:
            if used + len(inputs[i]) > budget:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += len(inputs[i])
        return groups
