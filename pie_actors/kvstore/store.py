"""Paged KV bookkeeping: which pages and slots each sequence (working set) uses.

The engine owns the KV tensors; this module only hands out slots. A sequence's local slot ``i``
lives at global slot ``pages[i // page_size] * page_size + i % page_size``. Slots below ``folded``
are frozen and never written again, which is what makes sharing them safe: full frozen pages are
shared by fork and, for canonical sequences (position == slot, causal mask), across requests
through the prefix index. A page that anyone may still write always has exactly one reference.

A sequence can give its pages back to the pool and keep the rest (`evict`): its tokens, frozen
extent and chain keys stay, under its id, until it comes back with as many pages, whose KV the
caller writes (`reload`: rows kept in host memory), or empty, to be prefilled again (`reset`).
Saved working sets and the working sets of parked programs leave the pool this way when it runs
short (gpu/engine/saved.py).

A model with recurrent layers (linear attention) also keeps a fixed-size state per sequence: a store
made with `num_states` gives each sequence one, whose slots, checkpoints and prefix snapshots
recurrent.py keeps.
"""

import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from .pool import Evicted, InvalidSlot, KVStoreError, OutOfPages, PagePool, QuotaExceeded, UnknownSequence
from .prefix import ROOT, chain_key
from .recurrent import RecurrentStates
from .states import StatePass


@dataclass
class AppendPlan:
    reused: int  # tokens taken from the prefix cache (not to be computed)
    slots: list[int]  # global slot ids for the remaining tokens, in order
    start: int  # sequence index (== position) of the first remaining token


class Mark(NamedTuple):        # a tuple: one is taken per lane per batch, on the hot path
    seq: int
    length: int
    folded: int
    cached_tokens: int
    keys: int


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)  # per written slot; None = a gap never written
    folded: int = 0
    cached_tokens: int = 0
    canonical: bool = True
    keys: list[int] = field(default_factory=list)  # chain key of each leading full frozen page
    root: int = ROOT  # its partition's root: the parent key of its first page (prefix.py)
    counted: bool = True  # its pages count against its partition's bound (saved sets' do not)
    state: int | None = None  # its recurrent state's slot (None: no rows yet, the zero state)
    checkpoints: dict[int, int | None] = field(default_factory=dict)  # length -> state slot there
    pins: Counter[int] = field(default_factory=Counter)  # lengths a run-ahead may cut back to
    pending: StatePass | None = None  # the states a pass in flight writes

    @property
    def length(self) -> int:
        return len(self.tokens)


