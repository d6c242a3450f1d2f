import random

import pytest

from pie_actors.kvstore import Evicted, InvalidSlot, KVStore, KVStoreError, OutOfPages, UnknownSequence

PS = 16


def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def pages_of(slots: list[int], ps: int = PS) -> set[int]:
    return {slot // ps for slot in slots}


def filled(store: KVStore, tokens: list[int], fold: bool = True) -> int:
    """A sequence holding ``tokens``, committed (and folded over all of them if ``fold``)."""
    seq = store.create()
    store.append(seq, tokens)
    store.commit(seq, len(tokens) if fold else None)
    return seq


def test_append_commit_free_round_trip():
    store = KVStore(num_pages=8, page_size=PS)
    seq = store.create()
    plan = store.append(seq, toks(20))
    assert (plan.reused, plan.start, len(plan.slots)) == (0, 0, 20)
    assert plan.slots == store.global_slots(seq, 0, 20)
    pages = store.kv_pages(seq)
    assert len(pages) == 2 and plan.slots[0] == pages[0] * PS and plan.slots[19] == pages[1] * PS + 3
    assert (store.length(seq), store.folded(seq)) == (20, 0)

    plan = store.append(seq, toks(5, 2000))
    assert plan.start == 20 and plan.slots == [pages[1] * PS + i for i in range(4, 9)]
    store.commit(seq, 25)
    assert (store.length(seq), store.folded(seq), store.cached_tokens(seq)) == (25, 25, 0)
    assert store.stats() == {"total": 8, "free": 6, "referenced": 2, "cached": 0}
    store.check_page(pages[0])
    store.check()

    store.free(seq)
    # Page 0 was full and frozen, so it was indexed and is now cached; the tail page is free.
    assert store.stats() == {"total": 8, "free": 7, "referenced": 0, "cached": 1}
    with pytest.raises(KVStoreError, match="free"):
        store.check_page(pages[1])
    with pytest.raises(KVStoreError, match="out of range"):
        store.check_page(8)
    store.check()


def test_with_the_prefix_cache_off_every_prompt_is_computed():
    store = KVStore(num_pages=64, page_size=PS, prefix_cache=False)
    a = filled(store, toks(200))
    plan = store.append(store.create(), toks(200))
    assert plan.reused == 0 and plan.start == 0 and len(plan.slots) == 200
    store.free(a)
    assert store.append(store.create(), toks(200)).reused == 0
    store.check()


def test_prefix_sharing_between_live_sequences():
    store = KVStore(num_pages=64, page_size=PS)
    a = filled(store, toks(200))
    assert store.stats()["referenced"] == 13

    b = store.create()
    plan = store.append(b, toks(200) + toks(10, 5000))
    assert plan.reused == 192 and plan.start == 192 and len(plan.slots) == 18
    assert store.cached_tokens(b) == 192 and store.folded(b) == 192 and store.length(b) == 210
    assert store.kv_pages(b)[:12] == store.kv_pages(a)[:12]
    assert pages_of(plan.slots).isdisjoint(store.kv_pages(a))
    assert plan.slots == store.global_slots(b, 192, 210)
    # 13 pages of A plus only B's 2 new pages: the 12 shared ones are counted once.
    assert store.stats() == {"total": 64, "free": 49, "referenced": 15, "cached": 0}
    assert all(store._pool.refcount[p] == 2 for p in store.kv_pages(a)[:12])
    store.check()

    store.free(a)
    assert store.stats()["referenced"] == 14  # A's private tail page went back; shared pages stay
    store.free(b)
    store.check()


def test_reuse_across_requests_after_free():
    store = KVStore(num_pages=32, page_size=PS)
    a = filled(store, toks(200))
    a_pages = store.kv_pages(a)
    store.free(a)
    assert store.stats() == {"total": 32, "free": 20, "referenced": 0, "cached": 12}

    c = store.create()
    plan = store.append(c, toks(200))
    assert plan.reused == 192 and store.kv_pages(c)[:12] == a_pages[:12]
    assert store.stats() == {"total": 32, "free": 19, "referenced": 13, "cached": 0}
    store.check()

    # A different prompt shares nothing.
    d = store.create()
    assert store.append(d, toks(200, 7000)).reused == 0
    store.check()


def test_never_reuses_every_token():
    store = KVStore(num_pages=64, page_size=PS)
    filled(store, toks(192))
    b = store.create()
    plan = store.append(b, toks(192))
    assert plan.reused == 176 and plan.start == 176 and len(plan.slots) == 16
    c = store.create()
    assert store.append(c, toks(193)).reused == 192
    e = store.create()
    assert store.append(e, toks(16)).reused == 0
    store.check()


def test_reuse_only_from_a_frozen_page_boundary():
    store = KVStore(num_pages=64, page_size=PS)
    filled(store, toks(64))
    b = filled(store, toks(32), fold=True)
    assert store.append(b, toks(32, 1032)).reused == 16  # continues the chain from B's 2nd page
    c = filled(store, toks(16))
    store.append(c, toks(16, 1016))  # written but not frozen: the chain stops at slot 16
    assert store.append(c, toks(33, 1016)).reused == 0
    d = store.create()
    assert store.append(d, toks(64), reuse_prefix=False).reused == 0
    store.check()


def test_fork_shares_full_frozen_pages_and_copies_tail():
    store = KVStore(num_pages=16, page_size=PS)
    parent = store.create()
    store.append(parent, toks(50))
    store.commit(parent, 40)
    child, copies = store.fork(parent)
    pp, cp = store.kv_pages(parent), store.kv_pages(child)
    assert cp[:2] == pp[:2] and cp[2] not in pp
    assert copies == [(pp[2], cp[2])]
    assert (store.length(child), store.folded(child), store.cached_tokens(child)) == (40, 40, 0)
    assert [store._pool.refcount[p] for p in pp] == [2, 2, 1, 1]
    store.check()

    # Both sides write after the frozen prefix into their own pages.
    assert store.append(child, [1]).slots == [cp[2] * PS + 8]
    assert store.append(parent, [1]).slots == [pp[3] * PS + 2]
    # The child continues the parent's hash chain: its 3rd page gets the key a fresh sequence
    # with the same 48 tokens would compute.
    store.truncate(child, 40)
    store.append(child, toks(8, 1040))
    store.commit(child, 48)
    fresh = store.create()
    assert store.append(fresh, toks(49)).reused == 48
    assert store.kv_pages(fresh)[:3] == store.kv_pages(child)
    store.check()

    empty, copies = store.fork(store.create())
    assert copies == [] and store.kv_pages(empty) == [] and store.length(empty) == 0
    store.check()


def test_frozen_and_out_of_range_slots_raise():
    store = KVStore(num_pages=8, page_size=PS)
    seq = filled(store, toks(20))
    before = (store.stats(), store.length(seq), store.folded(seq))
    with pytest.raises(InvalidSlot, match="slot 19 is frozen"):
        store.slots_for(seq, [19], [1], canonical=True)
    with pytest.raises(InvalidSlot, match="slot 32 is beyond"):
        store.slots_for(seq, [20, 32], [1, 2], canonical=True)
    with pytest.raises(InvalidSlot, match="2 slots for 1 tokens"):
        store.slots_for(seq, [20, 21], [1], canonical=True)
    with pytest.raises(InvalidSlot, match="truncate to 10"):
        store.truncate(seq, 10)
    with pytest.raises(InvalidSlot, match="fold to 21"):
        store.commit(seq, 21)
    store.commit(seq, 5)  # folded only grows
    with pytest.raises(InvalidSlot, match="outside"):
        store.kv_pages(seq, 33)
    with pytest.raises(InvalidSlot, match="outside"):
        store.global_slots(seq, 30, 40)
    assert (store.stats(), store.length(seq), store.folded(seq)) == before
    store.check()


def test_explicit_geometry_reserve_and_slots_for():
    store = KVStore(num_pages=8, page_size=PS)
    seq = store.create()
    store.reserve(seq, 40)
    pages = store.kv_pages(seq, 40)
    assert len(pages) == 3 and store.length(seq) == 0
    slots = store.slots_for(seq, [0, 1, 33], [7, 8, 9], canonical=True)
    assert slots == [pages[0] * PS, pages[0] * PS + 1, pages[2] * PS + 1]
    assert store.length(seq) == 34
    assert store.kv_pages(seq) == pages
    assert store.kv_pages(seq, 16) == pages[:1] and store.kv_pages(seq, 17) == pages[:2]
    # Uncommitted rows can be overwritten; the engine folds over the gap, so the gap's page cannot be shared.
    store.slots_for(seq, [1], [10], canonical=True)
    store.commit(seq, 20)
    other = store.create()
    assert store.append(other, [7, 10] + [0] * 20).reused == 0
    store.check()


def test_rollback_undoes_an_append_with_reused_prefix_pages():
    store = KVStore(num_pages=32, page_size=PS)
    a = filled(store, toks(64))
    b = filled(store, toks(16, 3000))           # b: one frozen page, then appends the next 48 tokens
    before = store.stats()
    mark = store.mark(b)
    c = store.create()
    mark_c = store.mark(c)
    plan = store.append(c, toks(64) + [7])
    assert plan.reused == 64 and store.folded(c) == 64
    store.append(b, toks(48, 4000))
    store.rollback(mark)
    store.rollback(mark_c)
    assert (store.length(c), store.folded(c), store.cached_tokens(c)) == (0, 0, 0)
    assert (store.length(b), store.folded(b)) == (16, 16)
    assert store.stats() == before              # reused pages handed back to a, nothing leaked
    store.check()
    # after the rollback the same append reuses the prefix again
    assert store.append(c, toks(64) + [7]).reused == 64
    for seq in (a, b, c):
        store.free(seq)
    store.check()


def test_truncate_releases_pages():
    store = KVStore(num_pages=8, page_size=PS)
    seq = store.create()
    store.append(seq, toks(40))
    store.commit(seq, 10)
    assert store.stats()["free"] == 5
    store.truncate(seq, 16)
    assert store.length(seq) == 16 and len(store.kv_pages(seq)) == 1 and store.stats()["free"] == 7
    store.truncate(seq, 10)
    assert store.length(seq) == 10 and store.stats()["free"] == 7
    store.reserve(seq, 64)
    assert store.stats()["free"] == 4
    store.truncate(seq, 10)  # reserved pages past the length are released too
    assert store.stats()["free"] == 7 and store.length(seq) == 10
    assert store.append(seq, toks(3)).start == 10
    store.check()


def test_lru_eviction_order():
    ps = 4
    store = KVStore(num_pages=3, page_size=ps)
    x, y, z = toks(4, 100), toks(4, 200), toks(4, 300)
    page = {}
    for name, tokens in (("x", x), ("y", y), ("z", z)):
        seq = filled(store, tokens)
        page[name] = store.kv_pages(seq)[0]
        store.free(seq)
    assert store.stats() == {"total": 3, "free": 0, "referenced": 0, "cached": 3}

    # Reviving y takes it off the LRU; its tail page evicts the oldest cached page, x.
    user = store.create()
    plan = store.append(user, y + [1])
    assert plan.reused == 4 and plan.slots == [page["x"] * ps]
    store.free(user)  # y is cached again, now the most recent; x's page is free
    assert store.stats() == {"total": 3, "free": 1, "referenced": 0, "cached": 2}

    # Two fresh pages: the free one, then the least recently released cached page, z.
    other = store.create()
    store.append(other, toks(8, 900))
    assert store.kv_pages(other) == [page["x"], page["z"]]
    store.free(other)

    def reusable(tokens: list[int]) -> int:
        probe = store.create()
        reused = store.append(probe, tokens + [1]).reused
        store.free(probe)
        return reused

    assert (reusable(x), reusable(z), reusable(y)) == (0, 0, 4)
    store.check()


def test_free_releases_tail_first_so_roots_survive_eviction():
    ps = 4
    store = KVStore(num_pages=4, page_size=ps)
    store.free(filled(store, toks(12)))  # 3 pages cached, 1 free
    hog = store.create()
    store.append(hog, toks(8, 500))  # the free page, then one eviction: the deepest page
    store.free(hog)  # never committed, so its pages go back to free
    assert store.stats() == {"total": 4, "free": 2, "referenced": 0, "cached": 2}
    probe = store.create()
    assert store.append(probe, toks(12) + [1]).reused == 8
    store.check()


def test_out_of_pages_changes_nothing():
    store = KVStore(num_pages=4, page_size=PS)
    a = store.create()
    store.append(a, toks(40))
    before = store.stats()
    b = store.create()
    with pytest.raises(OutOfPages):
        store.append(b, toks(20))
    with pytest.raises(OutOfPages):
        store.reserve(b, 40)
    assert store.stats() == before and store.length(b) == 0 and store.kv_pages(b) == []
    store.check()
    # Other sequences stay usable, and so does b within what is left.
    assert store.append(a, toks(8)).start == 40
    store.commit(a, 47)
    assert len(store.append(b, toks(16)).slots) == 16
    with pytest.raises(OutOfPages):
        store.fork(a)  # copying the tail page needs a page
    assert store.stats() == {"total": 4, "free": 0, "referenced": 4, "cached": 0}
    assert [store._pool.refcount[p] for p in store.kv_pages(a)] == [1, 1, 1]
    store.check()


def test_out_of_pages_does_not_count_revived_pages_as_evictable():
    ps = 4
    store = KVStore(num_pages=3, page_size=ps)
    store.free(filled(store, toks(8)))
    assert store.stats() == {"total": 3, "free": 1, "referenced": 0, "cached": 2}
    b = store.create()
    # Reusing 8 tokens needs 2 more pages; the 2 cached ones are the ones being revived.
    with pytest.raises(OutOfPages):
        store.append(b, toks(8) + toks(8, 50))
    assert store.stats() == {"total": 3, "free": 1, "referenced": 0, "cached": 2}
    assert store.length(b) == 0 and store.cached_tokens(b) == 0
    assert store.append(b, toks(8) + toks(4, 50)).reused == 8
    store.check()


def test_unknown_sequence_names_the_id():
    store = KVStore(num_pages=4, page_size=PS)
    seq = store.create()
    store.free(seq)
    calls = [
        lambda s: store.free(s),
        lambda s: store.fork(s),
        lambda s: store.append(s, [1]),
        lambda s: store.reserve(s, 1),
        lambda s: store.slots_for(s, [0], [1], canonical=True),
        lambda s: store.commit(s, None),
        lambda s: store.truncate(s, 0),
        lambda s: store.kv_pages(s),
        lambda s: store.global_slots(s, 0, 0),
        lambda s: store.length(s),
        lambda s: store.folded(s),
        lambda s: store.cached_tokens(s),
    ]
    for call in calls:
        for bad in (seq, 4242):
            with pytest.raises(UnknownSequence, match=rf"\b{bad}\b"):
                call(bad)
    store.check()


def test_non_canonical_sequences_are_not_indexed():
    store = KVStore(num_pages=32, page_size=PS)
    a = store.create()
    store.append(a, toks(48), canonical=False)
    store.commit(a, 48)
    b = store.create()
    assert store.append(b, toks(49)).reused == 0
    store.free(a)
    assert store.stats()["cached"] == 0  # nothing was indexed, so everything went back to free

    # Pages frozen while canonical stay shared; those frozen after a non-canonical write do not.
    c = filled(store, toks(16, 3000))
    store.append(c, toks(16, 3016))
    store.slots_for(c, [20], [3020], canonical=False)
    store.commit(c, 32)
    d = store.create()
    assert store.append(d, toks(33, 3000)).reused == 16
    # A non-canonical append does not reuse either.
    e = store.create()
    assert store.append(e, toks(33, 3000), canonical=False).reused == 0
    store.check()


def test_check_detects_corruption():
    store = KVStore(num_pages=8, page_size=PS)
    seq = filled(store, toks(20))
    page = store.kv_pages(seq)[0]
    store.check()
    store._pool.refcount[page] += 1
    with pytest.raises(AssertionError, match=f"page {page}: refcount 2 but 1"):
        store.check()
    store._pool.refcount[page] -= 1
    store._pool.free.append(page)
    with pytest.raises(AssertionError, match="exactly one state"):
        store.check()
    store._pool.free.pop()
    # A writable page in two page tables (refcounts kept consistent): a write would corrupt the other.
    other = store.create()
    tail = store.kv_pages(seq)[1]
    store._seqs[other].pages.append(tail)
    store._pool.refcount[tail] += 1
    with pytest.raises(AssertionError, match=f"writable page {tail} is shared"):
        store.check()
    store._seqs[other].pages.pop()
    store._pool.refcount[tail] -= 1
    store.check()
    store._pool.key_of.pop(page)
    with pytest.raises(AssertionError, match="index"):
        store.check()


def test_randomized_operations_keep_accounting_and_contents():
    """Random ops against a simulated device: every slot a sequence can read must hold its token."""
    rng = random.Random(1234)
    ps = 4
    store = KVStore(num_pages=16, page_size=ps)
    device: dict[int, int] = {}  # global slot -> token written there
    shadow: dict[int, list[int | None]] = {}  # sequence -> expected token per local slot
    prompts = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]  # shared system prompts

    def write(slots, tokens):
        for slot, token in zip(slots, tokens):
            device[slot] = token

    def append(seq, tokens, **kw):
        plan = store.append(seq, tokens, **kw)
        assert plan.start == len(shadow[seq]) + plan.reused and plan.reused % ps == 0
        write(plan.slots, tokens[plan.reused :])
        shadow[seq] += tokens

    for _ in range(500):
        seqs = list(shadow)
        op = rng.choice(["request", "append", "commit", "free", "free", "fork", "truncate", "explicit"])
        seq = rng.choice(seqs) if seqs else None
        before = store.stats()
        try:
            if op == "request" or seq is None:
                # A new request: a shared prompt plus its own suffix, prefilled and folded.
                seq = store.create()
                shadow[seq] = []
                suffix = [rng.randrange(100) for _ in range(rng.randint(0, 5))]
                append(seq, rng.choice(prompts)[: rng.randint(4, 12)] + suffix)
                store.commit(seq, store.length(seq))
            elif op == "append":
                tokens = [rng.randrange(100) for _ in range(rng.randint(0, 10))]
                append(seq, tokens, reuse_prefix=rng.random() < 0.8, canonical=rng.random() < 0.9)
            elif op == "commit":
                fold_to = rng.randint(store.folded(seq), store.length(seq)) if rng.random() < 0.8 else None
                store.commit(seq, fold_to)
            elif op == "free":
                store.free(seq)
                del shadow[seq]
            elif op == "fork":
                child, copies = store.fork(seq)
                for src, dst in copies:
                    for i in range(ps):
                        if src * ps + i in device:
                            device[dst * ps + i] = device[src * ps + i]
                shadow[child] = shadow[seq][: store.folded(seq)]
            elif op == "truncate":
                length = rng.randint(store.folded(seq), store.length(seq))
                store.truncate(seq, length)
                del shadow[seq][length:]
            else:
                end = store.length(seq) + rng.randint(0, 6)
                store.reserve(seq, end)
                writable = range(store.folded(seq), end)
                local = rng.sample(writable, min(len(writable), rng.randint(0, 3)))
                tokens = [rng.randrange(100) for _ in local]
                write(store.slots_for(seq, local, tokens, canonical=rng.random() < 0.7), tokens)
                rows = shadow[seq]
                rows += [None] * (max(local, default=-1) + 1 - len(rows))
                for slot, token in zip(local, tokens):
                    rows[slot] = token
        except OutOfPages:
            assert store.stats() == before
        store.check()
        for s, rows in shadow.items():
            assert store.length(s) == len(rows)
            slots = store.global_slots(s, 0, len(rows))
            wrong = [i for i, (g, t) in enumerate(zip(slots, rows)) if t is not None and device.get(g) != t]
            assert not wrong, f"sequence {s} reads wrong KV at local slots {wrong}"

    for s in list(shadow):
        store.free(s)
    store.check()
    assert store.stats()["referenced"] == 0


