"""The scheduler: which pending passes run together, and where their rows go in the KV store.

Continuous batching: each batch takes whatever passes are pending up to a token budget, with one
lane per sequence per batch so that a pipeline's passes stay in order. Planning a pass writes
its rows into the page tables (`KVStore.append` / `slots_for`), so a pass that cannot run (a bad
token id, no pages left, a position past the context) is rejected here and rolled back, alone.
Repeating passes (run-ahead decoding) go back into the queue after each run until their client's
acknowledged reads hold them back, or they are stopped.

Fairness. Pending passes are queued per program (a pass's `owner`), each queue in submission order,
and a batch takes them round-robin: one pass of each program in turn, the program that goes first
rotating from batch to batch. So a program with thousands of passes pending holds another back by
one pass of its own per round, not by all of them: with two programs, a pass waits at most one
batch for room (`PassRequest.waited` counts the batches it waited). A batch holds at most
`max_batch_tokens` rows, so no more of a program's passes than that are looked at per batch: a
flood of passes costs each batch a bounded amount of planning, not the length of the flood.

Waiting for programs that are coming (`Arrivals`). A program that submits one pass per token
gets its answer at the end of a step and submits its next pass one host round trip later. If the
next step started at once it would hold only the passes that were already there, and the rest
would wait a whole step for the one after: the batch would split in two for good, at nearly the
cost of a full batch each. So after a step, the programs (a pass's `owner`: its data-plane
connection) whose passes it answered are *expected*, unless they have a pass pending already; the
next step waits until every expected program has submitted, or said it is idle (it awaits a tool,
a message or its client: it leaves the wait at once), or the hold's bound has passed since the
step ended. The bound is twice the 90th percentile of the round trips measured (answer to next
submission), and never more than half a step (an exponential average of step times): a lone
program is never delayed more than that, and never at all once it has submitted, since then
nothing is expected. Programs that arrive after the bound are not waited for in that step, but
their round trip is still measured, so the bound follows what the hosts take.

Programs that start together are gathered: when every pending pass is the first of its program
and no program is expected, the step waits for more first passes, so that their prefills share
one batch and their decode steps stay in phase (a prefill of the first few, run without the rest,
costs a step of its own, and the rest then end a step later). A program whose host connects at
its launch (runs given the engine's address do, and say so in the data plane's handshake:
`Engine.connected`) is *starting* until its first pass comes or it says it is idle. While any
program is starting, the step waits for it, up to one step after the first of the pending passes
arrived: N programs launched at once on a busy host take
about that long to start. When none is starting and each pending program connected at its launch,
nothing else is on its way, and the step goes at once: a lone program is not delayed at all. Only
programs that connect with their first pass (a run that chooses its replica by that pass) leave the
engine blind to what comes, and then the step waits the bound after the first of them. Passes
without an owner (`Engine.generate`) are never waited for.

The Engine owns the lock: every method here is called with the engine's lock held.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import torch

from ...kvstore import KVStore, KVStoreError, Mark
from ..eta import EtaError
from ..kernels.attention import LanePlan
from ..model.adapters import AdapterFn, AdapterUse
from ..model.config import ModelConfig
from .channels import ChannelError, ChannelStore
from .worker import BatchPlan

Epilogue = Callable[[torch.Tensor], Any]


class PassError(ValueError):
    """A forward pass was rejected; the message names the lane and the problem."""


PASS_ERRORS = (PassError, KVStoreError, ChannelError, EtaError)   # a bad pass: fails alone


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
    # a model with recurrent layers: lengths (slots) at which the pass keeps the recurrent state, for
    # a later cut back to them (fwd.checkpoints); explicit slots keep one at each unfrozen row anyway
    checkpoints: list[int] | None = None
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


@dataclass(frozen=True)
class RowEpilogue:
    """An epilogue the engine may run once for many passes that each read out one row. Passes whose
    `key` is the same share one call (one launch a batch, not one a pass): the first pass's
    `run(rows, members)` takes their rows [passes, vocab] and every pass's RowEpilogue (`own` is
    what is that pass's own: its channels) and gives each pass's result in order, or an
    exception for a pass whose own part failed. A pass's own `epilogue` must give the same result
    alone; a `run` that raises has changed nothing, and each pass runs its own."""

    key: Any
    run: Callable[[torch.Tensor, list["RowEpilogue"]], list[Any]]
    own: Any = None


@dataclass
class PassRequest:
    lanes: list[Lane]
    epilogue: Epilogue | None = None      # logits [rows read out, vocab] -> result; default returns logits on CPU
    rows_epilogue: RowEpilogue | None = None   # the same epilogue, batchable across passes
    future: Future = field(default_factory=Future)
    prologue: Callable[[], None] | None = None   # runs when the pass is planned, before its inputs are taken
    channels: list[int] = field(default_factory=list)   # channels it uses: poisoned if it fails
    repeat: Repeat | None = None
    adapters: list[tuple[str, int | None, AdapterFn]] = field(default_factory=list)   # (site, layer, f)
    owner: int | None = None              # the program (data-plane connection) that submitted it
    waited: int = 0                       # batches that looked at it and ran without it


@dataclass
class Planned:
    """A pass placed in a batch: what to commit once the batch ran, what to undo if it failed."""

    request: PassRequest
    rows: slice                           # its readout rows in the batch's logits
    commits: list[tuple[int, int | None]] # (seq, fold_to) to commit after the batch ran
    undo: list[Mark]                      # sequence extents to roll back to if the batch fails
    inputs: int = 0                       # the input rows it put into the batch (prefix-cache hits not among them)


class Arrivals:
    """Which programs the next step waits for, and until when (see the module docstring)."""

    RTT_FACTOR = 2.0            # the bound: this many times the 90th-percentile round trip ...
    STEP_FRACTION = 0.5         # ... and at most this fraction of a step
    FIRST_RTT_S = 1e-3          # the round trip assumed before any is measured
    SAMPLES = 64                # round trips kept

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.expected: dict[int, float] = {}    # owner -> when its pass was answered (waited for)
        self.late: dict[int, float] = {}        # the same, past the bound (measured, not waited for)
        self.known: set[int] = set()            # owners served at least once
        self.launched: set[int] = set()         # owners that connected at their launch
        self.starting: set[int] = set()         # ... and have not submitted a pass yet
        self._first_new: float | None = None    # when the first pass of a new program arrived
        self.step_end = 0.0
        self.step_s = 0.0                       # exponential average of step times
        self._rtts: deque[float] = deque(maxlen=self.SAMPLES)
        self._sorted: list[float] | None = []
        self._hold_start: float | None = None
        self.holds = 0                          # steps that waited for expected programs
        self.expired = 0                        # ... and reached the bound before all of them came
        self.gathers = 0                        # steps that waited to gather new programs' first passes
        self.held_s = 0.0

    def bound(self) -> float:
        if self._sorted is None:
            self._sorted = sorted(self._rtts)
        rtt = self._sorted[int(0.9 * (len(self._sorted) - 1))] if self._sorted else self.FIRST_RTT_S
        return min(self.RTT_FACTOR * rtt, self.STEP_FRACTION * self.step_s)

    def served(self, owners: Iterable[int | None], pending: set[int | None], now: float, step_s: float) -> None:
        """A step answered passes of `owners`; those without a pass in `pending` are expected."""
        self.step_end = now
        self.step_s = step_s if not self.step_s else 0.8 * self.step_s + 0.2 * step_s
        if not self.enabled:
            return
        for owner in owners:
            if owner is not None and owner not in pending:
                self.expected[owner] = now
        self.known.update(o for o in owners if o is not None)
        self._first_new = now if any(o is not None and o not in self.known for o in pending) else None

    def connected(self, owner: int) -> None:
        """A program's host connected at its launch; its first pass is coming."""
        if self.enabled:
            self.launched.add(owner)
            self.starting.add(owner)

    def arrived(self, owner: int | None, now: float) -> None:
        self.starting.discard(owner)
        if owner is not None and owner not in self.known and self._first_new is None:
            self._first_new = now
        since = self.expected.pop(owner, None)
        if since is None:
            since = self.late.pop(owner, None)
        if since is not None:
            self._rtts.append(now - since)
            self._sorted = None               # sorted again when the bound is next asked for

    def idle(self, owner: int | None) -> None:
        """The program waits on something other than the engine: do not wait for it."""
        self.starting.discard(owner)
        self.expected.pop(owner, None)
        self.late.pop(owner, None)

    def forget(self, owner: int) -> None:
        """The program is gone."""
        self.idle(owner)
        self.known.discard(owner)
        self.launched.discard(owner)

    def wait_left(self, now: float, pending: Iterable[int | None]) -> float:
        """Seconds the next step, of the `pending` passes' owners, should still wait (0: now)."""
        if not self.enabled:
            return 0.0
        deadline, gathering = None, False
        if self.expected:
            deadline = self.step_end + self.bound()
        elif self._first_new is not None and all(o is not None and o not in self.known for o in pending):
            unannounced = any(o not in self.launched for o in pending)
            wait = self.step_s if self.starting else self.bound() if unannounced else 0.0
            deadline, gathering = self._first_new + wait, True
        if deadline is not None:
            if now < deadline:
                if self._hold_start is None:
                    self._hold_start = now
                    if gathering:
                        self.gathers += 1
                    else:
                        self.holds += 1
                return deadline - now
            if self.expected:
                self.expired += 1
                self.late.update(self.expected)
                self.expected.clear()
            self._first_new = None
        if self._hold_start is not None:
            self.held_s += now - self._hold_start
            self._hold_start = None
        return 0.0

    def stats(self) -> dict[str, float]:
        return {"holds": self.holds, "expired": self.expired, "gathers": self.gathers,
                "held_s": round(self.held_s, 6),
                "bound_ms": round(self.bound() * 1e3, 3), "step_ms": round(self.step_s * 1e3, 3)}


