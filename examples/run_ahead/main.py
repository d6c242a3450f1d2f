"""Loop-carried decoding on the device.

The prompt runs as one pass whose first token comes back to the host. After that a single
decode pass repeats on the engine: its input is a channel, and its epilogue writes the chosen
token both into that channel (the next run's input, no host round trip) and into an output
channel the host reads. `pipe.run_ahead` keeps the pass in flight; the host only reads tokens
and, once per window, tells the engine how far it has read. Nothing here waits on each token (the
text is sent at the end), so the program is woken once per window's tokens (`wake_every`): it sees
a stop token up to a window's runs late, which are computed and cut off. The tokens are exactly
those of one-pass-per-token greedy decoding.

input: {"prompt": str, "max_tokens": int}  ->  {"text", "tokens"}
"""
from inferlet import chat, model
from inferlet.eta import (Channel, ForwardPass, Pipeline, StateGeometry, WorkingSet, dtype, intrinsics,
                          reduce_argmax, reshape)


def greedy():
    return reduce_argmax(intrinsics.output(0, "logits"))


async def main(input: dict) -> dict:
    prompt = chat.prefix() + model.encode(input.get("prompt", "The capital of France is"))
    max_tokens = int(input.get("max_tokens", 32))
    stop = set(chat.stop_tokens())
    ws, pipe = WorkingSet(), Pipeline()

    first = ForwardPass()
    first.embed(prompt)
    first.state([ws], StateGeometry.folding())
    token = first.epilogue(greedy)
    pipe.submit(first)
    tokens = [await token]

    token_in = Channel.from_([tokens[0]], dtype.i32)              # the decode pass's input
    token_out = Channel([1], dtype.i32).capacity(model.channel_capacity())
    step = ForwardPass()
    step.embed(token_in, Channel.from_([0, 1], dtype.u32))
    step.state([ws], StateGeometry.folding())

    @step.epilogue
    def _():
        chosen = reshape(greedy(), [1])
        token_in.put(chosen)          # device -> device: the next run's input
        token_out.put(chosen)         # device -> host

    async def on_token():
        tokens.append(await token_out.take_scalar())
        return tokens[-1] not in stop and len(tokens) < max_tokens

    if tokens[0] not in stop and max_tokens > 1:
        await pipe.run_ahead(step, max_tokens - 1, on_token, wake_every=model.run_ahead_window())
    pipe.close()
    if tokens[-1] in stop:
        tokens.pop()
    return {"text": model.decode(tokens), "tokens": tokens}
