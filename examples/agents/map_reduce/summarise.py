"""Greedy decoding of one prompt in a fresh working set, token by token (what the workers and the
coordinator share); `on_token` sees each token as it comes."""
from inferlet import chat
from inferlet.eta import Pipeline, WorkingSet, generate


async def greedy(prompt: list[int], max_tokens: int, on_token=None) -> list[int]:
    """The reply's tokens (its stop token left out)."""
    ws, pipe, reply = WorkingSet(), Pipeline(), []
    async for token in generate(ws, pipe, list(prompt), max_tokens, chat.stop_tokens()):
        reply.append(token)
        if on_token is not None:
            on_token(token)
    pipe.close()
    return reply


def prompt(instruction: str, text: str) -> list[int]:
    """A chat prompt asking for `instruction` on `text`."""
    return chat.system("You summarise text in a few words.") + chat.user(f"{instruction}\n\n{text}") \
        + chat.cue_without_thinking()
