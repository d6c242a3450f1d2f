"""The `examples/` inferlets of issue 4, each run end to end against the default model: what each
one claims is checked against plain greedy decoding, the engine's own logits, or the KV pool."""
from __future__ import annotations

import re

import pytest
import torch

from pie_actors.gpu.engine import Lane, PassRequest
from pie_actors.inferlet.chat_ops import ChatTokens
from tests.inferlet_helpers import EXAMPLES, referenced, run, settle


def example(name: str) -> str:
    return (EXAMPLES / name / "main.py").read_text()


def greedy(engine, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one pass per token, cut before the first stop token."""
    tokens = engine.generate([prompt], n, ignore_eos=True)[0]
    stop = set(ChatTokens(engine.tokenizer).stop_tokens())
    return tokens[:next((i for i, t in enumerate(tokens) if t in stop), n)]


def log_probs(engine, prompt: list[int], continuations: list[list[int]]) -> list[torch.Tensor]:
    """The engine's next-token log-probabilities before each token of each continuation of `prompt`
    ([n, vocab] each): the prompt in one pass, then a fork per continuation, read out at every row."""
    root = engine.create_sequence()
    seqs = [root]
    try:
        engine.submit(PassRequest([Lane(root, prompt[:-1])])).result()
        seqs += [engine.fork(root) for _ in continuations]
        lanes = [Lane(seq, prompt[-1:] + c, readout=list(range(len(c))))
                 for seq, c in zip(seqs[1:], continuations)]
        rows = engine.submit(PassRequest(lanes)).result().float().log_softmax(-1)
        return list(rows.split([len(c) for c in continuations]))
    finally:
        for seq in seqs:
            engine.free(seq)


def encode(engine, text: str) -> list[int]:
    return ChatTokens(engine.tokenizer).prefix() + engine.tokenizer.encode(text)


def chat_prompt(engine, text: str) -> list[int]:
    chat = ChatTokens(engine.tokenizer)
    return chat.user(text) + chat.cue_without_thinking()


def pages(tokens: int, engine) -> int:
    return -(-tokens // engine.kv.page_size)


def test_run_ahead_equals_per_token_greedy(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        out = run(runtime, example("run_ahead"), {"prompt": prompt, "max_tokens": 24})
        assert out["tokens"] == greedy(engine, encode(engine, prompt), 24)
    settle(runtime, start)


def test_speculative_equals_greedy_and_accepts_drafts_of_repetitive_text(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    n = 24
    for prompt in ("The capital of France is", "def fibonacci(n):", "Water boils at"):
        out = run(runtime, example("speculative"), {"prompt": prompt, "max_tokens": n})
        assert out["tokens"] == greedy(engine, encode(engine, prompt), n), prompt
    prompt = "one, two, three, one, two, three, one,"
    out = run(runtime, example("speculative"), {"prompt": prompt, "max_tokens": n})
    assert out["tokens"] == greedy(engine, encode(engine, prompt), n)
    assert out["accepted"] >= n // 2 and out["passes"] <= n // 2, out      # several tokens per pass
    settle(runtime, start)


def test_beam_search_forks_share_the_prompt_pages(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    question = "Name a famous painting."
    prompt = chat_prompt(engine, question)
    width1 = run(runtime, example("beam_search"), {"prompt": question, "width": 1, "max_tokens": 30})
    assert width1["tokens"] == greedy(engine, prompt, 30) and width1["forks"] == 0

    long_question = "Here is a long question about paintings and painters. " * 40 + question
    prompt = chat_prompt(engine, long_question)
    held: list[int] = []                   # pages referenced at each step, all beams alive
    out = run(runtime, example("beam_search"), {"prompt": long_question, "width": 4, "max_tokens": 8},
              on_send=lambda _: held.append(runtime.stats()["kv"]["referenced"] - start))
    copies = 4 * pages(len(prompt), engine)           # four beams each holding its own prompt
    assert len(prompt) > 400 and out["forks"] >= 3
    # the prompt's pages once, plus each fork's copied tail page and its own few tokens
    assert max(held) <= pages(len(prompt) + 8, engine) + 2 * out["forks"] < copies, (held, out["forks"])
    # the scores are the engine's log-probabilities of the beams, best first
    scores = [beam["score"] for beam in out["beams"]]
    assert scores == sorted(scores, reverse=True) and len({tuple(b["tokens"]) for b in out["beams"]}) == 4
    beams = [beam["tokens"] for beam in out["beams"]]
    for beam, lp in zip(out["beams"], log_probs(engine, prompt, beams)):
        want = lp[torch.arange(len(beam["tokens"])), torch.tensor(beam["tokens"])].sum().item()
        assert beam["score"] == pytest.approx(want, abs=1e-3)
    settle(runtime, start)


def test_prefix_sharing_computes_the_prompt_once(runtime, monkeypatch):
    engine = runtime.engine
    start = referenced(runtime)
    computed = [0]                                        # rows the model ran
    execute = engine.worker.execute

    def counting(plan):
        computed[0] += len(plan.input_ids)
        return execute(plan)
    monkeypatch.setattr(engine.worker, "execute", counting)

    winds = ["north", "south", "east", "west"]
    text = " ".join(f"Entry {i}: the tide was {i % 7} feet and the wind came from the {winds[i % 4]}."
                    for i in range(30)) + " Summary:"
    prompt, n = encode(engine, text), 6
    assert 450 <= len(prompt) <= 600
    first = run(runtime, example("prefix_sharing"), {"prompt": text, "max_tokens": n, "seed": 1})
    assert first["prompt_tokens"] == len(prompt) and first["cached_tokens"] == 0
    assert first["folded"] == [len(prompt) + n - 1] * 10
    assert computed[0] == len(prompt) + 10 * (n - 1)      # the prompt once, then one row per branch step
    assert len({tuple(t) for t in first["tokens"]}) > 1    # ten seeds, not ten copies of one completion

    computed[0] = 0                    # again: the prompt's frozen pages are found from the first run
    again = run(runtime, example("prefix_sharing"), {"prompt": text, "max_tokens": n, "seed": 1})
    assert again["tokens"] == first["tokens"]
    assert again["cached_tokens"] == (len(prompt) - 1) // 16 * 16
    assert computed[0] == len(prompt) - again["cached_tokens"] + 10 * (n - 1)

    greedy_branches = run(runtime, example("prefix_sharing"),
                          {"prompt": text, "max_tokens": n, "temperature": 0})
    assert greedy_branches["tokens"] == [engine.generate([prompt], n, ignore_eos=True)[0]] * 10
    settle(runtime, start)


def test_sliding_window_holds_a_fixed_number_of_pages(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    prompt = "1, 2, 3, 4, 5,"
    window = {"sink": 4, "window": 16, "chunk": 8}
    peaks, outs = [], []
    for n in (30, 100):
        held: list[int] = []
        outs.append(run(runtime, example("sliding_window"), {"prompt": prompt, "max_tokens": n, **window},
                        on_send=lambda _, held=held: held.append(runtime.stats()["kv"]["referenced"] - start)))
        peaks.append(max(held))
    slots = outs[1]["slots"]
    assert slots == 4 + 16 + 8 and outs[1]["positions"] > 3 * slots      # the ring wrapped three times
    assert peaks == [pages(slots, engine)] * 2 < [pages(outs[1]["positions"], engine)] * 2
    # before the window slides the tokens are full attention's; after, it still counts
    slide = 4 + 16 - len(encode(engine, prompt)) + 1
    assert outs[1]["tokens"][:slide] == greedy(engine, encode(engine, prompt), slide)
    numbers = [int(x) for x in re.findall(r"\d+", outs[1]["text"])]
    assert len(numbers) > 20 and numbers == list(range(6, 6 + len(numbers))), outs[1]["text"]

    # what scrolled out of the window is gone: the word is recalled only without eviction
    recall = "The secret word is pumpkin. " + "The sky is blue. " * 12 + "The secret word is"
    full = greedy(engine, encode(engine, recall), 4)
    kept = run(runtime, example("sliding_window"), {"prompt": recall, "max_tokens": 4, "window": 200})
    lost = run(runtime, example("sliding_window"), {"prompt": recall, "max_tokens": 4, **window})
    assert "pumpkin" in engine.tokenizer.decode(full) and kept["tokens"] == full
    assert "pumpkin" not in lost["text"]
    settle(runtime, start)


def _sampled(runtime, name, seeds, **input) -> list[list[int]]:
    return [run(runtime, example(name), {**input, "seed": seed})["tokens"] for seed in seeds]


def test_top_a_is_seeded_and_samples_inside_its_set(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    prompt, a = "Once upon a time", 0.2
    one, again, two = _sampled(runtime, "top_a", (1, 1, 2), prompt=prompt, a=a, max_tokens=12)
    assert one == again != two
    # each token has probability >= a * p_max^2 under the engine's logits
    for tokens, lp in zip([one, two], log_probs(engine, encode(engine, prompt), [one, two])):
        probs = lp.exp()
        chosen = probs[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert (chosen >= a * probs.amax(-1) ** 2 * (1 - 1e-4)).all()
    # a = 1 keeps only tokens with p >= p_max^2: on a confident continuation, greedy's tokens
    counting = "1, 2, 3, 4, 5,"
    [out] = _sampled(runtime, "top_a", (3,), prompt=counting, a=1.0, max_tokens=12)
    assert out == greedy(engine, encode(engine, counting), 12)
    settle(runtime, start)


def test_temperature_is_seeded_and_greedy_at_zero(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    prompt = "Once upon a time"
    one, again, two = _sampled(runtime, "temperature", (1, 1, 2), prompt=prompt, temperature=0.8,
                               max_tokens=12)
    assert one == again != two
    want = greedy(engine, encode(engine, prompt), 12)
    for t in (0, 1e-4):                  # the argmax program, and gumbel_max with the noise swamped
        runs = _sampled(runtime, "temperature", (1, 2), prompt=prompt, temperature=t, max_tokens=12)
        assert runs == [want] * 2
    settle(runtime, start)


def test_watermark_detector_scores_watermarked_text_high_and_plain_text_low(runtime):
    engine = runtime.engine
    start = referenced(runtime)
    source = example("watermark")
    for seed in (0, 1):
        marked = run(runtime, source, {"seed": seed, "delta": 4.0, "max_tokens": 40})
        plain = run(runtime, source, {"seed": seed, "delta": 0.0, "max_tokens": 40})
        assert marked["z"] > 4 and abs(plain["z"]) < 3, (marked, plain)
        # the detector on its own: the same score from the text alone; another key finds nothing
        alone = run(runtime, source, {"detect": marked["tokens"]})
        assert alone["z"] == pytest.approx(marked["z"]) and alone["scored"] == len(marked["tokens"]) - 1
        assert abs(run(runtime, source, {"detect": marked["tokens"], "key": 7})["z"]) < 3
    settle(runtime, start)