class KVStore:
    def __init__(self, num_pages: int, page_size: int = 16, prefix_cache: bool = True,
                 num_states: int = 0, state_pages: int = 1) -> None:
        """`num_states`: recurrent-state slots, for a model with recurrent layers (0: none);
        `state_pages`: what one of them counts against a partition's bound, in KV pages (the engine
        gives their size ratio, gpu/engine/worker.py `state_pages`)."""
        if num_pages <= 0 or page_size <= 0 or state_pages <= 0:
            raise ValueError(f"num_pages, page_size and state_pages must be positive, "
                             f"got {num_pages}, {page_size}, {state_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache     # off: appends never attach indexed pages (for comparisons)
        self._pool = PagePool(num_pages)
        self._seqs: dict[int, _Seq] = {}
        self._evicted: dict[int, tuple[_Seq, int]] = {}   # evicted sequence -> (it, pages it held)
        self._ids = itertools.count()
        # Called with the number of pages an allocation lacks, before it fails: the engine evicts
        # saved working sets and those of parked programs to make room (gpu/engine/saved.py).
        self.reclaim: Callable[[int], None] | None = None
        self._bounds: dict[int, int] = {}  # partition root -> pages its counted sequences may hold
        self.state_pages = state_pages
        self._states = RecurrentStates(num_states, page_size) if num_states else None

    @property
    def keeps_state(self) -> bool:
        """Whether each sequence keeps a recurrent state (the model has recurrent layers)."""
        return self._states is not None

    @property
    def state_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) state-slot copies queued for the engine to run before its next batch."""
        return self._states.copies if self._states is not None else []

    # -- sequences ------------------------------------------------------------------------------

    def create(self, root: int = ROOT) -> int:
        """A new empty sequence id, in the prefix partition whose root key is ``root``."""
        seq = next(self._ids)
        self._seqs[seq] = _Seq(root=root)
        return seq

    def free(self, seq: int) -> None:
        """Release all its pages; indexed ones become cached, the rest free. An evicted sequence
        holds none: it is forgotten."""
        evicted = self._evicted.pop(seq, None)
        s = evicted[0] if evicted is not None else self._get(seq)
        if self._states is not None:
            self._states.release(s)
        if evicted is not None:
            return
        del self._seqs[seq]
        # Tail first, so LRU eviction takes a chain's deepest pages before its root: once the
        # root is gone, nothing below it can be found again.
        for page in reversed(s.pages):
            self._pool.decref(page)

    def fork(self, seq: int, *, counted: bool = True) -> tuple[int, list[tuple[int, int]]]:
        """Child shares the parent's frozen prefix: full frozen pages are shared (incref), the
        partially filled frozen tail page (if folded % page_size != 0) is copied into a new page.
        Returns (child_id, [(src_page, dst_page)]): the engine copies those KV pages on the device
        before its next batch. Child length == folded == the parent's folded; the parent's
        uncommitted slots are not inherited. The child starts with cached_tokens 0: its prefix
        came from the parent, not from the prefix cache. ``counted=False``: the child is a saved
        working set, whose pages its partition's bound (`limit`) leaves out."""
        s = self._get(seq)
        full, tail = divmod(s.folded, self.page_size)
        shared = s.pages[:full]
        source = self._states.state_at(seq, s, s.folded) if self._states is not None else None
        if counted:     # a saved set's pages are new to it
            self._check_bound(seq, s.root, 1 if tail else 0, shared, states=int(source is not None))
        state = self._states.allocate() if source is not None else None
        try:
            copy = self._allocate(1 if tail else 0)  # before any incref: OutOfPages changes nothing
        except OutOfPages:
            if state is not None:
                self._states.pool.release(state)
            raise
        if state is not None:
            self._states.copies.append((source, state))
        for page in shared:
            self._pool.incref(page)
        child = next(self._ids)
        self._seqs[child] = _Seq(
            pages=shared + copy,
            tokens=s.tokens[: s.folded],
            folded=s.folded,
            canonical=s.canonical,
            keys=list(s.keys),
            root=s.root,
            counted=counted,
            state=state,
        )
        return child, [(s.pages[full], copy[0])] if tail else []

    # -- writes ---------------------------------------------------------------------------------

    def append(
        self, seq: int, tokens: list[int], *, reuse_prefix: bool = True, canonical: bool = True
    ) -> AppendPlan:
        """Append len(tokens) rows at positions length..length+n-1.

        With reuse_prefix on a canonical sequence that is fully frozen at a page boundary, leading
        full pages of ``tokens`` found in the prefix index are attached instead of computed (always
        leaving at least one token to compute); they count into cached_tokens and are frozen at
        once. Pages for the rest are allocated. All or nothing on OutOfPages."""
        s = self._get(seq)
        ps = self.page_size
        # only a run of more than a page can hit a whole page and still leave a row to compute
        hits = self._prefix_hits(s, tokens) if reuse_prefix and canonical and len(tokens) > ps else []
        start = s.length
        end = start + len(tokens)
        need = max(0, -(-end // ps) - len(s.pages) - len(hits))
        if need or hits:
            if s.counted:     # a hit reads a copy of its snapshot: a state of its own
                self._check_bound(seq, s.root, need, [page for page, _ in hits],
                                  states=int(bool(hits) and self._states is not None))
            # Revived pages leave the eviction queue, so they cannot also be evicted to pay for `need`.
            available = self._pool.available() - sum(self._pool.is_cached(page) for page, _ in hits)
            if need > available and self.reclaim is not None:
                self.reclaim(need - available)
                available = self._pool.available() - sum(self._pool.is_cached(page) for page, _ in hits)
            if need > available:
                raise OutOfPages(f"sequence {seq}: need {need} new pages, {available} available")
            src = self._states.copy_snapshot(hits[-1][1]) if hits and self._states is not None else None
            for page, key in hits:
                self._pool.incref(page)
                s.pages.append(page)
                s.keys.append(key)
            s.pages += self._pool.allocate(need)
            if src is not None:
                s.pending = StatePass(None, {}, src=src)
        reused = len(hits) * ps
        start += reused
        s.tokens += tokens
        s.folded += reused
        s.cached_tokens += reused
        s.canonical = s.canonical and canonical
        pages = s.pages
        return AppendPlan(reused, [pages[i // ps] * ps + i % ps for i in range(start, end)], start)

    def _prefix_hits(self, s: _Seq, tokens: list[int]) -> list[tuple[int, int]]:
        """(page, key) of indexed pages matching the leading full pages of ``tokens`` after ``s``."""
        ps = self.page_size
        # Reuse needs the chain key of s's last page (canonical and fully frozen) and a page
        # boundary with no reserved pages past it, where the attached pages go.
        if not (self.prefix_cache and s.canonical and s.folded == s.length == len(s.pages) * ps):
            return []
        parent = s.keys[-1] if s.keys else s.root
        hits = []
        # At least one token stays to compute: the caller needs the logits of the last row.
        for i in range((len(tokens) - 1) // ps):
            key = chain_key(parent, tokens[i * ps : (i + 1) * ps])
            page = self._pool.lookup(key)
            if page is None:
                break
            hits.append((page, key))
            parent = key
        if self._states is not None:      # the state after the reused pages must be known too
            while hits and hits[-1][1] not in self._states.snapshots:
                hits.pop()
        return hits

    def reserve(self, seq: int, end: int) -> None:
        """Ensure pages exist for slots [0, end), for explicit geometry writes. Length is unchanged."""
        s = self._get(seq)
        need = max(0, self._pages_for(end) - len(s.pages))
        if s.counted:
            self._check_bound(seq, s.root, need)
        s.pages += self._allocate(need)

    def slots_for(
        self, seq: int, local_slots: list[int], tokens: list[int], *, canonical: bool
    ) -> list[int]:
        """Explicit geometry: global slots for writing ``tokens`` at ``local_slots``.

        Each slot must be >= folded and below the reserved capacity; slots below length overwrite
        uncommitted rows. Length grows to max(slot) + 1 (unwritten slots in between are gaps).
        canonical=False marks the sequence non-canonical for good: none of its later pages is indexed."""
        s = self._get(seq)
        if len(local_slots) != len(tokens):
            raise InvalidSlot(f"sequence {seq}: {len(local_slots)} slots for {len(tokens)} tokens")
        if self._states is not None:
            self._states.rewind_for(seq, s, list(local_slots))
        capacity = len(s.pages) * self.page_size
        for slot in local_slots:
            if slot < s.folded:
                raise InvalidSlot(f"sequence {seq}: slot {slot} is frozen (folded={s.folded})")
            if slot >= capacity:
                raise InvalidSlot(
                    f"sequence {seq}: slot {slot} is beyond the reserved capacity {capacity}; reserve() first"
                )
        end = max(local_slots, default=-1) + 1
        s.tokens += [None] * (end - s.length)
        for slot, token in zip(local_slots, tokens):
            s.tokens[slot] = token
        s.canonical = s.canonical and canonical
        return self._global(s, local_slots)

    def commit(self, seq: int, fold_to: int | None) -> None:
        """Called after the engine wrote the KV. Freeze up to fold_to if given (folded only grows,
        so a smaller fold_to is a no-op), then index every full page that is now entirely frozen."""
        s = self._get(seq)
        if s.pending is not None:
            self._states.take_pass(s)
        if fold_to is not None:
            if fold_to > s.length:
                raise InvalidSlot(f"sequence {seq}: cannot fold to {fold_to}, only {s.length} slots written")
            s.folded = max(s.folded, fold_to)
        ps = self.page_size
        while s.canonical and len(s.keys) < s.folded // ps:
            i = len(s.keys)
            page_tokens = s.tokens[i * ps : (i + 1) * ps]
            if None in page_tokens:
                # A frozen gap holds garbage KV: this page can never be shared, and since every
                # later key chains through it, neither can any later page.
                s.canonical = False
                break
            key = chain_key(s.keys[-1] if s.keys else s.root, page_tokens)
            self._pool.register(s.pages[i], key)
            s.keys.append(key)
            if self._states is not None:
                self._states.snapshot(s, (i + 1) * ps, key)
        if self._states is not None:
            self._states.prune(s)

    def truncate(self, seq: int, length: int) -> None:
        """Roll back uncommitted rows to ``length`` (folded <= length <= current length). Pages
        past the new length are released, reserved ones included."""
        s = self._get(seq)
        if not s.folded <= length <= s.length:
            raise InvalidSlot(
                f"sequence {seq}: cannot truncate to {length}, must be in [folded={s.folded}, length={s.length}]"
            )
        if self._states is not None:
            self._states.restore(seq, s, length)
        self._drop(s, length)

    def _drop(self, s: _Seq, length: int) -> None:
        del s.tokens[length:]
        keep = self._pages_for(length)
        for page in reversed(s.pages[keep:]):
            self._pool.decref(page)
        del s.pages[keep:]

    def cut(self, seq: int, length: int) -> list[tuple[int, int]]:
        """Shorten a sequence to its first ``length`` slots, frozen ones included (a run-ahead that
        went past the tokens its program read). A partial tail page that others share or that the
        prefix index holds is replaced by a copy, since the sequence will write into it again:
        returns [(src_page, dst_page)] for the engine to copy before its next batch."""
        s = self._get(seq)
        if not 0 <= length <= s.length:
            raise InvalidSlot(f"sequence {seq}: cannot cut to {length}, it has {s.length} slots")
        if self._states is not None:
            self._states.state_at(seq, s, length)   # before any change: no checkpoint there, nothing done
        full, tail = divmod(length, self.page_size)
        copies = []
        if tail and (full < len(s.keys) or self._pool.refcount[s.pages[full]] > 1):
            (page,) = self._allocate(1)
            copies.append((s.pages[full], page))
            self._pool.decref(s.pages[full])
            s.pages[full] = page
        s.folded = min(s.folded, length)
        s.cached_tokens = min(s.cached_tokens, length)
        del s.keys[full:]
        if self._states is not None:
            self._states.restore(seq, s, length)
        self._drop(s, length)
        return copies

    # -- eviction -------------------------------------------------------------------------------

    def evict(self, seq: int) -> list[int]:
        """Give ``seq``'s pages back to the pool (indexed ones become cached, the rest free) and
        keep the rest of it aside: until `reload` or `reset` brings it back, every other method
        raises Evicted for it (`free` forgets it). Returns the pages it held, whose rows the
        caller has copied if it wanted them."""
        s = self._get(seq)
        del self._seqs[seq]
        self._evicted[seq] = (s, len(s.pages))
        pages, s.pages = s.pages, []
        for page in reversed(pages):
            self._pool.decref(page)
        return pages

    def reload(self, seq: int) -> list[int]:
        """An evicted sequence back as it was, in as many new pages as it held: returns them, for
        the caller to write its rows into before any pass reads them. Its full frozen pages are
        indexed again. All or nothing on OutOfPages (it stays evicted)."""
        s, n = self._evicted_seq(seq)
        if s.counted:
            self._check_bound(seq, s.root, n)
        s.pages = self._allocate(n)
        del self._evicted[seq]
        self._seqs[seq] = s
        for page, key in zip(s.pages, s.keys):
            self._pool.register(page, key)
        return s.pages

    def reset(self, seq: int) -> list[int]:
        """An evicted sequence back, empty, in its partition: returns its history, whose prefill
        recomputes it (it was `replayable` when evicted)."""
        s, _ = self._evicted_seq(seq)
        del self._evicted[seq]
        if self._states is not None:
            self._states.release(s)
        self._seqs[seq] = _Seq(root=s.root, counted=s.counted)
        return s.tokens[: s.folded]

    def replayable(self, seq: int) -> bool:
        """Whether a prefill of its history recomputes all of it: canonical, every written slot
        frozen, and no page reserved past them."""
        s = self._get(seq)
        return s.canonical and s.folded == s.length and len(s.pages) == self._pages_for(s.length)

    def _evicted_seq(self, seq: int) -> tuple[_Seq, int]:
        try:
            return self._evicted[seq]
        except KeyError:
            raise UnknownSequence(f"sequence {seq} is not evicted") from None

    def mark(self, seq: int) -> "Mark":
        """The sequence's extent now, for `rollback` if the pass being planned fails."""
        s = self._get(seq)
        return Mark(seq, s.length, s.folded, s.cached_tokens, len(s.keys))

    def rollback(self, mark: "Mark") -> None:
        """Undo every append and slot write since `mark`, prefix pages attached by append included
        (they were frozen at once, so `truncate` cannot remove them). Only valid before the next
        commit of the sequence, which is how the engine uses it: plan, fail, roll back."""
        s = self._get(mark.seq)
        if self._states is not None:
            self._states.abort_pass(s)
        s.folded, s.cached_tokens = mark.folded, mark.cached_tokens
        del s.keys[mark.keys:]
        if not s.folded <= mark.length <= s.length:
            raise InvalidSlot(f"sequence {mark.seq}: cannot roll back to {mark.length}")
        self._drop(s, mark.length)

    # -- recurrent state (recurrent.py) --------------------------------------------------------

    def advance_state(self, seq: int, start: int, keep: Iterable[int] = ()
                      ) -> tuple[int, int, list[tuple[int, int]]] | None:
        """For a pass writing rows [start, length) of ``seq`` (after `append` / `slots_for`): the
        slot its state is read from, a new slot for the state after its rows, and [(rows, slot)]
        for the states it keeps on the way, after `rows` of its rows, at the lengths `keep`; None
        when the store keeps no states. The new slots become the sequence's at `commit`;
        `rollback` releases them. All or nothing on OutOfStates."""
        if self._states is None:
            return None
        s, keep = self._get(seq), list(keep)
        if s.counted:
            self._check_bound(seq, s.root, 0, states=len(self._states.cuts(s, start, keep)) + 1)
        return self._states.advance(seq, s, start, keep)

    def pin(self, seq: int) -> None:
        """Keep the state at the sequence's length until `unpin`: a run-ahead may cut back to it."""
        if self._states is not None:
            self._states.pin(self._get(seq))

    def unpin(self, seq: int, length: int) -> None:
        if self._states is not None and seq in self._seqs:   # else freed or evicted meanwhile
            self._states.unpin(self._seqs[seq], length)

    def snapshot_lengths(self, seq: int, first: int, end: int) -> list[int]:
        """The page boundaries in (first, end) where a canonical pass writing rows [first, end) of
        ``seq`` keeps the recurrent state, for prefix reuse (none when nothing is reused)."""
        if self._states is None or not self.prefix_cache or not self._get(seq).canonical:
            return []
        return self._states.snapshot_lengths(first, end)

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) state-slot copies queued since the last call, for the next batch to run first."""
        if self._states is None:
            return []
        copies, self._states.copies = self._states.copies, []
        return copies

    def state_stats(self) -> dict[str, int]:
        """Recurrent-state slots: {"total", "free", "held" (by sequences), "snapshots" (for prefix
        reuse), "pages_each" (what one held slot counts against a bound)}; all 0 for a store that
        keeps none."""
        if self._states is None:
            return {"total": 0, "free": 0, "held": 0, "snapshots": 0, "pages_each": 0}
        return {**self._states.stats(), "pages_each": self.state_pages}

    # -- queries --------------------------------------------------------------------------------

    def kv_pages(self, seq: int, kv_len: int | None = None) -> list[int]:
        """Page ids covering slots [0, kv_len), kv_len defaulting to length."""
        s = self._get(seq)
        kv_len = s.length if kv_len is None else kv_len
        self._check_range(seq, s, 0, kv_len)
        return s.pages[: self._pages_for(kv_len)]

    def global_slots(self, seq: int, start: int, end: int) -> list[int]:
        """Global slot ids of local slots [start, end)."""
        s = self._get(seq)
        self._check_range(seq, s, start, end)
        return self._global(s, range(start, end))

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def folded(self, seq: int) -> int:
        return self._get(seq).folded

    def cached_tokens(self, seq: int) -> int:
        return self._get(seq).cached_tokens

    def root(self, seq: int) -> int:
        """The root key of its prefix partition."""
        return self._get(seq).root

    # -- bounds per partition -------------------------------------------------------------------

    def limit(self, root: int, pages: int) -> None:
        """Bound what the counted sequences of partition ``root`` hold together, in pages (0: no
        bound): their distinct KV pages, plus `state_pages` for each recurrent-state slot they hold
        (current states, checkpoints, a pass in flight's). An allocation that would pass it raises
        QuotaExceeded. Prefix snapshots, like cached pages, are no partition's."""
        if pages:
            self._bounds[root] = pages
        else:
            self._bounds.pop(root, None)

    def usage(self, root: int) -> dict[str, int]:
        """What partition ``root``'s counted sequences hold: {"pages" (distinct KV pages), "states"
        (distinct recurrent-state slots), "total" (both in pages: what its bound counts), "bound"
        (0: none)}."""
        pages, states = self._held(root)
        total = len(pages) + len(states) * self.state_pages
        return {"pages": len(pages), "states": len(states), "total": total, "bound": self._bounds.get(root, 0)}

    def _held(self, root: int) -> tuple[set[int], set[int]]:
        """The pages and the state slots the counted sequences of partition ``root`` hold (an
        evicted one holds no pages but keeps its states)."""
        mine = [s for s in self._seqs.values() if s.root == root and s.counted]
        pages = {p for s in mine for p in s.pages}
        if self._states is None:
            return pages, set()
        mine += [s for s, _ in self._evicted.values() if s.root == root and s.counted]
        return pages, {slot for s in mine for slot in self._states.slots_of(s)}

    def _check_bound(self, seq: int, root: int, allocate: int, attach: Iterable[int] = (),
                     states: int = 0) -> None:
        """Raise QuotaExceeded if ``allocate`` new pages, the pages ``attach`` and ``states`` new
        state slots take partition ``root`` past its bound."""
        bound = self._bounds.get(root)
        if bound is None or not (allocate or attach or states):
            return
        pages, slots = self._held(root)
        new = allocate + len(set(attach) - pages) + states * self.state_pages
        if len(pages) + len(slots) * self.state_pages + new > bound:
            holds = f"{len(pages)} KV pages"
            if self._states is not None:
                holds += f" and {len(slots)} recurrent states of {self.state_pages} pages each"
            raise QuotaExceeded(f"sequence {seq}: its owner's working sets hold {holds}; "
                                f"{new} more would pass their bound of {bound}")

    def history(self, seq: int) -> list[int]:
        """The tokens of the frozen prefix, which a prefill of them recomputes exactly. Only a
        canonical sequence (positions == slots, causal, no gaps) has one."""
        s = self._get(seq)
        tokens = s.tokens[: s.folded]
        if not s.canonical or None in tokens:
            raise InvalidSlot(f"sequence {seq} was written with explicit positions, slots or masks: "
                              "a prefill of its tokens would not recompute it")
        return tokens

    def available(self) -> int:
        """Pages an allocation may take now: free ones and evictable cached ones."""
        return self._pool.available()

    def cached_prefix(self, tokens: list[int], root: int = ROOT) -> int:
        """How many leading tokens of ``tokens`` (whole pages) the prefix index holds now, for a
        sequence of partition ``root`` starting from empty."""
        ps, parent, n = self.page_size, root, 0
        while n + ps <= len(tokens):
            parent = chain_key(parent, tokens[n : n + ps])
            if self._pool.lookup(parent) is None:
                break
            n += ps
        return n

    def check_page(self, page: int) -> None:
        """Raise KVStoreError if ``page`` is out of range or free."""
        if not 0 <= page < self.num_pages:
            raise KVStoreError(f"page {page} is out of range [0, {self.num_pages})")
        if self._pool.is_free(page):
            raise KVStoreError(f"page {page} is free")

    def stats(self) -> dict[str, int]:
        """Page counts: {"total", "free", "referenced", "cached"}."""
        return self._pool.stats()

    def check(self) -> None:
        """Raise AssertionError describing the first accounting inconsistency found."""
        self._pool.check(Counter(page for s in self._seqs.values() for page in s.pages))
        if self._states is not None:
            self._states.check(self._seqs, [s for s, _ in self._evicted.values()])
        if both := self._evicted.keys() & self._seqs.keys():
            raise AssertionError(f"sequences both live and evicted: {sorted(both)}")
        ps = self.page_size
        for seq, s in self._seqs.items():
            if not 0 <= s.folded <= s.length <= len(s.pages) * ps:
                raise AssertionError(
                    f"sequence {seq}: folded {s.folded}, length {s.length}, {len(s.pages)} pages"
                )
            if not 0 <= s.cached_tokens <= s.folded:
                raise AssertionError(f"sequence {seq}: cached_tokens {s.cached_tokens} > folded {s.folded}")
            keyed = len(s.keys)
            if keyed > s.folded // ps or (s.canonical and keyed != s.folded // ps):
                raise AssertionError(
                    f"sequence {seq}: {keyed} chain keys for {s.folded // ps} full frozen pages"
                )
            for page in s.pages[s.folded // ps :]:
                if self._pool.refcount[page] != 1:
                    raise AssertionError(f"sequence {seq}: writable page {page} is shared")

    # -- helpers --------------------------------------------------------------------------------

    def _get(self, seq: int) -> _Seq:
        try:
            return self._seqs[seq]
        except KeyError:
            if seq in self._evicted:
                raise Evicted(f"sequence {seq} is out of the page pool (evicted): it must come back "
                              "before it is used") from None
            raise UnknownSequence(f"unknown sequence {seq} (never created or already freed)") from None

    def _allocate(self, n: int) -> list[int]:
        if n > self._pool.available() and self.reclaim is not None:
            self.reclaim(n - self._pool.available())
        return self._pool.allocate(n)

    def _pages_for(self, slots: int) -> int:
        return -(-slots // self.page_size)

    def _global(self, s: _Seq, local_slots: Iterable[int]) -> list[int]:
        ps = self.page_size
        return [s.pages[i // ps] * ps + i % ps for i in local_slots]

    def _check_range(self, seq: int, s: _Seq, start: int, end: int) -> None:
        capacity = len(s.pages) * self.page_size
        if not 0 <= start <= end <= capacity:
            raise InvalidSlot(
                f"sequence {seq}: slots [{start}, {end}) outside the reserved capacity {capacity}"
            )
