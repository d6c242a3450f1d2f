"""One long prompt, many completions: the prompt is computed once and shared.

The prompt runs as one pass into a working set; its epilogue samples the first token of every
branch from the same last-row logits (one `gumbel_max` per branch seed, unrolled at trace time).
Each branch then forks the working set (`ws.fork(pipe)`): the fork shares the prompt's frozen
KV pages and copies at most its partly filled last page, so a branch computes only its own
tokens. The branches decode `max_tokens` tokens side by side (their texts end at a stop token),
one pass each per step, submitted together so the engine batches them. Seeds come from a
channel per branch; temperature 0 is greedy (a Python `if` chooses the traced program).

`folded` counts each branch's frozen tokens (the shared prompt plus its own); `cached_tokens` is
how much of the prompt pass itself was found in pages an earlier request computed (the engine
deduplicates frozen pages across requests, so running this twice reuses the prompt).

input: {"prompt", "branches", "max_tokens", "temperature", "seed"}
   ->  {"texts", "tokens", "prompt_tokens", "cached_tokens", "folded"}
"""
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, gumbel_max,
                          intrinsics, reduce_argmax)

DOCUMENT = ("The lighthouse keeper wrote in his log every evening: the colour of the sea, the ships "
            "that passed, the birds that rested on the rail, and the weather he expected for the "
            "night. ") * 12


def seed_for(seed: int, branch: int, step: int) -> int:
    return (seed * 1_000 + branch) * 1_000_000 + step


def sample(temperature: float, seed):
    logits = intrinsics.output(0, "logits")
    if temperature == 0:
        return reduce_argmax(logits)
    return gumbel_max(logits / temperature, seed)


async def main(input: dict) -> dict:
    prompt = chat.prefix() + model.encode(input.get("prompt", DOCUMENT + "Write the next entry:"))
    branches, max_tokens = int(input.get("branches", 10)), int(input.get("max_tokens", 16))
    temperature, seed = float(input.get("temperature", 0.8)), int(input.get("seed", 0))
    rngs = [Channel([1], dtype.i64).capacity(max_tokens) for _ in range(branches)]
    for b, rng in enumerate(rngs):
        rng.put([seed_for(seed, b, 0)])
    pipe = Pipeline()

    root = WorkingSet()
    fwd = ForwardPass()
    fwd.embed(prompt)
    fwd.state([root], StateGeometry.folding())
    first = fwd.epilogue(lambda: [sample(temperature, rng.take()) for rng in rngs])
    pipe.submit(fwd)
    first = await first
    tokens = [[t] for t in (first if isinstance(first, list) else [first])]
    working_sets = [root.fork(pipe) for _ in range(branches)]

    for step in range(1, max_tokens):
        nexts = []
        for b, (ws, rng) in enumerate(zip(working_sets, rngs)):
            rng.put([seed_for(seed, b, step)])
            fwd = ForwardPass()
            fwd.embed(tokens[b][-1:])
            fwd.state([ws], StateGeometry.folding())
            nexts.append(fwd.epilogue(lambda rng=rng: sample(temperature, rng.take())))
            pipe.submit(fwd)
        for b, token in enumerate(nexts):
            tokens[b].append(await token)
    pipe.close()

    stop = set(chat.stop_tokens())
    texts = [model.decode(t[:next((i for i, x in enumerate(t) if x in stop), len(t))]) for t in tokens]
    return {"texts": texts, "tokens": tokens, "prompt_tokens": len(prompt),
            "cached_tokens": root.cached_tokens(), "folded": [ws.folded() for ws in working_sets]}
