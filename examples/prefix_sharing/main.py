"""One long prompt, many completions: the prompt is computed once and shared.

The prompt runs as one pass into a working set; its epilogue samples the first token of every
branch from the same last-row logits (one `gumbel_max` per branch, unrolled at trace time).
Each branch then forks the working set (`ws.fork(pipe)`): the fork shares the prompt's frozen
KV pages and copies at most its partly filled last page, so a branch computes only its own
tokens. Each step is then one pass with a lane per branch. The branches' seeds live in one
channel that each epilogue takes and puts back advanced (device -> device), so a step costs one
submit and one await. Temperature 0 is greedy (a Python `if` chooses the traced program). Every
branch decodes `max_tokens` tokens; its text ends at a stop token.

`folded` counts each branch's frozen tokens (the shared prompt plus its own); `cached_tokens` is
how much of the prompt pass itself was found in pages an earlier request computed (the engine
deduplicates frozen pages across requests, so running this twice reuses the prompt).

input: {"prompt", "branches", "max_tokens", "temperature", "seed"}
   ->  {"texts", "tokens", "prompt_tokens", "cached_tokens", "folded"}
"""
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, gather, gumbel_max,
                          intrinsics, reduce_argmax)

DOCUMENT = ("The lighthouse keeper wrote in his log every evening: the colour of the sea, the ships "
            "that passed, the birds that rested on the rail, and the weather he expected for the "
            "night. ") * 12


def listed(result) -> list:
    """An epilogue's result as a list (one output comes back as itself)."""
    return result if isinstance(result, list) else [result]


async def main(input: dict) -> dict:
    prompt = chat.prefix() + model.encode(input.get("prompt", DOCUMENT + "Write the next entry:"))
    branches, max_tokens = int(input.get("branches", 10)), int(input.get("max_tokens", 16))
    temperature, seed = float(input.get("temperature", 0.8)), int(input.get("seed", 0))
    seeds = Channel.from_([(seed * 1_000 + b) * 1_000_000 for b in range(branches)], dtype.i64)
    stop = set(chat.stop_tokens())
    pipe = Pipeline()

    def draw(lanes: int) -> list:
        """A token for every branch: from lane b's logits, or all from lane 0's (the prompt's)."""
        if temperature == 0:
            return [reduce_argmax(intrinsics.output(b % lanes, "logits")) for b in range(branches)]
        step_seeds = seeds.take()
        seeds.put(step_seeds + 1)
        return [gumbel_max(intrinsics.output(b % lanes, "logits") / temperature, gather(step_seeds, b))
                for b in range(branches)]

    root = WorkingSet()
    fwd = ForwardPass()
    fwd.embed(prompt)
    fwd.state([root], StateGeometry.folding())
    first = fwd.epilogue(lambda: draw(1))
    pipe.submit(fwd)
    tokens = [[t] for t in listed(await first)]
    working_sets = [root.fork(pipe) for _ in range(branches)]

    for _ in range(1, max_tokens):
        fwd = ForwardPass()
        fwd.embed([t[-1] for t in tokens], list(range(branches + 1)))     # a lane per branch
        fwd.state(working_sets, StateGeometry.folding())
        nexts = fwd.epilogue(lambda: draw(branches))
        pipe.submit(fwd)
        for branch, token in zip(tokens, listed(await nexts)):
            branch.append(token)
    pipe.close()

    texts = [model.decode(t[:next((i for i, x in enumerate(t) if x in stop), len(t))]) for t in tokens]
    return {"texts": texts, "tokens": tokens, "prompt_tokens": len(prompt),
            "cached_tokens": root.cached_tokens(), "folded": [ws.folded() for ws in working_sets]}
