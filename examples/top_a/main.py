"""Top-a sampling, the sampler of the epilogue documentation, verbatim.

`top_a` keeps the tokens whose probability is at least a * p_max^2 and samples among them with
`gumbel_max`; the whole function is traced once and fused into one device program. The seed of
each step is put into a channel by the host (host -> device) and taken by the epilogue, so the
same seed gives the same tokens and another seed other tokens.

input: {"prompt", "max_tokens", "a", "seed"}  ->  {"text", "tokens"}
"""
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, broadcast, dtype, ge,
                          gumbel_max, intrinsics, reduce_max, select, softmax)


def top_a(logits, vocab, a, rng):
    probs = softmax(logits)
    p_max = reduce_max(probs)
    keep = ge(probs, broadcast(a * p_max * p_max, [vocab]))
    masked = select(keep, logits, broadcast(float("-inf"), [vocab]))
    return gumbel_max(masked, rng)


async def main(input: dict) -> dict:
    tokens = chat.prefix() + model.encode(input.get("prompt", "Once upon a time"))
    max_tokens, a, seed = int(input.get("max_tokens", 16)), float(input.get("a", 0.2)), int(input.get("seed", 0))
    vocab, stop = model.output_vocab_size(), set(chat.stop_tokens())
    rng = Channel([1], dtype.i64)
    ws, pipe = WorkingSet(), Pipeline()

    out, feed = [], tokens
    for step in range(max_tokens):
        rng.put([seed * 1_000_000 + step])
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        token = fwd.epilogue(lambda: top_a(intrinsics.output(0, "logits"), vocab, a, rng.take()))
        pipe.submit(fwd)
        out.append(await token)
        if out[-1] in stop:
            out.pop()
            break
        feed = out[-1:]
    pipe.close()
    return {"text": model.decode(out), "tokens": out}
