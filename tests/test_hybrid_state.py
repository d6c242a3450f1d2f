"""A hybrid model's working sets: fork and save / open carry the recurrent state with the KV pages.

On a small random Qwen3.5 folder, a forked working set and a saved one opened again (its pages kept,
spilled to host memory, or dropped and recomputed) continue with the tokens of an unbroken greedy
run, which transformers gives; every test ends with the pages and state slots all back.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pie_actors.gpu.engine.scheduler import Lane, PassRequest
from pie_actors.kvstore import InvalidSlot
from tests.engine_helpers import hf_greedy, make_engine, save_tiny_model

PROMPT = [(5 * i + 11) % 512 for i in range(33)]
BEFORE, AFTER = 3, 5                       # tokens decoded before the fork or save, and after


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5", seed=1)


@pytest.fixture(scope="module")
def expected(folder) -> list[int]:
    import transformers
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return hf_greedy(reference, PROMPT, BEFORE + AFTER)[0]


def _greedy(logits) -> list[int]:
    return logits.argmax(-1).tolist()


def _decode(engine, seqs: list[int], feeds: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens for each of `seqs` (batched), the first pass fed `feeds`."""
    out: list[list[int]] = [[] for _ in seqs]
    for _ in range(n):
        future = engine.submit(PassRequest([Lane(s, f) for s, f in zip(seqs, feeds)], _greedy))
        engine.run_until_idle()
        for o, token in zip(out, future.result()):
            o.append(token)
        feeds = [[o[-1]] for o in out]
    return out


def _all_back(engine) -> None:
    engine.kv.check()
    assert engine.kv.stats()["referenced"] == 0 and engine.kv.state_stats()["held"] == 0


def test_fork_copies_the_state_and_shares_the_pages(folder, expected):
    engine = make_engine(folder, num_pages=32)
    try:
        parent = engine.create_sequence()
        [before] = _decode(engine, [parent], [PROMPT], BEFORE)
        child = engine.fork(parent)
        # two full frozen pages shared, the partial tail page copied
        assert engine.kv.kv_pages(child)[:2] == engine.kv.kv_pages(parent)[:2]
        assert engine.kv.kv_pages(child)[2] != engine.kv.kv_pages(parent)[2]
        # parent and child decode in one batch from the same state: each as an unbroken run
        after = _decode(engine, [parent, child], [[before[-1]], [before[-1]]], AFTER)
        assert [before + a for a in after] == [expected, expected]
        engine.free(parent)
        # the child's state is its own: it goes on after its parent is gone
        assert _decode(engine, [child], [[after[1][-1]]], 1)[0][0] == _decode_fresh(engine, expected)
        engine.free(child)
        _all_back(engine)
    finally:
        engine.close()


def _decode_fresh(engine, expected: list[int]) -> int:
    """The token after PROMPT + expected on a fresh working set."""
    seq = engine.create_sequence()
    try:
        return _decode(engine, [seq], [PROMPT + expected], 1)[0][0]
    finally:
        engine.free(seq)


def test_fork_of_unfrozen_rows_is_refused(folder):
    engine = make_engine(folder, num_pages=16)
    try:
        seq = engine.create_sequence()
        engine.submit(PassRequest([Lane(seq, PROMPT, fold=False)], _greedy))
        engine.run_until_idle()
        with pytest.raises(InvalidSlot, match=r"state is kept at 33 rows and at \[16, 32\], not at 0"):
            engine.fork(seq)
        engine.free(seq)
        _all_back(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("restored", ["kept", "spilled", "recomputed"])
def test_saved_set_opens_with_its_state(folder, expected, restored):
    # 12 pages of 16 tokens; the saved set holds 3; a 170-token prompt needs 11: the set leaves the
    # pool, to a spill buffer with room for it or (none) as its tokens
    spill_mb = 0 if restored == "recomputed" else 4
    engine = make_engine(folder, num_pages=12, spill_memory_mb=spill_mb)
    try:
        seq = engine.create_sequence()
        [before] = _decode(engine, [seq], [PROMPT], BEFORE)
        assert engine.save(seq, "notes", None) == len(PROMPT) + BEFORE - 1
        engine.free(seq)
        if restored != "kept":
            hog = engine.create_sequence()
            _decode(engine, [hog], [[(3 * i) % 512 for i in range(170)]], 1)
            engine.free(hog)
            assert engine.list_saved(None)[0]["state"] == ("tokens" if restored == "recomputed" else "spilled")
        opened, future = engine.open("notes", None)
        engine.run_until_idle()
        assert future.result()["restored"] == restored
        [after] = _decode(engine, [opened], [[before[-1]]], AFTER)
        assert before + after == expected
        engine.free(opened)
        engine.delete_saved("notes", None)
        _all_back(engine)
    finally:
        engine.close()


def test_prefix_reuse_starts_from_the_snapshot_at_a_page_boundary(folder):
    """A prompt sharing two pages with an earlier one reuses them and the recurrent state there
    (`cached_tokens` 32) and gives transformers' tokens, as a run without the prefix cache does."""
    import transformers
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    shared = [(7 * i + 2) % 512 for i in range(40)]
    first, second = shared + [5] * 10, shared + [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2]
    expected = hf_greedy(reference, second, 6)[0]
    for prefix_cache in (True, False):
        engine = make_engine(folder, num_pages=32, prefix_cache=prefix_cache)
        try:
            engine.generate([first], 2, ignore_eos=True)
            seq = engine.create_sequence()
            [out] = _decode(engine, [seq], [second], 6)
            assert engine.seq_state(seq)["cached_tokens"] == (32 if prefix_cache else 0)
            assert out == expected
            engine.free(seq)
            _all_back(engine)
            assert (engine.kv.state_stats()["snapshots"] > 0) == prefix_cache
        finally:
            engine.close()
