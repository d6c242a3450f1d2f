"""A hybrid model's rollback: recurrent-state checkpoints let a working set go back, as rewriting
unfrozen KV slots does on an attention model.

Explicit slots keep the state at each row they leave unfrozen, so a later pass rewrites from any of
them (a speculative pass's rejected drafts); `Lane.checkpoints` keeps the state where asked, for a
`truncate` back to it. Logits after each rollback equal transformers' on the sequence that is left;
bad slots fail only their pass; the pages and state slots all return.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pie_actors.gpu.engine.scheduler import Lane, PassError, PassRequest
from pie_actors.kvstore import InvalidSlot
from tests.engine_helpers import make_engine, save_tiny_model

PROMPT = [(3 * i + 5) % 512 for i in range(20)]
L = len(PROMPT)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "tiny-qwen3_5", seed=2)


@pytest.fixture(scope="module")
def reference(folder):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def engine(folder):
    eng = make_engine(folder, num_pages=32)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def accounting_holds(engine):
    yield
    engine.kv.check()
    assert engine.kv.stats()["referenced"] == 0 and engine.kv.state_stats()["held"] == 0


def _run(engine, lane: Lane) -> torch.Tensor:
    future = engine.submit(PassRequest([lane]))
    engine.run_until_idle()
    return future.result()


def _last_rows(reference, tokens: list[int], n: int) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0, -n:]


def test_explicit_slots_rewrite_unfrozen_rows(engine, reference):
    seq = engine.create_sequence()
    try:
        _run(engine, Lane(seq, PROMPT))
        engine.reserve(seq, L + 16)
        drafts = [11, 12, 13, 14]                   # written at L..L+3, only L frozen
        rows = _run(engine, Lane(seq, drafts, slots=list(range(L, L + 4)), fold=L + 1, readout=[0, 1, 2, 3]))
        torch.testing.assert_close(rows, _last_rows(reference, PROMPT + drafts, 4), rtol=1e-4, atol=1e-4)
        # the drafts after the second were wrong: rewrite from slot L + 2, freezing up to L + 3
        rows = _run(engine, Lane(seq, [21, 22], slots=[L + 2, L + 3], fold=L + 3, readout=[0, 1]))
        kept = PROMPT + drafts[:2] + [21, 22]
        torch.testing.assert_close(rows, _last_rows(reference, kept, 2), rtol=1e-4, atol=1e-4)
        with pytest.raises(InvalidSlot, match="slot L is frozen".replace("L", str(L + 1))):
            _run(engine, Lane(seq, [9], slots=[L + 1], fold=L + 2))
        # the working set goes on after the failed pass: rewrite the unfrozen last row, then append
        _run(engine, Lane(seq, [31], slots=[L + 3], fold=L + 4))
        [row] = _run(engine, Lane(seq, [32]))
        torch.testing.assert_close(row, _last_rows(reference, kept[:-1] + [31, 32], 1)[0], rtol=1e-4, atol=1e-4)
    finally:
        engine.free(seq)


def test_checkpoints_let_a_truncate_go_back(engine, reference):
    seq = engine.create_sequence()
    tail = [41, 42, 43, 44]
    try:
        _run(engine, Lane(seq, PROMPT))
        with pytest.raises(PassError, match="checkpoint slot 99 is outside the pass's slots"):
            _run(engine, Lane(seq, tail, fold=False, checkpoints=[99]))
        _run(engine, Lane(seq, tail, fold=False, checkpoints=[L + 2]))
        with pytest.raises(InvalidSlot, match=f"not at {L + 1}"):
            engine.kv.truncate(seq, L + 1)          # no checkpoint there: nothing changes
        assert engine.kv.length(seq) == L + 4
        engine.kv.truncate(seq, L + 2)
        [row] = _run(engine, Lane(seq, [51]))
        torch.testing.assert_close(row, _last_rows(reference, PROMPT + tail[:2] + [51], 1)[0],
                                   rtol=1e-4, atol=1e-4)
        with pytest.raises(InvalidSlot, match="cannot truncate"):
            engine.kv.truncate(seq, L)              # past the frozen prefix
    finally:
        engine.free(seq)


def test_a_pinned_length_is_where_a_run_ahead_cuts_back_to(engine, reference):
    """What a run-ahead does when it stops with runs nobody read (`Scheduler._end_repeat`): the
    length pinned before the first unread run is cut back to, frozen rows included."""
    seq = engine.create_sequence()
    try:
        _run(engine, Lane(seq, PROMPT))
        engine.kv.pin(seq)                          # before the runs
        for token in (61, 62, 63):
            _run(engine, Lane(seq, [token]))
        assert engine.kv.folded(seq) == L + 3
        with pytest.raises(InvalidSlot, match=f"not at {L + 1}"):
            engine.kv.cut(seq, L + 1)               # never pinned: the state there is gone
        engine.scheduler.copies.extend(engine.kv.cut(seq, L))
        engine.kv.unpin(seq, L)
        [row] = _run(engine, Lane(seq, [71]))
        torch.testing.assert_close(row, _last_rows(reference, PROMPT + [71], 1)[0], rtol=1e-4, atol=1e-4)
    finally:
        engine.free(seq)
