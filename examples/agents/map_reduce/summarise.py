"""Greedy decoding of one prompt in a fresh working set, token by token (what the workers and the
coordinator share); `on_token` sees each token as it comes."""
from inferlet import chat
from inferlet.eta import ForwardPass, Pipeline, StateGeometry, WorkingSet, intrinsics, reduce_argmax


async def greedy(prompt: list[int], max_tokens: int, on_token=None) -> list[int]:
    """The reply's tokens (its stop token left out)."""
    ws, pipe, stops = WorkingSet(), Pipeline(), set(chat.stop_tokens())
    feed, reply = list(prompt), []
    for _ in range(max_tokens):
        fwd = ForwardPass()
        fwd.embed(feed)
        fwd.state([ws], StateGeometry.folding())
        chosen = fwd.epilogue(lambda: reduce_argmax(intrinsics.output(0, "logits")))
        pipe.submit(fwd)
        token = await chosen
        if token in stops:
            break
        reply.append(token)
        if on_token is not None:
            on_token(token)
        feed = [token]
    pipe.close()
    return reply


def prompt(instruction: str, text: str) -> list[int]:
    """A chat prompt asking for `instruction` on `text`."""
    return chat.system("You summarise text in a few words.") + chat.user(f"{instruction}\n\n{text}") \
        + chat.cue_without_thinking()
