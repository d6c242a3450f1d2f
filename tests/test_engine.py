"""Engine behaviour on the default model: batching, prefix sharing, fork, bad input."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from pie_actors.gpu.engine import Lane, PassError, PassRequest
from pie_actors.kvstore import OutOfPages, UnknownSequence
from pie_actors.gpu.kernels import cpu_kernels
from tests.engine_helpers import make_engine

ARGMAX = lambda logits: int(logits[-1].argmax())    # noqa: E731


@pytest.fixture(scope="module")
def engine(default_model_dir):
    """The engine as shipped (huge pages on); test_the_huge_page_edit_leaves_greedy_tokens_unchanged
    checks that the edit's off switch gives the same tokens."""
    return make_engine(default_model_dir, num_pages=512)


@pytest.fixture(autouse=True)
def accounting_holds(request):
    """Every scenario ends with the page accounting intact and nothing referenced."""
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        eng.kv.check()
        assert eng.kv.stats()["referenced"] == 0


PROMPTS = [
    "The capital of France is", "List three colors:", "def add(a, b):", "Water boils at",
    "My favourite book is", "1, 2, 3, 4,", "The quick brown fox", "In 1492, Columbus",
]


def test_batch_invariance(engine):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    alone = [engine.generate([p], 16, ignore_eos=True)[0] for p in prompts]
    before = sum(engine.batch_sizes.values())
    together = engine.generate(prompts, 16, ignore_eos=True)
    assert together == alone
    assert max(engine.batch_sizes) == 8
    assert sum(engine.batch_sizes.values()) - before == 16      # one batch per decoding step


@pytest.mark.parametrize("edit", ["hugepages", "cpu_linear_kernel"])
def test_a_cpu_speed_edit_switched_off_gives_the_same_greedy_tokens(engine, default_model_dir, edit):
    """The engine as shipped and one with the edit off: the same tokens, prefills and decode batches."""
    off = make_engine(default_model_dir, num_pages=64, **{edit: False})
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert engine.generate(prompts, 12, ignore_eos=True) == off.generate(prompts, 12, ignore_eos=True)
    off.kv.check()


def test_linear_layers_of_a_few_rows_run_the_cpu_kernel(engine, default_model_dir):
    """Decode steps and short prefills run every linear layer, the LM head's too, through the kernel;
    a long prefill and an engine with the switch off run the BLAS's."""
    def kernel_calls(eng, lanes: int, tokens: int) -> int:
        seqs = [eng.create_sequence() for _ in range(lanes)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            done = eng.submit(PassRequest([Lane(s, list(range(100, 100 + tokens))) for s in seqs], ARGMAX))
            eng.run_until_idle()
            done.result()
        for s in seqs:
            eng.free(s)
        return sum(e.count for e in prof.key_averages() if e.key == "pie_cpu::linear_rows")
    layers = engine.model_config.num_layers * 5 + 1            # qkv, o, gate, up, down a layer; the LM head
    assert kernel_calls(engine, 4, 1) == layers                 # one pass of 4 lanes: one batch of 4 rows
    assert kernel_calls(engine, 1, 2 * cpu_kernels.LINEAR_MAX_ROWS) == 1   # a long prefill: only the LM head's row
    off = make_engine(default_model_dir, num_pages=16, cpu_linear_kernel=False)
    assert kernel_calls(off, 2, 1) == 0


def test_generate_keeps_batches_within_the_token_budget(engine, default_model_dir):
    """generate packs lanes into passes of at most max_batch_tokens: long prompts prefill over
    several batches, their decode steps share one."""
    small = make_engine(default_model_dir, num_pages=64, max_batch_tokens=16)
    prompts = [engine.tokenizer.encode(p * 3)[:10] for p in PROMPTS[:3]]
    assert small.generate(prompts, 4, ignore_eos=True) == engine.generate(prompts, 4, ignore_eos=True)
    assert small.batch_sizes == {1: 3, 3: 3}      # three 10-token prefills alone, then 3 steps of 3 lanes
    small.kv.check()


def test_mixed_prefill_and_decode_in_one_batch(engine):
    tok = engine.tokenizer
    a, b = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[2] * 8)
    want_b = engine.generate([b], 4, ignore_eos=True)[0]
    seq_a, seq_b = engine.create_sequence(), engine.create_sequence()
    first = engine.submit(PassRequest([Lane(seq_a, a)], ARGMAX))
    engine.run_until_idle()
    # a decode step of A and the whole prefill of B run in one batch
    fa = engine.submit(PassRequest([Lane(seq_a, [first.result()])], ARGMAX))
    fb = engine.submit(PassRequest([Lane(seq_b, b)], ARGMAX))
    assert engine.step() == 2
    assert fb.result() == want_b[0]
    assert fa.result() == engine.generate([a], 2, ignore_eos=True)[0][1]
    engine.free(seq_a), engine.free(seq_b)


