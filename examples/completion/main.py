from inferlet import chat, model
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax


async def main(input: dict) -> dict:
    tokens = chat.prefix() + model.encode(input.get("prompt", "The capital of France is"))
    ws = WorkingSet()
    pipe = Pipeline()

    done = 0
    for _ in range(8):
        fwd = ForwardPass()
        fwd.embed(tokens[done:])                     # feed only the new tokens
        fwd.state([ws], StateGeometry.folding())     # append to state and freeze
        out = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        done = len(tokens)
        tokens.append(await out)
    pipe.close()

    return {"text": model.decode(tokens[-8:])}
