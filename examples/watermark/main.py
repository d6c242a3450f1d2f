"""A greenlist watermark (Kirchenbauer et al., 2023) and its detector.

Generating: before each pass the host puts a seed derived from the secret `key` and the previous
token into a channel. The epilogue draws that seed's Gumbel noise over the vocabulary; the tokens
whose noise exceeds the (1 - gamma) quantile, -log(-log(1 - gamma)), form a pseudo-random "green"
list holding a fraction `gamma` of the vocabulary. It adds `delta` to the green tokens' logits and
samples (`gumbel_max`, with a separate sampling seed). Nothing but the token leaves the device.

Detecting needs only the text and the key: a token is green when it is in the green list seeded by
its predecessor, and z = (green - gamma n) / sqrt(n gamma (1 - gamma)) over the n scored tokens.
Plain text scores about 0; watermarked text scores high. The green lists are computed by the same
device noise, in one epilogue (an epilogue runs after a pass, so it rides on a one-token pass).

input: {"prompt", "max_tokens", "delta", "gamma", "key", "seed", "temperature"}
   ->  {"text", "tokens", "z"}          (delta 0 generates without the watermark)
input: {"detect": token ids, "gamma", "key"}  ->  {"z", "green", "scored"}
"""
import math
from itertools import pairwise

from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, cast, dtype, gather,
                          gt, gumbel, gumbel_max, intrinsics)


def threshold(gamma: float) -> float:
    """The Gumbel(0, 1) value exceeded with probability gamma."""
    return -math.log(-math.log(1 - gamma))


def green_seed(key: int, previous: int) -> int:
    return key * 1_000_000 + previous


def watermarked(logits, vocab, green_rng, sample_rng, gamma, delta, temperature):
    green = cast(gt(gumbel([vocab], green_rng), threshold(gamma)), dtype.f32)
    return gumbel_max((logits + delta * green) / temperature, sample_rng)


async def generate(input: dict) -> list[int]:
    tokens = chat.user(input.get("prompt", "Write a short story about a cat.")) + chat.cue_without_thinking()
    max_tokens, seed = int(input.get("max_tokens", 48)), int(input.get("seed", 0))
    gamma, delta, key = float(input.get("gamma", 0.25)), float(input.get("delta", 4.0)), int(input.get("key", 42))
    temperature = float(input.get("temperature", 1.0))
    vocab, stop = model.output_vocab_size(), set(chat.stop_tokens())
    green_rng, sample_rng = Channel([1], dtype.i64), Channel([1], dtype.i64)
    ws, pipe = WorkingSet(), Pipeline()

    out, feed = [], tokens
    for step in range(max_tokens):
        green_rng.put([green_seed(key, feed[-1])])
        sample_rng.put([seed * 1_000_000 + step])
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        token = fwd.epilogue(lambda: watermarked(intrinsics.output(0, "logits"), vocab, green_rng.take(),
                                                 sample_rng.take(), gamma, delta, temperature))
        pipe.submit(fwd)
        out.append(await token)
        if out[-1] in stop:
            out.pop()
            break
        feed = out[-1:]
    pipe.close()
    return out


async def detect(tokens: list[int], gamma: float, key: int) -> tuple[int, int]:
    """(green tokens, tokens scored): each token after the first, against its predecessor's list."""
    vocab = model.output_vocab_size()
    pairs = list(pairwise(tokens))
    if not pairs:
        return 0, 0

    def count_green():
        count = 0
        for previous, token in pairs:
            noise = gumbel([vocab], green_seed(key, previous))
            count = count + cast(gt(gather(noise, token), threshold(gamma)), dtype.i32)
        return count

    fwd = ForwardPass()
    fwd.embed(tokens[:1])
    fwd.state([WorkingSet()], StateGeometry.folding())
    green = fwd.epilogue(count_green)
    pipe = Pipeline()
    pipe.submit(fwd)
    green = await green
    pipe.close()
    return green, len(pairs)


def z_score(green: int, n: int, gamma: float) -> float:
    return (green - gamma * n) / math.sqrt(n * gamma * (1 - gamma)) if n else 0.0


async def main(input: dict) -> dict:
    gamma, key = float(input.get("gamma", 0.25)), int(input.get("key", 42))
    if "detect" in input:
        green, scored = await detect([int(t) for t in input["detect"]], gamma, key)
        return {"z": z_score(green, scored, gamma), "green": green, "scored": scored}
    tokens = await generate(input)
    green, scored = await detect(tokens, gamma, key)
    return {"text": model.decode(tokens), "tokens": tokens, "z": z_score(green, scored, gamma)}