class Scheduler:
    def __init__(self, kv: KVStore, channels: ChannelStore, cfg: ModelConfig, max_batch_tokens: int,
                 tensor_parallel: bool = False, wait_for_programs: bool = True):
        self.kv, self.channels, self.cfg = kv, channels, cfg
        self.max_batch_tokens = max_batch_tokens
        self.tensor_parallel = tensor_parallel
        self.pending: dict[int | None, deque[PassRequest]] = {}   # owner -> its pending passes, in order
        self.copies: list[tuple[int, int]] = []      # (src, dst) pages to copy before the next batch
        self.arrivals = Arrivals(wait_for_programs)
        self._turn = 0                               # rotates the program that goes first in a batch

    def has_work(self) -> bool:
        return bool(self.pending or self.copies or self.kv.state_copies)

    def add(self, request: PassRequest, now: float) -> None:
        self._queue(request)
        self.arrivals.arrived(request.owner, now)

    def _queue(self, request: PassRequest) -> None:
        self.pending.setdefault(request.owner, deque()).append(request)

    def wait_left(self, now: float) -> float:
        """Seconds the next batch should wait for programs that are coming (`Arrivals`)."""
        return self.arrivals.wait_left(now, self.pending)

    def served(self, planned: list[Planned], now: float, step_s: float) -> None:
        """A batch of `planned` passes ran and was answered at `now`, in `step_s` seconds."""
        self.arrivals.served([p.request.owner for p in planned if p.request.repeat is None],
                             set(self.pending), now, step_s)

    def schedule(self) -> tuple[list[Planned], BatchPlan, int]:
        """The next batch: its planned passes, the plan the workers run, and how many passes were
        handled (planned or rejected)."""
        # The copies run first in this batch; they stay the pending ones while its passes are
        # planned, for an allocation that evicts a set to see those into its pages (saved.py).
        plan = BatchPlan([], [], [], [], [], self.copies)
        planned: list[Planned] = []
        busy: set[int] = set()
        handled = 0
        queues, self.pending = self.pending, {}
        owners = list(queues)
        if owners:
            first = self._turn % len(owners)
            self._turn += 1
            owners = owners[first:] + owners[:first]
        waiting: dict[int | None, deque[PassRequest]] = {}
        for req in _round_robin([queues[owner] for owner in owners], self.max_batch_tokens):
            seqs = [lane.seq for lane in req.lanes]
            n_tokens = 0
            for lane in req.lanes:
                n_tokens += len(lane.tokens)
            # A pass with adapters runs in a batch of its own: its adapter code runs inside the
            # model, where a failure fails the whole batch.
            full = len(plan.input_ids) + n_tokens > self.max_batch_tokens
            alone = bool(req.adapters or plan.adapters)
            if not busy.isdisjoint(seqs) or (planned and (alone or full)):
                # next batch: keeps each sequence's passes in order
                waiting.setdefault(req.owner, deque()).append(req)
                req.waited += 1
                busy.update(seqs)
                continue
            handled += 1
            try:
                planned.append(self._plan_pass(req, plan))
                busy.update(seqs)
            except PASS_ERRORS as e:
                self.fail(req, e)
        for owner, queue in queues.items():        # the passes not looked at follow the deferred ones
            rest = waiting.get(owner)
            if rest is not None:
                rest.extend(queue)
                queue = rest
            if queue:
                self.pending[owner] = queue
        self.copies = []
        plan.state_copies = self.kv.take_state_copies()   # after planning: a prefix hit's copy too
        return planned, plan, handled

    def fail(self, req: PassRequest, error: Exception) -> None:
        """The pass failed: its channels are poisoned, so whoever waits on them hears of it."""
        self.channels.poison(req.channels, f"{type(error).__name__}: {error}")
        if req.repeat is not None:
            self._unpin(req.repeat.lengths)
            req.repeat.lengths.clear()
        if not req.future.done():
            req.future.set_exception(error)

    def rollback(self, undo: list[Mark]) -> None:
        for mark in reversed(undo):
            try:
                self.kv.rollback(mark)
            except KVStoreError:
                pass                      # the sequence was freed meanwhile: nothing left to undo

    def commit(self, planned: Planned) -> None:
        for seq, fold in planned.commits:
            self.kv.commit(seq, fold)

    # ---- planning one pass -------------------------------------------------------------------
    def _plan_pass(self, req: PassRequest, plan: BatchPlan) -> Planned:
        if not req.lanes:
            raise PassError("a forward pass needs at least one lane")
        if len(req.lanes) > 1 and len({lane.seq for lane in req.lanes}) != len(req.lanes):
            raise PassError("two lanes of one pass update the same sequence")
        if req.repeat is not None:
            req.repeat.lengths.append({lane.seq: self.kv.length(lane.seq) for lane in req.lanes})
            for lane in req.lanes:        # a recurrent state is kept there, for a cut back on stop
                self.kv.pin(lane.seq)
            req.repeat.channels.append(self.channels.snapshot(req.channels))
        if req.prologue is not None:
            req.prologue()
        lanes = [lane if lane.tokens_from is None else self._take_tokens(lane) for lane in req.lanes]
        for i, lane in enumerate(lanes):
            self._validate(i, lane)
        if req.adapters and self.tensor_parallel:
            raise PassError("adapters need tensor-parallel size 1")
        undo: list[Mark] = []
        mark = (len(plan.input_ids), len(plan.lanes), len(plan.readout))
        try:
            # adapted KV is not the model's: never shared through the prefix index
            commits = [self._plan_lane(lane, plan, undo, shareable=not req.adapters) for lane in lanes]
        except (PassError, KVStoreError):
            self.rollback(undo)
            del plan.input_ids[mark[0]:], plan.positions[mark[0]:], plan.write_slots[mark[0]:]
            del plan.lanes[mark[1]:], plan.states[mark[1]:], plan.readout[mark[2]:]
            raise
        if req.adapters:
            plan.adapters += [AdapterUse(site, layer, mark[0], len(plan.input_ids), fn)
                              for site, layer, fn in req.adapters]
        return Planned(req, slice(mark[2], len(plan.readout)), commits, undo, len(plan.input_ids) - mark[0])

    def _take_tokens(self, lane: Lane) -> Lane:
        """The lane with its input tokens taken from its channel."""
        value = self.channels.take(lane.tokens_from)
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise PassError(f"input channel {lane.tokens_from} holds {value.dtype} values, not token ids")
        return replace(lane, tokens=value.flatten().tolist(), tokens_from=None)

    def _validate(self, i: int, lane: Lane) -> None:
        tokens, vocab = lane.tokens, self.cfg.vocab_size
        n = len(tokens)
        if n == 0:
            raise PassError(f"lane {i}: no input tokens")
        if min(tokens) < 0 or max(tokens) >= vocab:
            bad = next(t for t in tokens if not 0 <= t < vocab)
            raise PassError(f"lane {i}: token id {bad} is outside the vocabulary [0, {vocab})")
        if lane.positions is not None and len(lane.positions) != n:
            raise PassError(f"lane {i}: {len(lane.positions)} positions for {n} tokens")
        if lane.slots is not None and len(lane.slots) != n:
            raise PassError(f"lane {i}: {len(lane.slots)} slots for {n} tokens")
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
            length = appended.start + n - skip
            positions = (list(range(appended.start, length)) if lane.positions is None
                         else lane.positions[skip:])
        else:
            skip, q_slots = 0, lane.slots
            write = kv.slots_for(seq, lane.slots, lane.tokens, canonical=False)
            positions = lane.positions if lane.positions is not None else lane.slots
            length = kv.length(seq)
        kv_len = length if lane.kv_len is None else lane.kv_len
        if not 0 < kv_len <= length or (q_slots and max(q_slots) >= kv_len):
            raise PassError(f"sequence {seq}: kv_len {kv_len} must cover the rows written "
                            f"and stay within the sequence's {length} slots")
        if lane.mask is not None and (len(lane.mask) != n or any(len(r) != kv_len for r in lane.mask)):
            raise PassError(f"sequence {seq}: mask must be {n} rows x {kv_len} slots")
        fold = length if lane.fold is True else (None if lane.fold is False else lane.fold)
        first = length - n + skip if lane.slots is None else lane.slots[0]    # the slot of its first row
        keep = list(lane.checkpoints or ())
        if any(not first <= c <= length for c in keep):
            bad = next(c for c in keep if not first <= c <= length)
            raise PassError(f"sequence {seq}: checkpoint slot {bad} is outside the pass's slots [{first}, {length}]")
        if lane.slots is not None:        # what a later pass may rewrite from: each unfrozen row
            keep += range(first + 1 if fold is None else max(fold, first + 1), length)
        elif canonical:                   # what a later request may start from (prefix reuse)
            keep += kv.snapshot_lengths(seq, first, length)
        state = kv.advance_state(seq, first, keep)   # the recurrent layers read and write it in order
        if state is not None:
            if lane.mask is not None or kv_len != length:
                raise PassError(f"sequence {seq}: the model's recurrent layers see every row before "
                                "these: a mask or a shorter kv_len is not possible")
            plan.states.append(state)
        start = len(plan.input_ids)
        plan.input_ids += lane.tokens[skip:]
        plan.positions += positions
        plan.write_slots += write
        plan.lanes.append(LanePlan(start, n - skip, kv.kv_pages(seq, kv_len), kv_len, q_slots, lane.mask))
        if lane.readout is None:
            plan.readout.append(start + n - 1 - skip)
        else:
            plan.readout += [start + r - skip for r in lane.readout]
        return seq, fold

    # ---- repeating passes (run-ahead) --------------------------------------------------------
    def repeat_ran(self, req: PassRequest) -> None:
        """A run of a repeating pass finished: queue the next one, park it until an ack, or end it."""
        r = req.repeat
        r.runs += 1
        if r.stopped or r.runs >= r.budget:
            self._end_repeat(req)
        elif r.runs - r.acked < r.window:
            self._queue(req)
        else:
            r.parked = True

    def ack(self, req: PassRequest, read: int) -> bool:
        """The client has read the outputs of `read` runs: the pass may run `window` beyond that.
        True when the pass went back into the queue."""
        r = req.repeat
        r.acked = max(r.acked, min(read, r.runs))
        # runs the client has read are never cut: forget their before-states
        self._unpin(r.lengths[:r.acked - r.first])
        del r.lengths[:r.acked - r.first], r.channels[:r.acked - r.first]
        r.first = r.acked
        if r.parked and r.runs - r.acked < r.window:
            r.parked = False
            self._queue(req)
            return True
        return False

    def stop(self, req: PassRequest, keep: int | None = None) -> None:
        """Stop repeating; with `keep`, the runs after the first `keep` are cut off the sequences
        (their tokens were produced but never read)."""
        r = req.repeat
        if r.stopped or req.future.done():
            return
        r.stopped, r.keep = True, keep
        queue = self.pending.get(req.owner, ())
        if r.parked or req in queue:
            if req in queue:
                queue.remove(req)
                if not queue:
                    del self.pending[req.owner]
            self._end_repeat(req)
        # else it is running: repeat_ran ends it

    def _end_repeat(self, req: PassRequest) -> None:
        r = req.repeat
        kept = r.runs if r.keep is None else min(max(r.keep, r.first), r.runs)
        if kept < r.runs:                 # as if the runs after `kept` had never happened
            try:
                for seq, length in r.lengths[kept - r.first].items():
                    self.copies.extend(self.kv.cut(seq, length))
            except KVStoreError as e:     # the sequence was freed meanwhile
                self._unpin(r.lengths)
                req.future.set_exception(e)
                return
            self.channels.restore(r.channels[kept - r.first])
        self._unpin(r.lengths)
        req.future.set_result(kept)

    def _unpin(self, lengths: list[dict[int, int]]) -> None:
        """A run-ahead no longer cuts back to these lengths (`KVStore.pin`)."""
        for before in lengths:
            for seq, length in before.items():
                self.kv.unpin(seq, length)


def _round_robin(queues: list[deque[PassRequest]], per_queue: int) -> Iterator[PassRequest]:
    """The passes of `queues`, taken off them one of each in turn, at most `per_queue` of each."""
    for _ in range(per_queue):
        taken = False
        for queue in queues:
            if queue:
                taken = True
                yield queue.popleft()
        if not taken:
            return