def test_a_lane_with_an_empty_readout_gives_no_rows(engine):
    """readout [] reads out none of a lane's rows (the data plane counts a pass's rows the same way);
    the lane's KV is still written."""
    tok = engine.tokenizer
    a, b = tok.encode(PROMPTS[0]), tok.encode(PROMPTS[3])
    seq_a, seq_b = engine.create_sequence(), engine.create_sequence()
    f = engine.submit(PassRequest([Lane(seq_a, a, readout=[]), Lane(seq_b, b, readout=[0, len(b) - 1])]))
    engine.run_until_idle()
    logits = f.result()
    assert logits.shape == (2, engine.model_config.vocab_size)
    assert int(logits[1].argmax()) == engine.generate([b], 1, ignore_eos=True)[0][0]
    assert engine.seq_state(seq_a)["length"] == len(a)
    engine.free(seq_a), engine.free(seq_b)


def test_prefix_sharing_reuses_pages_and_keeps_outputs(engine):
    tok = engine.tokenizer
    common = (tok.encode("Here is a long shared context about the history of computing. ") * 20)[:200]
    first_tail, second_tail = tok.encode(" Question one?"), tok.encode(" A different question?")
    reference = engine.generate([common + second_tail], 8, ignore_eos=True)[0]   # new text: nothing shared

    s1 = engine.create_sequence()
    engine.submit(PassRequest([Lane(s1, common + first_tail)], ARGMAX))
    engine.run_until_idle()
    used_by_first = engine.kv.stats()["referenced"]

    s2 = engine.create_sequence()
    fut = engine.submit(PassRequest([Lane(s2, common + second_tail)], ARGMAX))
    engine.run_until_idle()
    assert engine.kv.cached_tokens(s2) >= 192
    grew = engine.kv.stats()["referenced"] - used_by_first
    assert grew <= 2, "the second sequence should only add pages for its own tail"
    out = [fut.result()]
    for _ in range(7):
        f = engine.submit(PassRequest([Lane(s2, [out[-1]])], ARGMAX))
        engine.run_until_idle()
        out.append(f.result())
    assert out == reference
    engine.free(s1), engine.free(s2)


def test_prefix_is_reused_across_requests(engine):
    prompt = engine.tokenizer.encode("A sentence that is repeated to fill pages. " * 12)
    first = engine.generate([prompt], 4, ignore_eos=True)
    seq = engine.create_sequence()
    engine.submit(PassRequest([Lane(seq, prompt)], ARGMAX))
    engine.run_until_idle()
    assert engine.kv.cached_tokens(seq) >= (len(prompt) - 1) // 16 * 16
    engine.free(seq)
    assert engine.generate([prompt], 4, ignore_eos=True) == first


def test_fork_shares_frozen_pages(engine):
    prompt = engine.tokenizer.encode("Tell me a story about a dragon and a knight. " * 5)   # > 2 pages, partial tail
    parent = engine.create_sequence()
    engine.submit(PassRequest([Lane(parent, prompt)], ARGMAX))
    engine.run_until_idle()
    before = engine.kv.stats()["referenced"]
    children = [engine.fork(parent) for _ in range(4)]
    after = engine.kv.stats()["referenced"]
    assert after - before == 4 * (1 if len(prompt) % 16 else 0), "only tail pages are copied"
    nxt = [engine.submit(PassRequest([Lane(c, [42])], ARGMAX)) for c in children]
    ref = engine.submit(PassRequest([Lane(parent, [42])], ARGMAX))
    engine.run_until_idle()
    assert {f.result() for f in nxt} == {ref.result()}
    for s in children + [parent]:
        engine.free(s)


def test_concurrent_clients_with_background_loop(default_model_dir):
    eng = make_engine(default_model_dir, num_pages=256).start()
    prompts = [eng.tokenizer.encode(p) for p in PROMPTS[:4]]
    want = [eng.generate([p], 8, ignore_eos=True)[0] for p in prompts]
    results = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, eng.generate([prompts[i]], 8, ignore_eos=True)[0])) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    eng.close()
    assert results == want
    assert max(eng.batch_sizes) > 1
    eng.kv.check()


def test_a_started_engine_freezes_the_heap_a_collection_would_walk_and_close_thaws_it(default_model_dir):
    eng = make_engine(default_model_dir, num_pages=64)
    assert any(o is eng for o in gc.get_objects())       # collections walk what is not frozen
    eng.start()
    try:
        assert gc.get_freeze_count() > 0
        assert not any(o is eng for o in gc.get_objects())
        prompt = eng.tokenizer.encode(PROMPTS[0])
        alone = make_engine(default_model_dir).generate([prompt], 2, ignore_eos=True)
        assert eng.generate([prompt], 2, ignore_eos=True) == alone
    finally:
        eng.close()
    assert gc.get_freeze_count() == 0
    assert any(o is eng for o in gc.get_objects())


# ---- bad input: a clear error for the bad pass, the others still served ---------------------------

