from inferlet import chat, model, session
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax

STOP = set(chat.stop_tokens())


async def generate(ws, pipe, tokens, max_tokens=256):
    """Feed `tokens`, then decode greedily until a stop token. Yields each new token."""
    for _ in range(max_tokens):
        fwd = ForwardPass()
        fwd.embed(tokens)
        fwd.state([ws], StateGeometry.folding())
        nxt = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        token = await nxt
        if token in STOP:
            return
        yield token
        tokens = [token]


async def main(input: dict) -> dict:
    prompt = (chat.system("You are a concise assistant.")
              + chat.user(input["question"])
              + chat.cue_without_thinking())
    ws, pipe = WorkingSet(), Pipeline()

    reply, sent = [], ""
    async for token in generate(ws, pipe, prompt):
        reply.append(token)
        text = model.decode(reply)
        session.send(text[len(sent):])     # stream the newly decoded text
        sent = text
    pipe.close()
    return {"text": model.decode(reply)}