def test_cut_shortens_frozen_rows_and_copies_a_shared_tail_page():
    store = KVStore(num_pages=8, page_size=PS)
    a = filled(store, toks(40))                       # pages: full, full (indexed), 8 slots
    b = store.fork(a)[0]                              # shares a's two full pages
    assert store.cut(a, 40) == []                     # nothing to do
    copies = store.cut(a, 20)                         # into the second page, which b and the index hold
    assert len(copies) == 1 and copies[0][0] == store.kv_pages(b)[1]
    assert (store.length(a), store.folded(a)) == (20, 20)
    assert store.kv_pages(a)[1] == copies[0][1] != store.kv_pages(b)[1]
    store.append(a, toks(4, base=7))                  # writes into a's own copy
    store.commit(a, 24)
    assert store.cut(a, 16) == []                     # a page boundary: nothing to copy
    store.check()
    with pytest.raises(InvalidSlot):
        store.cut(a, 17)
    store.free(a)
    store.free(b)
    store.check()
    assert store.stats()["referenced"] == 0


def test_evicted_sequences_keep_their_id_and_come_back_as_they_were():
    store = KVStore(num_pages=6, page_size=PS)
    seq = filled(store, toks(40))                       # 3 pages, 2 of them full and indexed
    keys = store.mark(seq).keys
    released = store.evict(seq)
    assert len(released) == 3 and store.stats() == {"total": 6, "free": 4, "referenced": 0, "cached": 2}
    with pytest.raises(Evicted, match=f"sequence {seq} is out of the page pool"):
        store.append(seq, toks(1))
    store.check()

    pages = store.reload(seq)                           # new pages: the caller writes their rows
    assert len(pages) == 3 and store.kv_pages(seq) == pages
    assert (store.length(seq), store.folded(seq), store.mark(seq).keys) == (40, 40, keys)
    assert store.cached_prefix(toks(40)) == 32          # its full pages are indexed again
    store.check()

    store.evict(seq)
    assert store.reset(seq) == toks(40)                 # back empty: its history to prefill
    assert (store.length(seq), store.kv_pages(seq)) == (0, [])
    store.free(seq)
    evicted = filled(store, toks(20))
    store.evict(evicted)
    store.free(evicted)                                 # an evicted sequence is forgotten
    with pytest.raises(UnknownSequence):
        store.reload(evicted)
    store.check()


def test_replayable_only_when_a_prefill_of_the_history_recomputes_everything():
    store = KVStore(num_pages=8, page_size=PS)
    assert store.replayable(filled(store, toks(20)))
    assert not store.replayable(filled(store, toks(20), fold=False))     # rows not frozen
    reserved = filled(store, toks(20))
    store.reserve(reserved, 64)
    assert not store.replayable(reserved)                                # pages past its rows
    explicit = store.create()
    store.reserve(explicit, 16)
    store.slots_for(explicit, [0, 1], [5, 6], canonical=False)
    store.commit(explicit, 2)
    assert not store.replayable(explicit)                                # explicit geometry
