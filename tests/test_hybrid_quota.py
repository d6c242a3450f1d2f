"""A hybrid model's recurrent state under the page bounds: each state slot a partition holds counts
as the KV pages its bytes fill, and the global pool of state slots, when a pass needs more than it
has, fails that pass alone.

A process whose bound fits its KV pages but not its state is refused with the error that names
both, while a neighbour decodes transformers' greedy tokens; a pass that needs more state slots
than there are fails alone and the working sets go on as if it never ran. Every test ends with
each page and state slot back.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pie_actors.gpu.engine.scheduler import Lane, PassRequest
from pie_actors.inferlet.engine_client import EngineClient, EngineError
from pie_actors.kvstore import KVStore, OutOfStates, QuotaExceeded, partition_root
from tests.engine_helpers import decode, hf_greedy, make_engine, save_tiny_model, serve

PROMPT = [(7 * i + 3) % 512 for i in range(20)]          # two pages of 16
OTHER = [(11 * i + 5) % 512 for i in range(20)]
L = len(PROMPT)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5", seed=3)


@pytest.fixture(scope="module")
def reference(folder):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _all_back(engine) -> None:
    with engine._lock:
        engine.kv.check()
        assert engine.kv.stats()["referenced"] == 0 and engine.kv.state_stats()["held"] == 0


def test_a_bound_counts_every_state_slot_its_partition_holds():
    """Pages plus two pages a state slot: the state a pass writes and its checkpoints, a fork's copy
    and a prefix hit's copy count; an evicted set's states still count; prefix snapshots do not."""
    kv = KVStore(64, page_size=4, num_states=16, state_pages=2)
    kv.limit(7, 9)
    seq = kv.create(7)
    kv.append(seq, list(range(9)))                                      # 3 pages
    kv.advance_state(seq, 0, kv.snapshot_lengths(seq, 0, 9))            # after it, and at 4 and 8
    assert kv.usage(7) == {"pages": 3, "states": 3, "total": 9, "bound": 9}
    kv.commit(seq, 9)                                                   # the two kept ones: snapshots
    assert kv.usage(7)["total"] == 5 and kv.state_stats()["snapshots"] == 2
    child, _ = kv.fork(seq)                                             # its tail page and state
    assert kv.usage(7) == {"pages": 4, "states": 2, "total": 8, "bound": 9}
    mark = kv.mark(child)
    kv.append(child, [5])
    with pytest.raises(QuotaExceeded, match="hold 4 KV pages and 2 recurrent states of 2 pages each; "
                                            "2 more would pass their bound of 9"):
        kv.advance_state(child, 9)
    kv.rollback(mark)
    assert kv.usage(7)["total"] == 8
    kv.free(child)
    hit = kv.create(7)
    mark = kv.mark(hit)
    assert kv.append(hit, list(range(9)) + [1]).reused == 8             # its copy of the snapshot at 8
    assert kv.usage(7) == {"pages": 4, "states": 2, "total": 8, "bound": 9}
    with pytest.raises(QuotaExceeded, match="hold 4 KV pages and 2 recurrent states"):
        kv.advance_state(hit, 8)
    kv.rollback(mark)                                                   # the failed pass's plan goes
    assert kv.usage(7)["total"] == 5
    kv.free(hit)
    other = kv.create(8)                                                # a partition without a bound
    kv.append(other, list(range(8)))
    kv.advance_state(other, 0, range(1, 8))                             # 2 pages and 8 states
    kv.commit(other, None)
    kv.evict(seq)
    assert kv.usage(7) == {"pages": 0, "states": 1, "total": 2, "bound": 9}
    kv.check()
    for s in (seq, other):
        kv.free(s)
    kv.check()
    assert kv.stats()["referenced"] == 0 and kv.state_stats()["held"] == 0


@pytest.fixture
def served(folder):
    yield from serve(folder)


def test_a_process_whose_bound_fits_its_pages_but_not_its_state_is_refused(served, reference):
    """Through the data plane, as an inferlet's engine connection: a bound of 3 holds the prompt's
    2 KV pages, not them and the states its pass writes (2 pages each on this model); the
    neighbour's bound of 8 holds both and it decodes transformers' greedy tokens meanwhile."""
    engine, server = served
    assert server.stats()["states"]["pages_each"] == 2     # 33 KiB of state over 32 KiB a page
    small = partition_root(server.secret, "small")

    async def main():
        async with await EngineClient.connect(*server.address, owner="small", kv_pages=3) as a, \
                   await EngineClient.connect(*server.address, owner="fits", kv_pages=8) as b:
            seq = await a.create()
            refused, tokens = await asyncio.gather(a.forward([{"seq": seq, "tokens": PROMPT}]),
                                                   decode(b, OTHER, 4), return_exceptions=True)
            with engine._lock:
                usage = engine.kv.usage(small)
            await a.free(seq)
            return refused, tokens, usage

    refused, tokens, usage = asyncio.run(main())
    assert isinstance(refused, EngineError) and refused.type == "QuotaExceeded", refused
    assert "hold 2 KV pages and 0 recurrent states of 2 pages each; 4 more would pass their bound of 3" \
        in refused.message, refused.message
    assert usage == {"pages": 0, "states": 0, "total": 0, "bound": 3}    # the failed pass left nothing
    assert tokens == hf_greedy(reference, OTHER, 4)[0]
    assert server.stats()["states"]["held"] == 0
    _all_back(engine)


def _run(engine, *lanes: Lane):
    future = engine.submit(PassRequest(list(lanes), lambda logits: logits.argmax(-1).tolist()))
    engine.run_until_idle()
    return future.result()


def test_a_pass_needing_more_state_slots_than_the_pool_has_fails_alone(folder, reference):
    """The pool has at least 32 slots (16 pages of this model's KV would hold only 15 states); a pass
    keeping 39 checkpoints needs 40: it fails with the count, and both working sets go on with
    transformers' greedy tokens."""
    engine = make_engine(folder, num_pages=16)
    try:
        assert engine.kv.state_stats()["total"] == 32
        seq, neighbour = engine.create_sequence(), engine.create_sequence()
        first = _run(engine, Lane(seq, PROMPT), Lane(neighbour, OTHER))
        before = engine.kv.state_stats()
        tail = list(range(100, 140))
        with pytest.raises(OutOfStates, match=r"needs 40 recurrent-state slots \(the state after it and 39 "
                                              r"checkpoints\), 30 of the 32 are free or prefix snapshots"):
            _run(engine, Lane(seq, tail, fold=False, checkpoints=list(range(L + 1, L + 40))))
        assert engine.kv.state_stats() == before and engine.kv.length(seq) == L
        out = [[t] for t in first]
        for _ in range(3):
            for o, t in zip(out, _run(engine, Lane(seq, [out[0][-1]]), Lane(neighbour, [out[1][-1]]))):
                o.append(t)
        assert out == [hf_greedy(reference, PROMPT, 4)[0], hf_greedy(reference, OTHER, 4)[0]]
        engine.free(seq)
        engine.free(neighbour)
        _all_back(engine)
    finally:
        engine.close()