def _run_with_good_neighbour(engine, bad: PassRequest):
    good_seq = engine.create_sequence()
    prompt = engine.tokenizer.encode(PROMPTS[0])
    good = engine.submit(PassRequest([Lane(good_seq, prompt)], ARGMAX))
    engine.submit(bad)
    engine.run_until_idle()
    assert good.result() == engine.generate([prompt], 1)[0][0]
    engine.free(good_seq)
    return bad.future.exception()


def test_out_of_vocabulary_token(engine):
    seq = engine.create_sequence()
    err = _run_with_good_neighbour(engine, PassRequest([Lane(seq, [1, 2, 10**6])]))
    assert isinstance(err, PassError) and "1000000" in str(err) and "vocabulary" in str(err)
    assert engine.kv.length(seq) == 0
    engine.free(seq)


def test_position_beyond_context(engine):
    seq = engine.create_sequence()
    err = _run_with_good_neighbour(engine, PassRequest([Lane(seq, [1], positions=[10**6])]))
    assert isinstance(err, PassError) and "context" in str(err)
    engine.free(seq)


def test_freed_sequence(engine):
    seq = engine.create_sequence()
    engine.free(seq)
    err = _run_with_good_neighbour(engine, PassRequest([Lane(seq, [1, 2])]))
    assert isinstance(err, UnknownSequence) and str(seq) in str(err)


def test_out_of_pages_fails_only_that_pass(default_model_dir):
    eng = make_engine(default_model_dir, num_pages=8)
    big = eng.create_sequence()
    err = _run_with_good_neighbour(eng, PassRequest([Lane(big, list(range(1000, 1200)))]))
    assert isinstance(err, OutOfPages)
    assert eng.kv.length(big) == 0
    eng.free(big)
    eng.kv.check()
    assert eng.kv.stats()["referenced"] == 0


def test_multi_lane_pass_rolls_back_every_lane(engine):
    a, b = engine.create_sequence(), engine.create_sequence()
    fut = engine.submit(PassRequest([Lane(a, [5, 6, 7]), Lane(b, [5, 6], kv_len=99)]))
    engine.run_until_idle()
    assert isinstance(fut.exception(), PassError) and "kv_len" in str(fut.exception())
    assert engine.kv.length(a) == 0 and engine.kv.length(b) == 0
    engine.free(a), engine.free(b)


def test_failed_pass_returns_reused_prefix_pages(engine):
    prompt = engine.tokenizer.encode("Some words to make a prefix that fills pages. " * 6)
    engine.generate([prompt], 1)                 # now cached: a second sequence would reuse it
    before = engine.kv.stats()
    a, b = engine.create_sequence(), engine.create_sequence()
    fut = engine.submit(PassRequest([Lane(a, prompt + [13]), Lane(b, [1, 2], kv_len=99)]))
    engine.run_until_idle()
    assert isinstance(fut.exception(), PassError)
    assert (engine.kv.length(a), engine.kv.folded(a), engine.kv.cached_tokens(a)) == (0, 0, 0)
    assert engine.kv.stats() == before
    engine.free(a), engine.free(b)


def test_failing_epilogue_fails_only_its_pass(engine):
    seq = engine.create_sequence()
    err = _run_with_good_neighbour(engine, PassRequest([Lane(seq, [1, 2])], lambda l: 1 / 0))
    assert isinstance(err, ZeroDivisionError)
    engine.free(seq)


def test_explicit_geometry_matches_folding(engine):
    """Writing rows at explicit slots/positions gives the same logits as appending them."""
    prompt = engine.tokenizer.encode(PROMPTS[3])
    n = len(prompt)
    s1, s2 = engine.create_sequence(), engine.create_sequence()
    want = engine.submit(PassRequest([Lane(s1, prompt)]))
    engine.kv.reserve(s2, n)
    got = engine.submit(PassRequest([Lane(s2, prompt, positions=list(range(n)), slots=list(range(n)),
                                          fold=n)]))
    engine.run_until_idle()
    torch.testing.assert_close(got.result(), want.result(), atol=1e-4, rtol=1e-4)
    assert engine.kv.folded(s2) == n
    engine.free(s1), engine.free(s2)


def test_a_failing_adapter_fails_only_its_pass(engine):
    """Adapter code runs inside the model: its pass is batched alone, so its failure is its own."""
    seq = engine.create_sequence()
    wrong_shape = lambda x, y: y[:, :3]                 # noqa: E731
    err = _run_with_good_neighbour(engine, PassRequest([Lane(seq, [1, 2])], ARGMAX,
                                                       adapters=[("down", 1, wrong_shape)]))
    assert isinstance(err, ValueError) and "adapter at 'down' returned shape [2, 3]" in str(err)
    assert engine.kv.length(seq) == 0
    engine.free(seq)


def test_adapter_sites():
    from pie_actors.gpu.model.adapters import parse_site
    assert parse_site("o", 30) == ("o", None) and parse_site("layers.29.q", 30) == ("q", 29)
    for bad in ("layers.30.q", "lm_head", "layers.x.q", 3):
        with pytest.raises(ValueError, match="unknown adapter site"):
            parse_site(bad, 30)
