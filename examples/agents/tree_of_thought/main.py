"""Tree of thought: branches forked from one working set, scored, and the best one expanded.

The question is prefilled once into a working set. At each level the last pass's epilogue gives
the `branching` most likely next tokens; each starts a branch in a fork of the working set
(`ws.fork`: the branches share its frozen pages and compute only their own tokens). All branches
of a level decode greedily side by side (one pass, a lane per branch) for `thought_tokens`
tokens, and each is scored by the mean log-probability the model gave its tokens. The best
branch becomes the working set the next level forks from; the others are dropped (their own
pages return) before their last token goes in. One more pass feeds the best branch's last token
and gives the next level's starts; the last level needs none. After `depth` levels the best path
is the answer. Each level is streamed to the client as it is decided, numbered.

Input (all optional): "question", "branching" (2), "depth" (3), "thought_tokens" (6).
Output: {"prompt": its tokens, "levels": [{"seq", "branches": [{"tokens", "text", "score"}],
"best"}], "path": the best branches' tokens in order, "text", "forks"}.
"""
from itertools import accumulate

from inferlet import chat, model, session
from inferlet.eta import (ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, eq, gather, intrinsics,
                          iota, log_softmax, reduce_argmax, select)


def ranked(lane: int, k: int, vocab: int) -> list:
    """The lane's `k` most likely next tokens as [token, log-probability] pairs, flattened: an
    argmax, then that token masked out, unrolled at trace time."""
    logprobs, pairs = log_softmax(intrinsics.output(lane, "logits")), []
    for _ in range(k):
        token = reduce_argmax(logprobs)
        pairs += [token, gather(logprobs, token)]
        logprobs = select(eq(iota(vocab, dtype.i64), token), float("-inf"), logprobs)
    return pairs


async def step(pipe, sets: list, feeds: list[list[int]], k: int, vocab: int) -> list[list]:
    """One pass, a lane per working set fed its tokens: each lane's top `k` as (tokens, logprobs)."""
    fwd = ForwardPass()
    fwd.embed([t for feed in feeds for t in feed], [0, *accumulate(map(len, feeds))])
    fwd.state(sets, StateGeometry.folding())
    lanes = len(sets)
    result = fwd.epilogue(lambda: [x for lane in range(lanes) for x in ranked(lane, k, vocab)])
    pipe.submit(fwd)
    flat = await result
    lane_pairs = [flat[2 * k * i:2 * k * (i + 1)] for i in range(lanes)]
    return [(pairs[0::2], pairs[1::2]) for pairs in lane_pairs]


async def main(input: dict) -> dict:
    question = input.get("question", "How could a small town cut its traffic? Think step by step.")
    branching, depth = int(input.get("branching", 2)), int(input.get("depth", 3))
    length, vocab = int(input.get("thought_tokens", 6)), model.output_vocab_size()
    prompt = chat.user(question) + chat.cue_without_thinking()
    pipe, ws = Pipeline(), WorkingSet()
    [(starts, start_logprobs)] = await step(pipe, [ws], [prompt], branching, vocab)
    levels, path, forks = [], [], 0
    for seq in range(depth):
        sets = [ws.fork(pipe) for _ in range(branching)]
        forks += branching
        tokens = [[t] for t in starts]
        logprobs = [[lp] for lp in start_logprobs]
        for _ in range(length - 1):                 # the branches' own tokens, greedy, one lane each
            tops = await step(pipe, sets, [[t[-1]] for t in tokens], 1, vocab)
            for i, ([token], [lp]) in enumerate(tops):
                tokens[i].append(token)
                logprobs[i].append(lp)
        scores = [sum(lp) / len(lp) for lp in logprobs]
        best = max(range(branching), key=lambda i: scores[i])
        level = {"seq": seq, "best": best, "branches": [
            {"tokens": tokens[i], "text": model.decode(tokens[i]), "score": scores[i]} for i in range(branching)]}
        levels.append(level)
        session.send(level)
        path += tokens[best]
        ws = sets[best]
        del sets
        if seq + 1 < depth:       # the best branch's last token goes in; its pass gives the next starts
            [(starts, start_logprobs)] = await step(pipe, [ws], [[tokens[best][-1]]], branching, vocab)
    pipe.close()
    return {"prompt": prompt, "levels": levels, "path": path, "text": model.decode(path), "forks": forks}
