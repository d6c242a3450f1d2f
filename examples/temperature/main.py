"""Temperature sampling with `gumbel_max`, decoded on the device.

argmax(logits / T + Gumbel noise) is a sample of softmax(logits / T), so the epilogue samples
with one op and only the token id leaves the device. The noise comes from a seed that lives in
a channel: each step takes it, samples with it and puts seed + 1 back (device -> device), and
puts the token into the next pass's input, so the loop runs ahead on the engine with no host
round trip per token (as in examples/run_ahead), and a seed reproduces its tokens exactly.
Temperature 0 is greedy: a Python `if` runs at trace time and picks the program that is traced.

input: {"prompt", "max_tokens", "temperature", "seed"}  ->  {"text", "tokens"}
"""
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, gumbel_max,
                          intrinsics, reduce_argmax, reshape)


async def main(input: dict) -> dict:
    prompt = chat.prefix() + model.encode(input.get("prompt", "Once upon a time"))
    max_tokens, seed = int(input.get("max_tokens", 16)), int(input.get("seed", 0))
    temperature = float(input.get("temperature", 0.8))
    stop = set(chat.stop_tokens())
    rng = Channel.from_([seed], dtype.i64)
    token_in = Channel([1], dtype.i32)
    token_out = Channel([1], dtype.i32).capacity(model.channel_capacity())
    ws, pipe = WorkingSet(), Pipeline()

    def sample():
        logits = intrinsics.output(0, "logits")
        if temperature == 0:
            token = reduce_argmax(logits)
        else:
            step_seed = rng.take()
            rng.put(step_seed + 1)
            token = gumbel_max(logits / temperature, step_seed)
        token = reshape(token, [1])
        token_in.put(token)
        token_out.put(token)

    first = ForwardPass()                            # the prompt
    first.embed(prompt)
    first.state([ws], StateGeometry.folding())
    first.epilogue(sample)
    pipe.submit(first)
    tokens = [await token_out.take_scalar()]

    step = ForwardPass()                             # then one token at a time, fed on the device
    step.embed(token_in, Channel.from_([0, 1], dtype.u32))
    step.state([ws], StateGeometry.folding())
    step.epilogue(sample)

    async def on_token():
        tokens.append(await token_out.take_scalar())
        return tokens[-1] not in stop and len(tokens) < max_tokens

    if tokens[0] not in stop and max_tokens > 1:
        await pipe.run_ahead(step, max_tokens - 1, on_token)
    pipe.close()
    if tokens[-1] in stop:
        tokens.pop()
    return {"text": model.decode(tokens), "tokens": tokens}
